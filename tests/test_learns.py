"""scripts/learns.py, the verdict of `make learns`: PASS only when held-out R@1 reaches FACTOR x chance both ways,
a set too small for that is a FAIL that says so, a run without a held-out evaluation is a one-line error (exit 2),
and a run that cannot learn (learning rate 0) fails on the result.json `vltrain run` writes."""

import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import colour_pairs
from tests.vltrain.test_train import run

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("learns", ROOT / "scripts" / "learns.py")
learns = importlib.util.module_from_spec(spec)
spec.loader.exec_module(learns)


def evaluation(i2t: float, t2i: float, chance: float, n: int = 64) -> dict:
    return {"i2t_r1": i2t, "t2i_r1": t2i, "n_val": n, "chance": {"i2t_r1": chance, "t2i_r1": chance}}


@pytest.mark.parametrize("i2t, t2i, passed", [
    (44.0, 33.0, True),    # the README's figures against a chance of 1.6 x 10 (chance 2 here: needs exactly 20)
    (20.0, 20.0, True),    # exactly 10 x chance passes (2.0 and 20.0 are exact in binary)
    (19.99, 44.0, False),  # one direction just short fails the run
    (44.0, 19.99, False),
])
def test_both_directions_must_reach_ten_times_chance(i2t, t2i, passed):
    ok, line = learns.verdict(evaluation(i2t, t2i, chance=2.0), factor=10)
    assert ok is passed and line.startswith("PASS" if passed else "FAIL")
    assert f"image->text R@1 {i2t:.1f} (chance 2.0, needs 20.0)" in line and "too small" not in line


def test_a_set_too_small_for_the_factor_fails_and_says_so():
    ok, line = learns.verdict(evaluation(100.0, 100.0, chance=12.5, n=8), factor=10)  # needs 125%: unreachable
    assert not ok and line.startswith("FAIL") and line.endswith("the held-out set is too small for 10x chance")


def write_result(run_dir: Path, result) -> Path:
    run_dir.mkdir()
    (run_dir / "result.json").write_text(json.dumps(result))
    return run_dir


def test_exit_status_and_one_line_per_case(tmp_path, capsys):
    good = write_result(tmp_path / "good", {"eval": evaluation(44.0, 33.0, chance=1.6)})
    assert learns.main([str(good)]) == 0
    assert capsys.readouterr().out.startswith("make learns: PASS: held-out image->text R@1 44.0 (chance 1.6")
    bad = write_result(tmp_path / "bad", {"eval": evaluation(3.0, 2.0, chance=1.6)})
    assert learns.main([str(bad)]) == 1 and "FAIL" in capsys.readouterr().out
    assert learns.main([str(bad), "--factor", "1"]) == 0  # 3.0 and 2.0 are at least 1 x 1.6
    capsys.readouterr()
    for folder, says in [(tmp_path / "none", "not found (did the run finish?)"),
                         (write_result(tmp_path / "noeval", {"eval": None}), "holds no held-out evaluation"),
                         (write_result(tmp_path / "list", [1, 2]), "holds no held-out evaluation")]:
        assert learns.main([str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and len(err.strip().splitlines()) == 1, err
    assert learns.main([str(good), "--factor", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --factor must be > 0, not 0"


def test_a_run_that_cannot_learn_fails_on_what_vltrain_writes(tmp_path, capsys):
    """Learning rate 0 keeps the random weights: on 40 held-out pairs (chance 2.5%) R@1 stays far under the 25% that
    10 x chance needs. This reads the result.json a real `vltrain run` writes, so the two cannot drift apart."""
    shards = colour_pairs(tmp_path, 80, per_shard=10)
    r = run(shards, tmp_path / "run", "--preset", "clip", "--steps", "2", "--set", "optim.lr=0",
            "--set", "data.val_frac=0.5", "--set", "eval_every=1000")
    assert r.exit_code == 0, r.output
    n_val = json.loads((tmp_path / "run" / "result.json").read_text())["eval"]["n_val"]
    assert 20 <= n_val <= 60  # a key-hash split: about half
    capsys.readouterr()
    assert learns.main([str(tmp_path / "run")]) == 1
    out = capsys.readouterr().out
    assert out.startswith("make learns: FAIL") and "too small" not in out, out
