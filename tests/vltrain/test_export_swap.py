"""`vltrain export` writes beside OUT and swaps the new export in when it is complete: a kill at any moment leaves a
loadable export at OUT; an export of another checkpoint is replaced only with --overwrite; OUT never overlaps what
the export reads."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import vltrain
from tests.conftest import tiny_checkpoint
from tests.vltrain.test_trainer_usability import error_line
from vltrain.cli import app
from vltrain.export import export


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpts")
    return {"a": tiny_checkpoint(tmp / "a.pt", seed=1), "b": tiny_checkpoint(tmp / "b.pt", seed=2)}


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def source(out: Path) -> str:
    return Path(json.loads((out / "config.json").read_text())["source"]["checkpoint"]).name


def listing(folder: Path) -> list:
    return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*"))


def test_an_export_of_another_checkpoint_is_replaced_only_with_overwrite(ckpts, tmp_path):
    out = tmp_path / "out"
    export(ckpts["a"], out)
    before = listing(out)
    line = error_line(invoke("export", ckpts["b"], out))
    assert "another checkpoint" in line and "--overwrite" in line and "a.pt" in line, line
    assert listing(out) == before and source(out) == "a.pt"
    assert invoke("export", ckpts["a"], out).exit_code == 0  # the same checkpoint again: replaced
    assert invoke("export", ckpts["b"], out, "--overwrite").exit_code == 0
    assert source(out) == "b.pt" and vltrain.load(out, device="cpu").step is None
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left


def test_overwrite_keeps_the_users_other_files(ckpts, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    (out / "sub" / "x").write_text("also mine")
    export(ckpts["a"], out, overwrite=True)
    export(ckpts["b"], out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "sub" / "x").read_text() == "also mine"
    assert source(out) == "b.pt"


def test_the_rename_fallback_replaces_and_an_interrupted_one_is_named(ckpts, tmp_path, monkeypatch):
    """Where the two folders cannot be exchanged in one step (not Linux, or a filesystem without renameat2), OUT is
    renamed aside and the new export renamed in; a kill between the two leaves .OUT.old-*, which the next export
    names instead of writing a new OUT over the lost one."""
    import vltrain.exportfmt as fmt

    monkeypatch.setattr(fmt, "exchange", lambda a, b: False)
    out = tmp_path / "out"
    export(ckpts["a"], out)
    (out / "eval.json").write_text("{}")
    export(ckpts["b"], out, overwrite=True)
    assert source(out) == "b.pt" and not (out / "eval.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    out.rename(tmp_path / ".out.old-12345678")  # as a kill between the two renames leaves it
    line = error_line(invoke("export", ckpts["a"], out))
    assert "interrupted" in line and ".out.old-12345678" in line, line
    assert not out.exists()


def test_out_overlapping_what_the_export_reads_is_refused(ckpts, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    ckpt = run / "last.pt"
    ckpt.write_bytes(ckpts["a"].read_bytes())
    before = listing(run)
    for out in (run, tmp_path):  # the run folder, a folder holding it
        line = error_line(invoke("export", ckpt, out, "--overwrite"))
        assert "contains the input" in line, line
    assert listing(run) == before
    exported = tmp_path / "exp"
    export(ckpt, exported)
    before = listing(exported)
    for out in (exported, exported / "again"):  # an export read as the checkpoint: itself, a folder inside it
        line = error_line(invoke("export", exported, out, "--overwrite"))
        assert str(exported) in line, line
    assert listing(exported) == before
    assert invoke("export", ckpt, run / "export").exit_code == 0  # beside the checkpoint is fine


SERVER = r"""
import os, sys
import torch
from vltrain.export import export
torch.set_num_threads(1)  # no thread pool in the parent: each fork starts clean
export(sys.argv[1], sys.argv[2])  # a first export imports and loads everything once, before the forks
for line in sys.stdin:
    ckpt, out = line.split()
    pid = os.fork()
    if pid == 0:
        try:
            export(ckpt, out, overwrite=True)
        finally:
            os._exit(0)
    print(pid, flush=True)
    os.waitpid(pid, 0)
    print("done", flush=True)
"""


def hidden(out: Path) -> set:
    return {p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")}


def begun(out: Path, before: set, holding: str | None) -> bool:
    """Whether an export into `out` has begun to change anything: a new temporary folder beside OUT (holding the
    file `holding`, when given), or OUT changed."""
    new = [out.parent / name for name in hidden(out) - before]
    if not (out / "config.json").exists():
        return True
    return any(holding is None or (p / holding).exists() for p in new)


@pytest.mark.slow
def test_a_kill_at_any_moment_leaves_the_earlier_or_the_new_export(ckpts, tmp_path):
    """SIGKILL an export (a forked child of one process that imported vltrain once) as soon as it has begun to
    write, 10 ms later, once its weights are written, once its config.json is (the swap is next), and after random
    delays; each time OUT loads, as the earlier export or the new one."""
    out = tmp_path / "out"
    export(ckpts["b"], out)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(ckpts["a"]), str(tmp_path / "warm")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    rng = random.Random(0)
    try:
        for i in range(8):
            want = "a" if i % 2 == 0 else "b"
            before = hidden(out)
            server.stdin.write(f"{ckpts[want]} {out}\n")
            server.stdin.flush()
            pid = int(server.stdout.readline())
            if i < 4:  # as soon as it has begun to write; then with the weights, then the config written
                deadline = time.monotonic() + 60
                holding = [None, None, "model.safetensors", "config.json"][i]
                while not begun(out, before, holding) and time.monotonic() < deadline:
                    time.sleep(0.0002)
                time.sleep(0.01 if i == 1 else 0)
            else:
                time.sleep(rng.uniform(0, 0.3))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            assert server.stdout.readline().strip() == "done"
            assert source(out) in ("a.pt", "b.pt")
            assert vltrain.load(out, device="cpu").encode_texts(["a dog"]).shape == (1, 16)
    finally:
        server.stdin.close()
        server.wait(timeout=60)
    export(ckpts["a"], out, overwrite=True)
    assert source(out) == "a.pt"
