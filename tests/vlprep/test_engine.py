"""vlprep.engine: map_shards' resume, order, errors and executors; the one-line errors; the import direction."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlprep import VlprepError
from vlprep.engine import Work, check_engine, make_executor, map_shards
from vlprep.output import Out, shard_done, write_shard

_state: dict = {}


def _init(tag: str) -> None:
    _state["tag"] = tag
    _state["inits"] = _state.get("inits", 0) + 1


def _write(out: Out, n: int, fp: str) -> dict:
    """A shard of n samples whose caption names the worker's initializer tag and process."""
    shard = f"s-{n:06d}.tar"
    samples = [{"__key__": f"k{n}_{i}", "txt": f"{_state['tag']} {i}"} for i in range(n)]
    rows = [{"key": s["__key__"]} for s in samples]
    stats = {"in": n, "written": n, "fingerprint": fp}
    write_shard(out, shard, samples, rows, stats=stats)
    return {**stats, "pid": os.getpid(), "inits": _state["inits"]}  # who ran it: returned, not stored


def _fail(out: Out, n: int, fp: str) -> dict:
    raise VlprepError(f"shard {n} is bad")


def _lifeline(out: Out, n: int, fp: str) -> dict:
    """What a pool worker set up to die with its driver (vlprep.lifeline)."""
    import ctypes
    import signal
    import threading

    got = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0)  # PR_GET_PDEATHSIG
    return {"pdeathsig": got.value, "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
            "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "watchdog": "vlprep-lifeline" in [t.name for t in threading.enumerate()]}


def plan(sizes, salt="a"):
    return [Work(f"s-{n:06d}.tar", (n,), f"{salt}{n}", n) for n in sizes]


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".tar", ".parquet")}


def test_runs_every_shard_in_plan_order_and_resumes_by_fingerprint(tmp_path):
    stats, resumed = map_shards(Out(tmp_path), plan([3, 1, 2]), _write, init=_init, initargs=("x",))
    assert list(stats) == ["s-000003.tar", "s-000001.tar", "s-000002.tar"] and resumed == set()
    assert all(s["inits"] == 1 and s["pid"] == os.getpid() for s in stats.values())  # inline: init ran once, here
    (tmp_path / "s-000001.tar").unlink()  # a shard that never finished
    stats2, resumed = map_shards(Out(tmp_path), plan([3, 1, 2]), _write, init=_init, initargs=("x",))
    assert resumed == {"s-000003.tar", "s-000002.tar"} and list(stats2) == list(stats)
    assert stats2["s-000003.tar"] == {"in": 3, "written": 3, "fingerprint": "a3"}  # the stored counts come back
    stats3, resumed = map_shards(Out(tmp_path), plan([3, 1, 2], salt="b"), _write, init=_init, initargs=("x",))
    assert resumed == set()  # another fingerprint: every shard is rebuilt
    assert shard_done(Out(tmp_path), "s-000002.tar")["fingerprint"] == "b2"


def test_nothing_to_do_starts_no_worker(tmp_path):
    map_shards(Out(tmp_path), plan([2]), _write, init=_init, initargs=("x",))
    _state.clear()
    stats, resumed = map_shards(Out(tmp_path), plan([2]), _write, init=_init, initargs=("x",), workers=2)
    assert resumed == {"s-000002.tar"} and "inits" not in _state


def test_a_pool_gives_the_same_bytes_and_runs_the_initializer_once_per_worker(tmp_path):
    sizes = [5, 1, 4, 2, 3, 6]
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    map_shards(Out(tmp_path / "one"), plan(sizes), _write, init=_init, initargs=("x",))
    _state.clear()  # forked workers start from this process's state
    stats, _ = map_shards(Out(tmp_path / "two"), plan(sizes), _write, init=_init, initargs=("x",), workers=2)
    assert files(tmp_path / "one") == files(tmp_path / "two")
    pids = {s["pid"] for s in stats.values()}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2
    assert all(s["inits"] == 1 for s in stats.values())  # once per worker process, not once per shard


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_pool_workers_die_with_their_driver_and_leave_ctrl_c_to_it(tmp_path, start):
    """The kernel kills them when the driver exits (even kill -9), a thread watches the driver, SIGTERM kills them
    (a forked worker does not keep the driver's handler) and Ctrl-C is the driver's to handle."""
    import signal

    stats, _ = map_shards(Out(tmp_path), plan([1, 2]), _lifeline, workers=2, start=start)
    assert list(stats.values()) == [{"pdeathsig": signal.SIGKILL, "sigint_ignored": True, "sigterm_default": True,
                                     "watchdog": True}] * 2


def test_progress_advances_by_each_shards_samples(tmp_path):
    class Bar:
        def __init__(self):
            self.done, self.total = 0, None

        def add_task(self, label, total):
            self.total = total
            return 0

        def advance(self, task, n):
            self.done += n

    bar = Bar()
    map_shards(Out(tmp_path), plan([3, 4]), _write, init=_init, initargs=("x",), progress=bar, total=7)
    assert (bar.done, bar.total) == (7, 7)
    bar = Bar()
    map_shards(Out(tmp_path), plan([3, 4]), _write, init=_init, initargs=("x",), progress=bar, total=7)
    assert bar.done == 7  # resumed shards count too


def test_a_worker_error_reaches_the_caller_as_itself(tmp_path):
    with pytest.raises(VlprepError, match="shard 2 is bad"):
        map_shards(Out(tmp_path), plan([2]), _fail)
    with pytest.raises(VlprepError, match="shard [23] is bad"):
        map_shards(Out(tmp_path), plan([2, 3]), _fail, workers=2)


def test_a_shard_planned_twice_is_refused(tmp_path):
    with pytest.raises(VlprepError, match="planned twice"):
        map_shards(Out(tmp_path), plan([2, 2]), _write, init=_init, initargs=("x",))


def test_bad_engine_options_are_one_line():
    with pytest.raises(VlprepError, match="unknown --distributor 'spark'; use local or ray"):
        check_engine("spark", 2)
    with pytest.raises(VlprepError, match="--workers must be at least 1"):
        check_engine("local", 0)
    with pytest.raises(VlprepError, match="--workers must be at least 1"):
        make_executor("local", 0)


def test_ray_missing_is_one_line_naming_the_extra(tmp_path, monkeypatch, capfd):
    """Ray hidden as if not installed (sys.modules["ray"] = None makes `import ray` raise ImportError), the CLI run
    in this process: what is checked is the import's failure and its message, not a process boundary."""
    from tests.conftest import cli_in_process, image_bytes

    monkeypatch.setitem(sys.modules, "ray", None)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a caption")
    (src / "a.png").write_bytes(image_bytes())
    for stage in (["shards", str(src), str(tmp_path / "o")], ["bow", str(src), str(tmp_path / "o")]):
        r = cli_in_process(capfd, *stage, "--distributor", "ray")
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip() == "error: --distributor ray needs Ray, which is an extra: pip install -e '.[ray]'"
    assert not (tmp_path / "o").exists()


def test_engine_options_are_not_recorded(tmp_path):
    """--workers and --distributor never change the outputs, so they stay out of the options (a resume with other
    values is the same run)."""
    import json

    from tests.conftest import image_bytes
    from vlprep.bow import BowConfig, bow
    from vlprep.shards import ShardsConfig, build_shards

    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"{i}.png").write_bytes(image_bytes(seed=i))
        (src / f"{i}.txt").write_text(f"a red dog number {i}")
    build_shards(ShardsConfig(src=src, out=tmp_path / "raw", samples_per_shard=2, workers=1))
    again = build_shards(ShardsConfig(src=src, out=tmp_path / "raw", samples_per_shard=2, workers=2))
    assert again["shards_resumed"] == 3
    bow(BowConfig(src=tmp_path / "raw", out=tmp_path / "bow", ops="shuffle", workers=2))
    options = json.loads((tmp_path / "bow" / "meta.json").read_text())["options"]
    assert "workers" not in options and "distributor" not in options


def test_vlprep_never_imports_vltrain():
    """Data flows one way: only vlprep/cli.py brings vltrain in (it builds the encoder embed and pseudolabel take)."""
    import pkgutil

    import vlprep

    names = [f"vlprep.{m.name}" for m in pkgutil.iter_modules(vlprep.__path__) if m.name != "cli"]
    assert {"vlprep.engine", "vlprep.embed", "vlprep.pseudolabel", "vlprep.features"} <= set(names)
    # one fresh interpreter for both checks: vlprep.cli alone first (it must not bring vltrain in), then every
    # other module on top (neither may they); the same two claims as two interpreters, one torch import fewer
    code = ("import importlib, sys\n"
            "import vlprep.cli\n"
            "print('vltrain' in sys.modules)\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m == 'vltrain' or m.startswith('vltrain.')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    cli_alone, every_module = r.stdout.strip().splitlines()
    assert cli_alone == "False"  # even the CLI imports it only when embed or pseudolabel runs
    assert every_module == "[]"


def test_distributor_help_names_the_ray_extra():
    """Rich markup once ate "[ray]" out of every --distributor help line ("needs the  extra")."""
    from typer.testing import CliRunner

    from vlprep.cli import app

    out = CliRunner().invoke(app, ["bow", "--help"], env={"COLUMNS": "200"}).output
    assert "needs the [ray] extra" in out


def test_an_unreachable_ray_address_is_one_line_before_ray_init(monkeypatch):
    """ray.init retries an unreachable RAY_ADDRESS for minutes; the engine tries it first with a timeout (the
    ray:// client form too). Addresses ray.init resolves itself (local, unset) are not tried."""
    from vlprep.engine import _probe_ray_address

    monkeypatch.setenv("VLPREP_RAY_CONNECT_TIMEOUT", "2")
    for address in ("127.0.0.1:1", "ray://127.0.0.1:1"):
        with pytest.raises(VlprepError) as e:
            _probe_ray_address(address)
        assert str(e.value) == (f"cannot reach the Ray cluster at RAY_ADDRESS={address} (connection refused, within "
                                "2 s); start it, fix RAY_ADDRESS, or unset it to start a Ray here")
    import socket

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        _probe_ray_address(f"127.0.0.1:{listening.getsockname()[1]}")  # something answers: ray.init's to judge
    for address in ("", "local"):
        _probe_ray_address(address)
    monkeypatch.setenv("VLPREP_RAY_CONNECT_TIMEOUT", "soon")
    with pytest.raises(VlprepError, match="VLPREP_RAY_CONNECT_TIMEOUT must be a number of seconds"):
        _probe_ray_address("127.0.0.1:1")


def _slow_first(out: Out, n: int, fp: str) -> dict:
    """_write, but the first planned shard (n = 9) finishes last."""
    if n == 9:
        import time

        time.sleep(0.5)
    return _write(out, n, fp)


def test_fold_sees_every_shard_once_in_plan_order_whatever_order_they_finish(tmp_path):
    (tmp_path / "w2").mkdir()
    map_shards(Out(tmp_path), plan([9, 2]), _write, init=_init, initargs=("x",))  # two shards done before
    (tmp_path / "s-000002.tar").unlink()
    seen = []

    def fold(shard: str, counts: dict) -> dict:
        seen.append(shard)
        return {"written": counts["written"]}  # the slimmed counts are what map_shards keeps

    sizes = [9, 2, 3, 4, 5]
    # a resumed first shard, then the pool's: there the slow first shard finishes after the others
    for folder, workers, done_before in ((tmp_path, 1, {"s-000009.tar"}), (tmp_path / "w2", 2, set())):
        seen.clear()
        stats, resumed = map_shards(Out(folder), plan(sizes), _slow_first, init=_init, initargs=("x",),
                                    workers=workers, fold=fold)
        assert resumed == done_before
        assert seen == [f"s-{n:06d}.tar" for n in sizes]
        assert stats == {f"s-{n:06d}.tar": {"written": n} for n in sizes}
