"""train.compile=step: the whole step (forward, losses, backward) under torch.compile gives the eager step's numbers
within float32 rounding, compiles once per caption-length bucket and never breaks its graph; the pieces that make it
traceable (length buckets, inverse transform sampling of hard negatives, the config's modes) checked on their own."""

import copy
import functools
import math

import pytest
import torch

from vltrain.config import ConfigError
from vltrain.config_load import load_config
from vltrain.data.collate import bucket_length, pad_captions
from vltrain.losses import sample_hard_negatives_at
from vltrain.model import build_model, model_tokenizer
from vltrain.optim import build_optimizer, optimizer_step, set_lr
from vltrain.step import BUCKETS, CompiledStep, TrainStep

TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.max_len=16", "optim.lr=0.001", "model.dropout=0"]
PER_PRESET = {"clip": [], "albef-base": ["model.fusion_layers=1"], "grit": ["model.fusion_layers=1"],
              "albef": ["model.fusion_layers=1", "model.queue_size=16"]}


def tiny_config(preset: str, sets=()):
    return load_config(preset, shards=["unused"], out="unused", steps=3, batch_size=4, device="cpu",
                       sets=TINY + PER_PRESET.get(preset, []) + list(sets))


# --- the pieces ---------------------------------------------------------------------------------------------------


def test_bucket_length_is_the_smallest_bucket_that_holds_the_captions():
    for max_len in (16, 30, 77):
        # the buckets written out: k * ceil(max_len / 4) for k = 1..4, the last cut to max_len
        q = math.ceil(max_len / BUCKETS)
        buckets = [min(max_len, k * q) for k in range(1, BUCKETS + 1)]
        for longest in range(1, max_len + 1):
            assert bucket_length(longest, max_len, BUCKETS) == min(b for b in buckets if b >= longest)
        assert len({bucket_length(n, max_len, BUCKETS) for n in range(1, max_len + 1)}) <= BUCKETS


def test_pad_captions_masks_the_padding():
    batch = {"input_ids": torch.tensor([[101, 7, 102], [101, 102, 0]]), "attention_mask": torch.tensor([[1, 1, 1],
             [1, 1, 0]]), "noun_mask": torch.tensor([[False, True, False], [False, False, False]]), "keys": ["a", "b"]}
    out = pad_captions(batch, 5, 0)
    assert out["input_ids"].tolist() == [[101, 7, 102, 0, 0], [101, 102, 0, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert out["noun_mask"].tolist() == [[False, True, False, False, False], [False] * 5]
    assert out["keys"] == ["a", "b"] and batch["input_ids"].shape == (2, 3)  # the caller's batch as it was


def test_inverse_transform_sampling_matches_a_walk_over_the_running_sum():
    g = torch.Generator().manual_seed(0)
    w = torch.rand(6, 9, generator=g) * (torch.rand(6, 9, generator=g) > 0.3)
    w[:, 7] = 1.0  # a positive off-diagonal entry in every row
    u = torch.rand(6, generator=g)
    got = sample_hard_negatives_at(w, u).tolist()
    for i in range(6):
        row = [0.0 if j == i else float(w[i, j]) for j in range(9)]
        # the first column whose running sum exceeds u * sum (in float64 here: the draws sit far from the steps)
        target, run = float(u[i]) * sum(row), 0.0
        want = next(j for j, x in enumerate(row) if (run := run + x) > target)
        assert got[i] == want
    # u just below 1: the row's last column of positive weight, never the diagonal or a column weighted 0
    w = torch.tensor([[0.0, 0.3, 0.7, 0.0], [0.2, 1.0, 0.3, 0.0]])
    assert sample_hard_negatives_at(w, torch.full((2,), 1 - 2 ** -24)).tolist() == [2, 2]
    assert sample_hard_negatives_at(w, torch.zeros(2)).tolist() == [1, 0]


def test_compile_modes_in_the_config():
    assert tiny_config("clip").train.compile == "off"
    assert tiny_config("clip", ["train.compile=true"]).train.compile == "towers"  # a config from before the modes
    assert tiny_config("clip", ["train.compile=false"]).train.compile == "off"
    assert tiny_config("albef", ["train.compile=step"]).train.compile == "step"
    with pytest.raises(ConfigError, match="train.compile must be one of off, towers, step"):
        tiny_config("clip", ["train.compile=graph"])
    with pytest.raises(ConfigError, match="train.compile=step: SoftMask"):
        tiny_config("softmask", ["model.fusion_layers=1", "train.compile=step"])
    with pytest.raises(ConfigError, match="dedupe=caption"):
        tiny_config("clip", ["train.compile=step", "loss.dedupe=caption"])


# --- compiled against eager (grit and tonics: their steps; their samplers run outside it) ---------------------------------------------------------------------------------------


WORDS = ("cat", "dog", "bird")


def batches(tokenizer, words: list[int], seed: int = 0) -> list[dict]:
    """One batch of 4 per entry, captions of up to that many words, padded to the batch's longest (as Collate)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in words:
        captions = [" ".join(WORDS[k % 3] for k in range(max(1, n - j))) for j in range(4)]
        tok = tokenizer(captions, padding="longest", truncation=True, max_length=16, return_tensors="pt")
        # TOnICS' noun: the first word
        noun = tok["attention_mask"].bool() & (torch.arange(tok["input_ids"].shape[1]) == 1)
        out.append({"images": torch.randn(4, 3, 32, 32, generator=g), "input_ids": tok["input_ids"],
                    "attention_mask": tok["attention_mask"], "captions": captions, "keys": [str(j) for j in range(4)],
                    "noun_mask": noun})
    return out


def run_steps(cfg, model, step, data) -> list[dict]:
    """The trainer's steps over `data`: losses, backward, clip, AdamW, momentum update and enqueue; the losses."""
    optimizer, params = build_optimizer(model, cfg.optim, torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    tok = model_tokenizer(model)
    rows = []
    for i, batch in enumerate(data, start=1):
        set_lr(optimizer, cfg.optim.lr)
        losses = step(batch, cfg.loss, generator, tok, 0.4 * i / len(data))  # alpha as a warm-up ramps it
        queue = losses.pop("queue_feats")
        optimizer_step(model, optimizer, params, losses["total"], cfg.optim.grad_clip, queue)
        rows.append({k: v.detach().clone() for k, v in losses.items()})
    return rows


def compiled_and_eager(preset: str, words: list[int], backend: str) -> tuple:
    """(compiled losses, eager losses, graphs compiled, graph breaks, compiled model, eager model, cfg) of the steps
    over one batch per entry of `words`, the two models built alike."""
    from torch._dynamo.utils import counters

    cfg = tiny_config(preset, ["train.compile=step"])
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    model.set_unpad(0)  # as speed_options sets it for train.compile=step
    twin = copy.deepcopy(model)
    tok = model_tokenizer(model)
    data = batches(tok, words)
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = run_steps(cfg, model, CompiledStep(TrainStep(model), model, 16, tok.pad_token_id,
                                                      backend=backend), data)
        graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    eager = run_steps(cfg, twin, CompiledStep(TrainStep(twin), twin, 16, tok.pad_token_id, compile=False), data)
    return compiled, eager, graphs, breaks, model, twin, cfg


def check_same_numbers(compiled, eager, model, twin, cfg, preset: str) -> None:
    # The same arithmetic in another order (Inductor fuses the elementwise ops and reorders the reductions): each
    # float32 op rounds to 2^-24 relative, and a loss here is a chain of a few hundred ops through 2 layers, the
    # errors adding up: 1e-5 relative (~170 units in the last place) holds every loss, the later steps' too (their
    # parameters differ by the same rounding, scaled by AdamW's normalised step). Dropout is off (model.dropout=0):
    # a compiled graph draws its dropout masks in its own way.
    for c, e in zip(compiled, eager):
        assert c.keys() == e.keys()
        for k in c:
            torch.testing.assert_close(c[k], e[k], rtol=1e-5, atol=1e-6, msg=f"{preset} {k}")
    # AdamW moves a parameter by at most lr * max(1, (1 - beta1) / sqrt(1 - beta2)) a step (Kingma & Ba 2014, 2.1)
    # plus its decay lr * wd * |p|: two runs n steps from the same start differ by at most twice n such steps
    b1, b2 = cfg.optim.betas
    lr, wd, n = cfg.optim.lr, cfg.optim.weight_decay, len(compiled)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        bound = 2 * n * lr * (max(1.0, (1 - b1) / math.sqrt(1 - b2)) + wd * (p.detach().abs().max() + 1))
        assert (p.detach() - q.detach()).abs().max() <= bound, name
    assert model.state_dict().keys() == twin.state_dict().keys()  # the function compiled, not the modules


@pytest.mark.slow  # Dynamo traces the step (~8 s); albef's backward through AOTAutograd too (~35 s on 2 busy cores)
@pytest.mark.parametrize("preset, backend", [("clip", "eager"), ("albef-base", "eager"), ("grit", "eager"),
                                             ("tonics", "eager"), ("albef", "aot_eager")])
def test_step_is_one_graph_per_caption_bucket(preset, backend):
    # caption lengths 5, 11, 6, 12 tokens ([CLS] + words + [SEP]): buckets 8, 12, 8, 12 of max_len 16; MLM's count
    # of masked positions varies too (0 in the first batch), and compiles nothing again: the vocabulary head scores
    # mlm_cap rows, a size fixed by the bucket's shape
    words = [3, 9, 4, 10]
    compiled, eager, graphs, breaks, model, twin, cfg = compiled_and_eager(preset, words, backend)
    tok = model_tokenizer(model)
    lengths = [bucket_length(b["input_ids"].shape[1], 16, BUCKETS) for b in batches(tok, words)]
    assert lengths == [8, 12, 8, 12]
    assert breaks == {}  # a break would be counted here, and would add graphs
    assert graphs == 2
    check_same_numbers(compiled, eager, model, twin, cfg, preset)


@pytest.mark.slow  # Inductor generates and builds C++ for forward and backward: ~50 s on 2 busy cores
def test_inductor_compiled_step_gives_the_eager_numbers():
    compiled, eager, graphs, breaks, model, twin, cfg = compiled_and_eager("clip", [3, 4, 4], "inductor")
    assert breaks == {} and graphs == 1
    check_same_numbers(compiled, eager, model, twin, cfg, "clip")


@pytest.mark.slow  # a 2-step run, its step traced by Dynamo without code generation
def test_a_run_with_compile_step_trains_and_keeps_checkpoint_keys(tmp_path, monkeypatch):
    from tests.vltrain.test_train import colour_pairs, losses, run
    from vltrain import session

    monkeypatch.setattr(session, "CompiledStep", functools.partial(CompiledStep, backend="eager"))
    shards = colour_pairs(tmp_path / "data", 16)
    r = run(shards, tmp_path / "c", "--preset", "albef-base", "--steps", "2", "--set", "data.val_frac=0",
            "--set", "model.fusion_layers=1", "--set", "train.compile=step")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert all(math.isfinite(v) for v in losses(tmp_path / "c").values())
    ckpt = torch.load(tmp_path / "c" / "last.pt", weights_only=False)
    assert ckpt["model"] and not any("_orig_mod" in k for k in ckpt["model"])
    assert ckpt["config"]["train"]["compile"] == "step"
