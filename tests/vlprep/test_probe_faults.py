"""Faults a probe of careless and hostile inputs found in `vlprep`, each now one line: overlong option values quoted
whole, a RAY_ADDRESS that is no address (or a ray.init that fails), and --weights files of junk or a plain pickle
answered with torch's advice to load them unsafely."""

import pickle
import socket
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import image_bytes
from vlprep import VlprepError, cut
from vlprep.shards import ShardsConfig, build_shards


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> Path:
    """4 small images with captions in 2 shards."""
    tmp = tmp_path_factory.mktemp("probe")
    src = tmp / "imgs"
    src.mkdir()
    for i in range(4):
        (src / f"img{i}.png").write_bytes(image_bytes(40, 30, seed=i))
        (src / f"img{i}.txt").write_text(f"a picture of thing {i}")
    build_shards(ShardsConfig(src=src, out=tmp / "ds", samples_per_shard=2, workers=1))
    return tmp / "ds"


def error_line(monkeypatch, capsys, *args) -> str:
    """`vlprep ARGS` through the CLI's main(): its exit status must be 2 and its output one 'error:' line."""
    from vlprep.cli import main

    monkeypatch.setattr(sys, "argv", ["vlprep", *map(str, args)])
    with pytest.raises(SystemExit) as e:
        main()
    out = capsys.readouterr()
    lines = [ln for ln in (out.out + out.err).splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), out.out + out.err
    return lines[0]


def test_cut_keeps_short_values_and_cuts_long_ones_to_the_limit():
    assert cut("abc") == "abc" and cut("x" * 80) == "x" * 80
    assert cut("x" * 81) == "x" * 79 + "…" and len(cut("y" * 5000, 120)) == 120


# --- 6. overlong option values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("option, says", [("--image-model", "unknown image model 'zzz"),
                                          ("--dtype", "--dtype must be float16 or float32, got 'zzz"),
                                          ("--device", "--device must be auto, cpu or cuda[:N], got 'zzz"),
                                          ("--distributor", "unknown --distributor 'zzz")])
def test_an_overlong_option_value_is_quoted_cut_to_80_characters(option, says, ds, tmp_path, monkeypatch, capsys):
    """Before: each of these quoted all 5,000 characters of the value in its one line."""
    line = error_line(monkeypatch, capsys, "features", ds, tmp_path / "o", option, "z" * 5000, "--size", 32)
    assert says in line and "z" * 78 + "…" in line and "z" * 79 not in line and len(line) < 250, line[:300]
    assert not (tmp_path / "o").exists()


# --- 8. RAY_ADDRESS -------------------------------------------------------------------------------------------------


def test_a_ray_address_that_is_no_address_is_one_line_naming_it_before_anything_is_written(ds, tmp_path,
                                                                                             monkeypatch, capsys):
    """Before: `ValueError: Invalid address format: garbage`, a traceback from ray's canonicalize_bootstrap_address
    inside ray.init."""
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ADDRESS", "garbage")
    line = error_line(monkeypatch, capsys, "features", ds, tmp_path / "o", "--distributor", "ray", "--size", 32)
    assert line == ("error: RAY_ADDRESS=garbage: not a Ray address; give HOST:PORT (e.g. 127.0.0.1:6379), "
                    "ray://HOST:PORT, auto or local, or unset it to start a Ray here")
    assert not (tmp_path / "o").exists()
    from vlprep.engine import check_ray_address

    for bad in ("garbage", "127.0.0.1", "127.0.0.1:", "127.0.0.1:port", "127.0.0.1:0", "127.0.0.1:65536", ":6379",
                "::1:6379", "ray://127.0.0.1", "http://127.0.0.1:8265"):
        with pytest.raises(VlprepError, match=f"^RAY_ADDRESS={bad}: "):
            check_ray_address(bad)
    for good in ("", "auto", "local", "127.0.0.1:6379", "[::1]:6379", "localhost:1", "ray://127.0.0.1:10001"):
        check_ray_address(good)


@pytest.mark.parametrize("error", [ConnectionError("Could not connect\nto the GCS"), RuntimeError("boom"),
                                   ValueError("Invalid address format")])
def test_an_error_from_ray_init_is_one_line_naming_ray_address(error, monkeypatch):
    """Before: whatever ray.init raised (after the address answered the engine's TCP probe) was a traceback. Only
    127.0.0.1 is ever tried here: a socket this test listens on, and ray.init replaced by one that fails."""
    ray = pytest.importorskip("ray")
    # as if this process had no Ray yet, even when an earlier test left one connected
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    from vlprep import engine

    def failing_init(*args, **kwargs):
        raise error

    monkeypatch.setattr(ray, "init", failing_init)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        monkeypatch.setenv("RAY_ADDRESS", address)
        with pytest.raises(VlprepError) as e:
            engine.ray_connect()
    first = str(error).splitlines()[0]
    assert str(e.value) == (f"cannot connect to the Ray cluster at RAY_ADDRESS={address} ({type(error).__name__}: "
                            f"{first}); start it, fix RAY_ADDRESS, or unset it to start a Ray here")
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(VlprepError, match=r"^cannot start a local Ray \(RAY_ADDRESS is unset\)") as e:
        engine.ray_connect()
    assert "\n" not in str(e.value)


# --- 10. --weights that are no state dict ---------------------------------------------------------------------------


def weights_files(tmp_path: Path) -> list[Path]:
    """Random bytes (torch's unpickler stops on them with an IndexError or with its weights_only advice), and plain
    pickles of protocols 4 and 5 (the advice, after a "Detected pickle protocol" warning)."""
    files = []
    for seed in range(4):
        files.append(tmp_path / f"junk{seed}.pt")
        files[-1].write_bytes(np.random.default_rng(seed).bytes(2048))
    for protocol in (4, 5):
        files.append(tmp_path / f"raw{protocol}.pkl")
        files[-1].write_bytes(pickle.dumps({"a": [1, 2, 3], "b": "x"}, protocol=protocol))
    return files


def test_weights_of_junk_or_a_plain_pickle_never_suggest_loading_them_unsafely(ds, tmp_path, monkeypatch, capsys):
    """Before: the line quoted torch's "Re-running `torch.load` with `weights_only` set to `False` will likely
    succeed", and a plain pickle printed torch's "Detected pickle protocol" UserWarning first."""
    from vlprep.encoders import read_weights

    for path in weights_files(tmp_path):
        line = error_line(monkeypatch, capsys, "features", ds, tmp_path / "o", "--image-model", "torchvision:resnet18",
                          "--weights", path, "--size", 32)
        assert line.startswith(f"error: cannot read weights {path.resolve()}: not a torch state dict"), line
        assert "weights_only" not in line and "False" not in line and "trust" not in line, line
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(VlprepError, match="not a torch state dict"):
                read_weights(path)
        assert not [w for w in caught if "pickle protocol" in str(w.message)], [str(w.message) for w in caught]
    assert not (tmp_path / "o").exists()
