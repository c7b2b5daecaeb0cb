"""--init-from on `make demo`'s clip checkpoint: 20 steps from its weights retrieve the held-out bow-feat pairs better
than 20 steps from scratch (same data, seed and split). Skipped (with the reason) where `make demo` has not run."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vltrain.cli import app

DEMO = Path(__file__).resolve().parents[2] / "demo-out" / "openclipart"
CKPT, DATA = DEMO / "run" / "last.pt", DEMO / "bow-feat"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (CKPT.is_file() and (DATA / "meta.json").is_file()),
                                 reason="needs `make demo`'s outputs (demo-out/openclipart: run/last.pt, bow-feat/)")]


def held_out_r1(out: Path, *extra) -> dict:
    """R@1 both ways on the held-out split (key hash, data.val_frac) after 20 steps of the clip preset."""
    r = CliRunner().invoke(app, ["run", str(DATA), "--preset", "clip", "--steps", "20", "--batch-size", "32",
                                 "--set", "eval_every=20", "--device", "cpu", "--out", str(out), *extra])
    assert r.exit_code == 0, r.output + repr(r.exception)
    ev = json.loads((out / "result.json").read_text())["eval"]
    return {k: ev[k] for k in ("i2t_r1", "t2i_r1")}


def test_init_from_the_demo_checkpoint_beats_scratch_at_step_20(tmp_path):
    scratch = held_out_r1(tmp_path / "scratch")
    tuned = held_out_r1(tmp_path / "init", "--init-from", str(CKPT))
    # measured: scratch i2t 0.0 / t2i 1.6, init-from i2t 41.0 / t2i 34.4 (61 held-out pairs, chance 1.6)
    assert tuned["i2t_r1"] > scratch["i2t_r1"] and tuned["t2i_r1"] > scratch["t2i_r1"], (scratch, tuned)
