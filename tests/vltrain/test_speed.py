"""The trainer's speed features keep what a run relies on: length bucketing sees every sample once per epoch and
pads less, loader workers kept across epochs replay a resumed run bit for bit, train.precision picks and records
its dtype, and length groups compute what the padded batch computes."""

import itertools
import json
import random
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from vltrain.cli import app
from vltrain.data.collate import TokenLengths
from vltrain.data.samples import caption_of
from vltrain.data.stream import ShardStream
from vltrain.config_load import load_config
from vltrain.model import build_model, length_groups, tokenizer_for

from tests.conftest import make_dataset
from tests.vltrain.test_train import TINY, losses

B, BUCKET = 4, 3


@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    """60 pairs whose captions run from 1 to 30 words, in shards of 10 (a near-tie of lengths on purpose: each
    length occurs twice, so the sort's tie rule is exercised)."""
    rng = random.Random(0)
    words = "red green blue cat dog bird tree car boat house sun moon star".split()
    captions = [" ".join(rng.choice(words) for _ in range(1 + i % 30)) + f" n{i}" for i in range(60)]
    return make_dataset(tmp_path_factory.mktemp("varied") / "ds", captions, per_shard=10)


def stream(ds, bucket: int, seed: int = 0, epoch: int = 0) -> list[str]:
    tok = tokenizer_for("tiny")
    s = ShardStream([ds], "train", 0.0, lambda im: torch.zeros(1), seed=seed, buffer=20, bucket=bucket, batch=B,
                    lengths=TokenLengths(tok, 32))
    s.set_epoch(epoch)
    return [caption for _, caption, _ in s]


def test_bucketing_sorts_each_window_into_batches_and_keeps_every_sample(varied):
    """Re-derived here: the unbucketed stream's order, cut into windows of BUCKET batches, each window sorted by
    token count (stable), cut into batches of B: the bucketed stream yields exactly those batches, in some order
    within each window, and a partial last batch last."""
    tok = tokenizer_for("tiny")
    for epoch in (0, 1):
        plain, bucketed = stream(varied, 0, epoch=epoch), stream(varied, BUCKET, epoch=epoch)
        assert sorted(plain) == sorted(bucketed) and len(plain) == 60  # each sample once per epoch
        size = BUCKET * B
        for start in range(0, len(plain), size):
            window = plain[start:start + size]
            lengths = [len(tok(c, truncation=True, max_length=32)["input_ids"]) for c in window]
            ranked = [c for _, c in sorted(zip(lengths, window), key=lambda t: t[0])]
            expect = [tuple(ranked[i:i + B]) for i in range(0, len(ranked) - len(ranked) % B, B)]
            got = bucketed[start:start + size]
            got_batches = [tuple(got[i:i + B]) for i in range(0, len(got) - len(got) % B, B)]
            assert sorted(got_batches) == sorted(expect)
            assert got[len(got) - len(got) % B:] == ranked[len(ranked) - len(ranked) % B:]


def test_bucketing_pads_less_and_depends_only_on_seed_and_epoch(varied):
    tok = tokenizer_for("tiny")

    def padding(captions):  # padded token slots / all slots, batch by batch as Collate pads them
        pad = total = 0
        for i in range(0, len(captions) - B + 1, B):
            n = [len(tok(c, truncation=True, max_length=32)["input_ids"]) for c in captions[i:i + B]]
            pad, total = pad + max(n) * B - sum(n), total + max(n) * B
        return pad / total

    assert padding(stream(varied, BUCKET)) < 0.75 * padding(stream(varied, 0))  # 0.15 against 0.29 here
    assert stream(varied, BUCKET, seed=0, epoch=1) == stream(varied, BUCKET, seed=0, epoch=1)
    assert stream(varied, BUCKET, seed=0, epoch=1) != stream(varied, BUCKET, seed=0, epoch=2)


def test_caption_of_is_the_caption_a_sample_trains_on():
    """Bucketing sorts by the caption load_sample will pick: the epoch's drawn one of a multi-caption sample."""
    from vltrain.data.samples import drawn_caption, sample_captions

    caps = ["one", "two words", "three more words"]
    raw = {"__key__": "k", "txt": b"one", "json": json.dumps({"captions": caps}).encode()}
    drawn = {caption_of(raw, (0, epoch)) for epoch in range(12)}
    assert drawn == {drawn_caption(sample_captions(raw), 0, e, "k") for e in range(12)} and len(drawn) > 1
    assert caption_of(raw, "first") == "one" and caption_of({"__key__": "k", "txt": b"\xff"}, "first") == ""


def run(ds, out, *args):
    sets = [x for s in TINY for x in ("--set", s)]
    return CliRunner().invoke(app, ["run", str(ds), "--out", str(out), "--batch-size", "4", "--device", "cpu", *sets,
                                    *args])


@pytest.mark.slow  # about 4 s each: two runs with loader workers
@pytest.mark.parametrize("workers", [1, 2])
def test_resume_is_exact_with_workers_kept_across_epochs_and_bucketing(varied, tmp_path, workers):
    """20 steps against 15 + 5 with --resume, over epochs of about 13 batches from loader workers kept across
    epochs, bucketed: the same losses bit for bit (each worker reseeds per epoch, so a fresh worker replays a kept
    one)."""
    common = ["--preset", "clip", "--set", "optim.warmup_steps=0", "--set", "optim.min_lr_ratio=1.0",
              "--set", "data.val_frac=0.1", "--set", f"data.workers={workers}", "--set", "data.bucket=2",
              "--set", "data.image_size=32"]
    r = run(varied, tmp_path / "full", *common, "--steps", "20")
    assert r.exit_code == 0, r.output + repr(r.exception)
    r = run(varied, tmp_path / "part", *common, "--steps", "15")
    assert r.exit_code == 0, r.output + repr(r.exception)
    # the part run stopped in its second epoch: the resumed run's fresh workers start there, where the full run's
    # workers had lived through the first
    assert torch.load(tmp_path / "part" / "last.pt", weights_only=True)["epoch"] == 1
    r = run(varied, tmp_path / "part", *common, "--steps", "20", "--resume")
    assert r.exit_code == 0, r.output + repr(r.exception)
    full, part = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert sorted(part) == list(range(1, 21)) and full == part


def tiny_albef(n: int = 4) -> tuple:
    """(config, model in train mode, tokenizer, a batch of n random 32 px images and captions) for the tiny albef."""
    cfg = load_config(preset="albef", sets=[*TINY, "model.fusion_layers=1", "model.queue_size=8"])
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    tok = tokenizer_for("tiny")
    enc = tok([f"a red thing number {i}" for i in range(n)], padding="longest", return_tensors="pt")
    batch = {"images": torch.randn(n, 3, 32, 32), "input_ids": enc["input_ids"],
             "attention_mask": enc["attention_mask"], "captions": [f"c{i}" for i in range(n)]}
    return cfg, model, tok, batch


def test_under_bf16_autocast_the_losses_parameters_and_adamw_state_stay_float32():
    """train.precision=bf16: matmuls in bf16, while what accumulates (losses, parameters, optimiser moments) is
    float32. CPU autocast runs anywhere (emulated where the CPU lacks bf16), so this holds on any x86-64 CPU."""
    from vltrain.model import autocast
    from vltrain.optim import build_optimizer, optimizer_step
    from vltrain.step import train_step

    cfg, model, tok, batch = tiny_albef()
    opt, params = build_optimizer(model, cfg.optim, torch.device("cpu"))
    with autocast(torch.device("cpu"), "bf16"):
        losses = train_step(model, batch, cfg.loss, torch.Generator().manual_seed(0), tok, 0.4)
        assert model.image_proj(torch.randn(2, model.image_proj.in_features)).dtype == torch.bfloat16  # it is on
    feats = losses.pop("queue_feats")
    # MLM's count of masked positions past its cap rides with the losses (read at the flush): an integer, 0 here
    overflow = losses.pop("mlm_overflow")
    assert overflow.dtype == torch.int64 and int(overflow) == 0
    assert all(v.dtype == torch.float32 for v in losses.values()), {k: v.dtype for k, v in losses.items()}
    optimizer_step(model, opt, params, losses["total"], 1.0, feats)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(t.dtype == torch.float32 for s in opt.state.values() for k, t in s.items() if k != "step")
    assert model.image_queue.dtype == torch.float32


def test_precision_is_chosen_said_recorded_and_kept_on_resume(varied, tmp_path, monkeypatch):
    from vltrain import session

    common = ["--preset", "clip", "--set", "data.val_frac=0", "--set", "data.image_size=32"]
    # auto on the tiny (32-wide) text tower: fp32 without any timing, even where the CPU has bf16 arithmetic (on
    # one without, auto says so before the width is looked at)
    monkeypatch.setattr(session, "bf16_supported", lambda device: True)
    r = run(varied, tmp_path / "auto", *common, "--steps", "1")
    assert r.exit_code == 0 and "float32, auto: a 32-wide text tower is too small to gain from bf16" in r.output
    assert torch.load(tmp_path / "auto" / "last.pt", weights_only=True)["precision"] == "fp32"
    # bf16 where the CPU has no bf16 arithmetic: one line, nothing trained
    monkeypatch.setattr(session, "bf16_supported", lambda device: False)
    r = run(varied, tmp_path / "nobf16", *common, "--steps", "1", "--set", "train.precision=bf16")
    assert r.exit_code == 2 and "train.precision=bf16: this CPU has no bf16 arithmetic" in r.output
    monkeypatch.setattr(session, "bf16_supported", lambda device: True)
    r = run(varied, tmp_path / "bf16", *common, "--steps", "2", "--set", "train.precision=bf16")
    assert r.exit_code == 0 and "bf16 autocast, train.precision=bf16" in r.output, r.output
    assert torch.load(tmp_path / "bf16" / "last.pt", weights_only=True)["precision"] == "bf16"
    r = run(varied, tmp_path / "bf16", *common, "--steps", "3", "--set", "train.precision=bf16", "--resume")
    assert r.exit_code == 0 and "bf16 autocast, as the resumed run" in r.output, r.output
    fp32 = losses(tmp_path / "auto")[1]
    bf16 = losses(tmp_path / "bf16")[1]
    # the same first batch and weights: bf16 keeps 8 mantissa bits (unit roundoff 2^-8 = 0.4%), so the step-1 loss
    # moves, but by far less than the loss itself (a few roundings through two layers: a few percent at most)
    assert bf16 != fp32 and bf16 == pytest.approx(fp32, rel=0.05)


def test_a_checkpoint_from_before_bucketing_and_precision_names_the_keys_to_resume_it(varied, tmp_path):
    """A checkpoint without data.bucket / train.precision / train.unpad trained unbucketed in fp32 on padded
    batches: --resume says so in one line, and resumes once the user asks for that."""
    common = ["--preset", "clip", "--set", "data.val_frac=0", "--set", "data.image_size=32"]
    r = run(varied, tmp_path / "old", *common, "--steps", "2", "--set", "data.bucket=0")
    assert r.exit_code == 0, r.output
    path = tmp_path / "old" / "last.pt"
    ckpt = torch.load(path, weights_only=True)
    del ckpt["config"]["data"]["bucket"], ckpt["config"]["train"]["precision"], ckpt["precision"]
    del ckpt["config"]["train"]["unpad"]
    torch.save(ckpt, path)
    r = run(varied, tmp_path / "old", *common, "--steps", "3", "--resume")
    assert r.exit_code == 2 and "data.bucket: 0 (absent from this older checkpoint) -> 8" in r.output, r.output
    assert "train.unpad: False (absent from this older checkpoint) -> True" in r.output, r.output
    r = run(varied, tmp_path / "old", *common, "--steps", "3", "--resume", "--set", "data.bucket=0",
            "--set", "train.precision=fp32", "--set", "train.unpad=false")
    assert r.exit_code == 0 and "float32, as the resumed run" in r.output, r.output


FAULTS = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from vltrain.session import keep_freed_memory
    assert keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
# A 64 MB tensor made, zeroed and freed, as the word-embedding gradient is every step. Warm-up: glibc's bins settle
# after a few such blocks (the first two may land at different addresses, with the process's small allocations,
# whose pattern varies with Python's hash seed, between them), and the steady state is what a run lives in.
for _ in range(6):
    torch.zeros(16 * 2 ** 20).sum()
# The fewest faults of three rounds of three tensors: a round in which something outside the process (a memory
# reclaimer such as the kernel's DAMON) took pages back shows more, and the claim is about the allocator.
rounds = []
for _ in range(3):
    before = faults()
    for _ in range(3):
        torch.zeros(16 * 2 ** 20).sum()
    rounds.append(faults() - before)
print(min(rounds))
"""


@pytest.mark.slow  # two fresh processes that import torch (the page faults are counted in a fresh process)
@pytest.mark.skipif(not Path("/proc/self").exists(), reason="glibc's allocator on Linux")
def test_freed_memory_is_reused_without_page_faults():
    """keep_freed_memory: a large tensor made again after one was freed reuses the process's pages. glibc's default
    maps each block over 32 MB afresh, and zeroing 64 MB of new pages costs 16,384 minor page faults (4 KiB pages)
    per tensor; reused pages cost none, so three tensors stay far under one tensor's worth (the fewest of three rounds:
    a round in which the kernel reclaimed the kept pages faults them in again, which is not the allocator's doing).
    The two processes run side by side: each counts only its own faults (RUSAGE_SELF)."""
    import subprocess
    import sys

    procs = {mode: subprocess.Popen([sys.executable, "-c", FAULTS, mode], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for mode in ("default", "keep")}
    faults = {}
    for mode, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        faults[mode] = int(out.split()[-1])
    assert faults["default"] > 3 * 16_384 * 0.9  # every tensor faulted in anew (the case being fixed)
    assert faults["keep"] < 16_384 * 0.1


def partitions(lengths: list[int], groups: int, row_cost: int) -> list[tuple[int, int]]:
    """(cost, positions) of every way to cut the sorted distinct lengths into at most `groups` contiguous runs, by
    brute force: a run computes its rows times its longest length, and costs that plus row_cost."""
    values = sorted(set(lengths))
    out = []
    for g in range(1, groups + 1):
        for cuts in itertools.combinations(range(1, len(values)), g - 1):
            bounds = [0, *cuts, len(values)]
            runs = [values[a:b] for a, b in zip(bounds, bounds[1:])]
            positions = sum(sum(n in run for n in lengths) * run[-1] for run in runs)
            out.append((positions + g * row_cost, positions))
    return out


@pytest.mark.parametrize("lengths, L", [([3, 3, 4, 9, 9, 9, 20, 21, 2, 30, 5, 5] * 3, 32),
                                        ([7, 1, 7, 1, 7, 16, 16, 2, 3, 11], 16),
                                        ([2] * 30 + [3] * 30 + [16], 16),
                                        ([6] * 9 + [7], 7)])
def test_length_groups_cover_each_row_once_at_the_least_cost(lengths, L):
    """The groups hold every row once, each row no longer than its group's length; their cost (positions computed
    plus 64 per group) is the least over every cut of the sorted lengths into at most 4 runs, found by brute force;
    and there are none exactly when the cheapest cuts would still compute over 90% of the padded batch's B * L
    positions (the second and last cases)."""
    mask = (torch.arange(L) < torch.tensor(lengths)[:, None]).long()
    mask[0, 0] = 0  # a row need not attend its first position: its length is its last attended position + 1
    groups = length_groups(mask, 4, row_cost=64, min_saving=0.1)
    found = partitions(lengths, 4, 64)
    best = min(cost for cost, _ in found)
    cheapest = [positions for cost, positions in found if cost == best]
    if groups is None:
        assert all(p > 0.9 * len(lengths) * L for p in cheapest)
        return
    rows = torch.cat([r for r, _ in groups]).tolist()
    assert sorted(rows) == list(range(len(lengths)))
    assert all(lengths[i] <= n for r, n in groups for i in r.tolist())
    positions = sum(len(r) * n for r, n in groups)
    assert positions + 64 * len(groups) == best and positions <= 0.9 * len(lengths) * L


def test_length_groups_compute_what_the_padded_batch_computes(tmp_path):
    """The tiny model in float64, without dropout: the text encoder and the fusion layers on length groups give the
    padded batch's hidden states at every attended position, its ITC embeddings and its fused states, and the same
    gradients. Float64 rounding of a few dozen operations per value: 1e-12 relative is far above it and far below
    any real difference."""
    cfg = load_config(preset="albef", sets=["model.text_model=tiny", "model.image_model=features",
                                            "model.feature_dim=8", "model.embed_dim=16", "model.fusion_layers=1"],
                      shards=["x"], out=str(tmp_path))
    torch.manual_seed(0)
    model = build_model(cfg.model).double().eval()
    lengths = torch.tensor([2, 9, 3, 16, 4, 4, 11, 2, 7, 15] + [2, 3] * 10)  # short ones: worth 2-4 groups
    mask = (torch.arange(16) < lengths[:, None]).long()
    ids = torch.randint(1000, 2000, mask.shape) * mask
    image = torch.randn(len(lengths), 5, 8, dtype=torch.float64)
    keep = mask.bool()

    def run(groups):
        model.zero_grad()
        model.set_unpad(groups)
        hidden, emb = model.encode_text(ids, mask)
        fused = model.fuse(hidden, mask, model.encode_image(image)[0])
        (emb.sum() + (fused * keep.unsqueeze(-1)).pow(2).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return hidden[keep], emb, fused[keep], grads

    padded, grouped = run(0), run(4)
    assert length_groups(mask, 4) is not None
    for a, b in zip(padded[:3], grouped[:3]):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    assert padded[3].keys() == grouped[3].keys()
    for name, grad in padded[3].items():
        torch.testing.assert_close(grouped[3][name], grad, rtol=1e-12, atol=1e-12, msg=name)
