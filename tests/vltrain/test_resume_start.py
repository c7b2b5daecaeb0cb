"""`vltrain run --resume` on an OUT that holds no checkpoint yet starts the run (open_clip's `--resume latest`), so
that one command line serves the first start and every restart (torchrun --max-restarts, a SLURM requeue).

What such an OUT may hold: nothing (a first start), the files of a start killed before its first checkpoint
(metrics.jsonl, tb/: deleted, as --overwrite deletes them, the user's other files kept), best.pt without last.pt
(refused: starting over would replace a checkpoint), or an export (refused: nothing to resume)."""

import json

import pytest

import torch

from tests.vltrain.test_init_from import ok, one_line_error
from tests.vltrain.test_train import losses, run, shards  # noqa: F401  (the tiny shards fixture and the CLI helper)

CLIP = ["--preset", "clip", "--steps", "2"]
NOTE = "--resume: no checkpoint in {} yet, starting the run"


def test_resume_on_an_empty_out_starts_the_run(shards, tmp_path):  # noqa: F811
    """The first start with --resume says so in one line and trains (the next test compares its losses with a run
    without --resume); the same command again resumes."""
    out = tmp_path / "run"
    r = ok(run(shards, out, *CLIP, "--resume"))
    assert NOTE.format(out) in r.output.splitlines()
    assert "resumed from" not in r.output and sorted(losses(out)) == [1, 2]
    assert torch.load(out / "last.pt", weights_only=True)["step"] == 2
    r = ok(run(shards, out, "--preset", "clip", "--steps", "3", "--resume"))
    assert "resumed from step 2 of 3" in r.output and "no checkpoint" not in r.output
    assert sorted(losses(out)) == [1, 2, 3]


def test_resume_starts_over_where_a_start_left_no_checkpoint(shards, tmp_path):  # noqa: F811
    """A start killed before its first checkpoint left metrics.jsonl and tb/: --resume deletes those (and names them)
    and starts over, training what a run without --resume trains (the same losses bit for bit: the same seed in the
    same process), so its metrics.jsonl holds the new run's rows only; the user's files in OUT stay."""
    out = tmp_path / "run"
    ok(run(shards, out, *CLIP))
    (out / "last.pt").unlink()  # as a start killed before its first checkpoint leaves OUT
    (out / "best.pt").unlink()
    plain = losses(out)
    with (out / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 7, "total": 9.0}) + "\n")  # a row of the lost start that the new one never logs
    (out / "notes.txt").write_text("mine")
    r = ok(run(shards, out, *CLIP, "--resume"))
    line = next(ln for ln in r.output.splitlines() if ln.startswith(NOTE.format(out)))
    assert "deleted an earlier start's" in line and "metrics.jsonl" in line and "tb" in line, line
    assert losses(out) == plain and sorted(plain) == [1, 2]
    assert torch.load(out / "last.pt", weights_only=True)["step"] == 2
    assert (out / "notes.txt").read_text() == "mine"


def test_resume_refuses_best_pt_without_last_pt_and_an_export(shards, tmp_path):  # noqa: F811
    """Starting over would replace best.pt (a checkpoint is never deleted), and an export has no optimiser state:
    both are one line, and OUT is left as it was."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "best.pt").write_bytes(b"a checkpoint")
    one_line_error(run(shards, out, *CLIP, "--resume"), "holds best.pt but no last.pt")
    assert sorted(p.name for p in out.iterdir()) == [".vlprep.lock", "best.pt"]
    assert (out / "best.pt").read_bytes() == b"a checkpoint"


@pytest.mark.slow
def test_a_row_cut_short_by_a_kill_is_redone_and_a_damaged_row_is_one_line(shards, tmp_path):  # noqa: F811
    """A process killed while it wrote a metrics row leaves a last line without its newline: --resume drops it with
    the rows after the checkpoint and writes every step's row once. A row that does not read anywhere else (an edited
    file) is refused in one line naming it, and metrics.jsonl is left as it was (rewriting it would lose rows)."""
    out = tmp_path / "run"
    ok(run(shards, out, *CLIP))
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "total": 1.2')  # the torn tail
    ok(run(shards, out, "--preset", "clip", "--steps", "3", "--resume"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if "total" in r) == [1, 2, 3]
    damaged = (out / "metrics.jsonl").read_text().replace('"step": 2', '"step": 2 garbled', 1)
    (out / "metrics.jsonl").write_text(damaged)
    one_line_error(run(shards, out, "--preset", "clip", "--steps", "4", "--resume"), "line 2 is not a metrics row")
    assert (out / "metrics.jsonl").read_text() == damaged
