"""Credentials in a dataset URL never reach a file, a log line or an error (vlprep.urls): every vlprep stage
(filter's --exclude eval sets too, and `vlprep view`'s pages), a `vltrain run` (and its resume), `vltrain eval` and
`vltrain export` read datasets from an HTTP server on 127.0.0.1 that wants a secret (basic auth's password in the
URL, or a ?token= query), then every byte they wrote (inside checkpoints too: the zip's members, and the config
torch.load gives back) and every byte they printed is searched for the secret.

The commands run in this process (their `main()` under capfd, which sees what C code, rich, warnings and child
processes write to fds 1 and 2; the warnings and log records they raise are searched too), all but one: a real
`python -m vlprep.cli` keeps the process boundary (Python's own printing at exit) covered."""

import base64
import functools
import json
import os
import subprocess
import sys
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import colour_pairs, tiny_checkpoint
from tests.integration.servers import http_server, need

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
SECRET = "Zq7S3cr3tPw9"
TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.workers=0", "data.max_len=12", "log_every=1", "optim.warmup_steps=2", "eval_every=1"]
# fast retries; and rich's width (read when it prints) wide enough that no table cell is cut short of a secret
ENV = {"VLPREP_REMOTE_TRIES": "2", "VLPREP_REMOTE_BACKOFF": "0.01", "COLUMNS": "200"}


def forms() -> list[bytes]:
    """The secret as it could leak: plain, and inside a basic-auth header."""
    return [SECRET.encode(), base64.b64encode(f"alice:{SECRET}".encode())]


def leaks(data: bytes) -> bool:
    """Whether `data` holds the secret, also across a line that rich wrapped inside it."""
    squeezed = b"".join(data.split())
    return any(f in data or f in squeezed for f in forms())


@dataclass
class Printed:
    """What one command printed (and, run in this process, the warnings and log records it raised)."""
    args: tuple
    returncode: int
    stdout: bytes
    stderr: bytes
    raised: bytes | None = None  # None: a process of its own, whose warnings and logging reach its stderr


def subprocess_run(module: str, *args, ok: bool = True) -> Printed:
    """The command as a process of its own (`python -m MODULE ARGS`)."""
    r = subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, timeout=600,
                       env={**os.environ, **ENV, "PYTHONPATH": str(ROOT)})
    assert (r.returncode == 0) == ok, (args, r.stderr.decode()[-3000:])
    return Printed((module, *args), r.returncode, r.stdout, r.stderr)


def in_process(capfd, caplog, module: str, *args, ok: bool = True) -> Printed:
    """The command's `main()` in this process with its argv, as `python -m MODULE ARGS` runs it: its exit status,
    what reached fds 1 and 2, and every warning (not only the first of each, as a process shows) and log record."""
    from vlprep.cli import main as vlprep_main
    from vltrain.cli import main as vltrain_main

    main = {"vlprep.cli": vlprep_main, "vltrain": vltrain_main}[module]
    capfd.readouterr()
    caplog.clear()
    argv = sys.argv
    sys.argv = [module, *map(str, args)]
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                main()
                code = 0
            except SystemExit as e:  # typer exits 0 on success too; sys.exit("text") would print text, status 1
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    finally:
        sys.argv = argv
    out, err = capfd.readouterr()
    raised = "\n".join([str(w.message) for w in seen] + [caplog.text]).encode()
    assert (code == 0) == ok, (args, code, err[-3000:])
    return Printed((module, *args), code, out.encode(), err.encode(), raised)


def files_leaking(root: Path) -> list[str]:
    """Every file under `root` whose bytes hold the secret; a zip's (a checkpoint's) members are read too, and a
    checkpoint's config as torch.load gives it back."""
    found = []
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        data = p.read_bytes()
        if leaks(data):
            found.append(str(p))
        if zipfile.is_zipfile(p):
            with zipfile.ZipFile(p) as z:
                found += [f"{p}:{m}" for m in z.namelist() if leaks(z.read(m))]
        if p.suffix == ".pt":
            ckpt = torch.load(p, map_location="cpu", weights_only=True)
            if leaks(repr(ckpt.get("config")).encode()):
                found.append(f"{p}: config")
        if p.suffix == ".parquet" and leaks(repr(pq.read_table(p).to_pylist()).encode()):
            found.append(f"{p}: rows")
    return found


def test_no_byte_written_or_printed_holds_the_secret(tmp_path, capfd, caplog, monkeypatch):
    need("fsspec", "aiohttp")
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    src = colour_pairs(tmp_path, 12, per_shard=4)
    keys = [k for f in sorted(src.glob("*.parquet")) for k in pq.read_table(f)["key"].to_pylist()]
    (tmp_path / "dets.jsonl").write_text("".join(
        json.dumps({"key": k, "objects": [{"label": ["cat", "dog"][i % 2], "score": 0.9, "box": [0, 0, 1, 1]}]}) + "\n"
        for i, k in enumerate(keys)))
    ckpt = tiny_checkpoint(tmp_path / "tiny.pt")
    out = tmp_path / "out"
    out.mkdir()
    printed = []
    with http_server(tmp_path, secret=SECRET) as (base, _):
        host = base.removeprefix("http://")
        basic = lambda folder: f"http://alice:{SECRET}@{host}/{folder}/"  # noqa: E731
        token = lambda folder: f"{base}/{folder}/?token={SECRET}"  # noqa: E731
        steps = [
            ("vlprep.cli", "bow", basic("ds"), out / "bow", "--ops", "shuffle,keep:3", "--base-frac", "0.5"),
            ("vlprep.cli", "detect", token("ds"), out / "det", "--from-file", tmp_path / "dets.jsonl"),
            ("vlprep.cli", "ontology", basic("out/det"), out / "onto", "--min-cooccur", "1", "--min-instances", "1"),
            ("vlprep.cli", "features", token("ds"), out / "feat", "--size", "64", "--device", "cpu"),
            ("vlprep.cli", "embed", basic("ds"), out / "emb", "--checkpoint", ckpt, "--device", "cpu"),
            ("vlprep.cli", "pseudolabel", basic("ds"), token("out/bow"), out / "pl", "--checkpoint", ckpt, "--device",
             "cpu"),
            ("vlprep.cli", "stats", token("ds"), "--out", out / "stats"),
            ("vlprep.cli", "filter", basic("ds"), out / "filt", "--dedup", "image", "--exclude", token("ds"),
             "--near-dup", "0.99", "--phash", "4", "--checkpoint", ckpt, "--device", "cpu"),
            ("vlprep.cli", "view", token("out/pl"), "--out", out / "view-pl", "--samples", "6"),
            ("vlprep.cli", "view", basic("out/onto"), "--out", out / "view-onto", "--samples", "6"),
            ("vltrain", "run", basic("ds"), "--out", out / "run", "--steps", "2", "--batch-size", "4", "--device",
             "cpu", "--preset", "clip", *[x for s in TINY for x in ("--set", s)]),
            ("vltrain", "run", basic("ds"), "--out", out / "run", "--steps", "3", "--batch-size", "4", "--device",
             "cpu", "--preset", "clip", "--resume", *[x for s in TINY for x in ("--set", s)]),
            ("vltrain", "eval", out / "run" / "last.pt", token("ds"), "--out", out / "eval.json", "--device", "cpu"),
            ("vltrain", "export", out / "run" / "last.pt", out / "export"),
        ]
        for module, *args in steps:
            printed.append(in_process(capfd, caplog, module, *args))
        # errors: a missing dataset, a wrong token (401), and an s3:// URL with credentials
        errors = [(f"(no sizes.json): http://{host}/nope", "vlprep.cli", "bow", basic("nope"), out / "e1"),
                  ("401", "vlprep.cli", "bow", f"{base}/ds/?token=x{SECRET}", out / "e2"),
                  (f"http://{host}/nope", "vltrain", "run", basic("nope"), "--out", out / "e3", "--device", "cpu",
                   "--preset", "clip", *[x for s in TINY for x in ("--set", s)]),
                  ("AWS_ACCESS_KEY_ID", "vlprep.cli", "bow", f"s3://AKIA:{SECRET}@bkt/ds/", out / "e4")]
        for says, module, *args in errors:
            # the 401 (an aiohttp error that names the URL, token and all) as a real process: what Python prints
            # as it exits (an unretrieved task's exception, a traceback) is then searched too
            run = subprocess_run if says == "401" else functools.partial(in_process, capfd, caplog)
            r = run(module, *args, ok=False)
            lines = r.stderr.decode().strip().splitlines()
            assert r.returncode == 2 and lines[-1].startswith("error: ") and says in lines[-1], lines
            printed.append(r)
    assert json.loads((out / "run" / "result.json").read_text())["step"] == 3
    assert json.loads((out / "bow" / "meta.json").read_text())["input"] == f"http://{host}/ds"
    assert json.loads((out / "det" / "meta.json").read_text())["input"] == f"{base}/ds?token=***"
    assert (out / "export" / "config.json").exists() and (out / "feat" / "sizes.json").exists()
    assert f"{base}/out/pl?token=***" in (out / "view-pl" / "index.html").read_text()  # the page names it, redacted
    assert json.loads((out / "filt" / "meta.json").read_text())["options"]["exclude"] == [f"{base}/ds?token=***"]
    assert sum(r.raised is None for r in printed) == 1  # one ran as a process of its own
    for r in printed:
        assert not leaks(r.stdout + r.stderr), (r.args, (r.stdout + r.stderr).decode()[-3000:])
        assert not leaks(r.raised or b""), (r.args, (r.raised or b"").decode()[-3000:])
    assert files_leaking(out) == []
