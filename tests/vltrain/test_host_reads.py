"""No host read of a device tensor inside a training step: from the batch's arrival on the device to the end of the
optimiser step (forward, every loss, backward, clipping, AdamW, the momentum update, the queue's enqueue, GRIT's
feature collection), for every preset. On a GPU each such read (`.item()`, `.tolist()`, `float(t)`, `bool(t)`,
`int(t)`, a tensor as an index) waits for the device's queue to drain; the losses are read at the flushes only
(log, checkpoint and evaluation steps, vltrain.train._flush)."""

import json
import os

import pytest
import torch

from tests.conftest import ontology_dataset
from vltrain import train as train_mod
from vltrain.config import PRESETS
from vltrain.config_load import load_config
from vltrain.data.feed import Feed
from vltrain.runlog import RunLog
from vltrain.train import train

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.workers=0", "data.max_len=16", "optim.warmup_steps=2", "data.val_frac=0.25", "log_every=4",
        "eval_every=100", "ckpt_every=100"]
PER_PRESET = {  # the tiny BERT has 2 layers: split 1 + 1; queues and GRIT's search space sized for 36 pairs
    "albef": ["model.fusion_layers=1", "model.queue_size=16"],
    "albef-base": ["model.fusion_layers=1"],
    "softmask": ["model.fusion_layers=1", "model.queue_size=16"],
    "fistful": ["model.queue_size=16"],
    "grit": ["model.fusion_layers=1", "sampler.search_space=8", "sampler.queue_size=16"],
    "tonics": ["sampler.refresh_every=3", "sampler.threshold=0"],
}
# every preset, and SigLIP's sigmoid ITC (on albef-base: ITM's hard negatives read its logits too)
CASES = {**{p: (p, PER_PRESET.get(p, [])) for p in sorted(PRESETS)},
         "sigmoid": ("albef-base", PER_PRESET["albef-base"] + ["loss.itc_kind=sigmoid"])}


@pytest.fixture(scope="module")
def onto(tmp_path_factory):
    return ontology_dataset(tmp_path_factory.mktemp("reads"))


def windows(monkeypatch, enter, leave) -> list[int]:
    """Each step's window, from its batch's arrival on the device (train's to_device returned) to its report
    (RunLog.step, after the optimiser step and GRIT's collection): `enter()` at the start, `leave()` (a count) at the
    end; returns the list the counts go to, one per step."""
    counts = []
    to_device = train_mod.to_device
    step = RunLog.step

    def arrived(*a, **k):
        out = to_device(*a, **k)
        enter()
        return out

    def reported(self, *a, **k):
        counts.append(leave())
        return step(self, *a, **k)

    monkeypatch.setattr(train_mod, "to_device", arrived)
    monkeypatch.setattr(RunLog, "step", reported)
    return counts


def run_preset(onto, tmp_path, case: str, steps: int, device: str, sets: list[str]) -> None:
    preset, more = CASES[case]
    cfg = load_config(preset, shards=[str(onto)], out=str(tmp_path / case), steps=steps, batch_size=4,
                      device=device, sets=TINY + more + sets)
    train(cfg, quiet=True)


@pytest.mark.slow  # a 6-step run per preset
@pytest.mark.parametrize("preset", list(CASES))
def test_no_step_reads_a_tensor_back_outside_the_flushes(onto, tmp_path, monkeypatch, preset):
    counter = {"on": False, "n": 0, "where": []}
    for name in READS:
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **k):
            if counter["on"]:
                counter["n"] += 1
                counter["where"].append((_name, "".join(__import__("traceback").format_stack(limit=6)[:-1])))
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)

    def enter():
        counter.update(on=True, n=0)

    def leave():
        counter["on"] = False
        return counter["n"]

    counts = windows(monkeypatch, enter, leave)
    io = Feed.io

    def feed_io(self):  # the loader's remote-read counters: host memory the data workers write, not the device's
        was = counter["on"]
        counter["on"] = False
        try:
            return io(self)
        finally:
            counter["on"] = was

    monkeypatch.setattr(Feed, "io", feed_io)
    run_preset(onto, tmp_path, preset, 6, "cpu", [])
    assert len(counts) == 6
    assert counts == [0] * 6, "\n".join(f"{name}:\n{stack}" for name, stack in counter["where"][:10])


def test_the_counter_sees_the_reads_it_is_for(monkeypatch):
    """The wrappers count what a step would do if it read: each kind of read once."""
    n = []
    for name in READS:
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, **k: n.append(1) or _real(self, *a, **k))
    t = torch.tensor(3)
    t.item(), t.tolist(), bool(t), float(t), int(t), [0, 1, 2, 3][t]
    assert len(n) == 6


@pytest.mark.slow  # a 2-step run
def test_a_non_finite_loss_found_at_a_flush_names_its_step_and_saves_nothing_after(onto, tmp_path, monkeypatch):
    """Step 2 goes non-finite; its loss is read at the flush of step 4 (log_every=4): the error names step 2, the
    checkpoint step 4 would save is never written, and no row of step 2 or later is (40 steps: the progress line
    without a terminal comes every 4 steps, so nothing is flushed before step 4)."""
    from vltrain import step as step_mod

    calls = []
    train_step = step_mod.train_step

    def poisoned(*a, **k):
        out = train_step(*a, **k)
        calls.append(1)
        if len(calls) == 2:
            out["total"] = out["total"] * float("nan")
        return out

    monkeypatch.setattr(step_mod, "train_step", poisoned)
    cfg = load_config("clip", shards=[str(onto)], out=str(tmp_path / "nan"), steps=40, batch_size=4, device="cpu",
                      sets=TINY[:-1] + ["ckpt_every=4"])
    with pytest.raises(train_mod.TrainError, match=r"non-finite loss at step 2 \(.*total=nan"):
        train(cfg, quiet=True)
    assert not (tmp_path / "nan" / "last.pt").exists()
    rows = [json.loads(x) for x in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "total" in r] == []


@pytest.mark.cuda
@pytest.mark.parametrize("preset", list(CASES))
def test_no_step_synchronises_with_the_gpu_outside_the_flushes(onto, tmp_path, monkeypatch, preset):
    """On CUDA under torch.cuda.set_sync_debug_mode("error") between each batch's arrival and its report: any
    synchronising call (a read, a boolean-mask index, a blocking copy) fails the step. MLM is on where the preset
    has it: its vocabulary head takes the masked positions at a size the host knows (vltrain.losses.mlm_rows'
    nonzero_static), not by a boolean index, whose nonzero reads its count back. float32, so no fp16 loss scaler
    (whose skip check reads the scale every step)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    windows(monkeypatch, lambda: torch.cuda.set_sync_debug_mode("error"),
            lambda: torch.cuda.set_sync_debug_mode("default"))
    try:
        run_preset(onto, tmp_path, preset, 6, "cuda", ["train.precision=fp32"])
    finally:
        torch.cuda.set_sync_debug_mode("default")
