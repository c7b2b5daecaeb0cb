"""loss.itc_kind=sigmoid: SigLIP's pairwise sigmoid loss (Zhai et al. 2023, 3.1) against a float64 loop, the
trainer's step against transformers' SiglipModel(return_loss=True), its temperature and bias trained and exported,
the default for SigLIP towers and the one-line refusals.

Tolerances: float64 throughout (eps = 2^-53 ~ 1.1e-16). The loss adds B x G terms log(1 + e^-u), each computed to a
few eps of itself and of size < 40 here, so the loop and the vectorised form differ by < B G 40 * 10 eps ~ 1e-12;
REL = 1e-12 relative to a loss of O(1..10) leaves a wide margin and still catches one pair mislabelled (a change of
O(1) / B). Against transformers the towers run the same modules in float64; the only other rounding is the
temperature's exp(-logit_scale) and back (a few eps), so REL holds there too.
"""

import math

import pytest
import torch
from safetensors.torch import load_file

from tests.vltrain.test_fidelity import make_batch
from tests.vltrain.tinyclip import SIGLIP_TEXT_LEN, SIZE, tiny_clip, tiny_siglip
from vltrain import hfclip
from vltrain.config import SIGLIP_BIAS, SIGLIP_TEMP, ConfigError
from vltrain.config_load import load_config
from vltrain.export_hf import hf_model, write_heads
from vltrain.exportfmt import HEADS
from vltrain.init_from import init_weights
from vltrain.losses import sigmoid_itc_loss
from vltrain.model import build_model, tokenizer_for
from vltrain.resolve import DataFacts, resolve, resolve_towers
from vltrain.step import train_step

REL = 1e-12
TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.max_len=12"]
CAPTIONS = [f"a photo of thing {i} and colour {i % 3}" for i in range(6)]
FACTS = DataFacts(features=None, n_train=64, per_epoch=8)


def loop_loss(logits: list[list[float]], positive) -> float:
    """-(1/B) sum_ij log sigmoid(z_ij l_ij), z = +1 where positive(i, j) else -1, with math alone."""
    total = 0.0
    for i, row in enumerate(logits):
        for j, x in enumerate(row):
            z = 1.0 if positive(i, j) else -1.0
            total += math.log1p(math.exp(-z * x)) if -z * x < 30 else -z * x + math.log1p(math.exp(z * x))
    return total / len(logits)


def test_the_loss_is_siglips_sum_over_pairs_divided_by_the_rows(default_float64):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 7, generator=g) * 8 - 5  # B = 4 rows against G = 7 columns (another rank's 3 after them)
    got = sigmoid_itc_loss(logits)
    assert float(got) == pytest.approx(loop_loss(logits.tolist(), lambda i, j: i == j), rel=REL)
    same = torch.zeros(4, 7, dtype=torch.bool)
    same[0, 5] = same[2, 1] = True  # loss.dedupe=caption: duplicates are positives as well
    want = loop_loss(logits.tolist(), lambda i, j: i == j or bool(same[i, j]))
    assert float(sigmoid_itc_loss(logits, same)) == pytest.approx(want, rel=REL)
    # bf16 logits (autocast) are upcast before the log-sigmoid, never summed in bf16
    assert sigmoid_itc_loss(logits.bfloat16()).dtype == torch.float32
    with pytest.raises(ValueError, match="expected ITC logits of shape"):
        sigmoid_itc_loss(torch.zeros(5, 3))


@pytest.mark.slow  # the tiny towers built and run in float64: ~7 s on a busy 2-core machine
def test_the_step_trains_the_temperature_and_the_bias(default_float64):
    """The step's itc_loss is the loop over t x.y + b of the step's own features, and d(loss)/db and d(loss)/dtemp
    are the loop's: dL/db = -(1/B) sum z s(-z l), dL/dtemp = -(1/temp) sum over pairs of dL/dl_ij * l'_ij with
    l' = x.y / temp."""
    cfg = load_config("clip", sets=TINY + ["loss.itc_kind=sigmoid"])
    assert cfg.model.itc_bias
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    assert float(model.logit_bias.detach()) == SIGLIP_BIAS and model.logit_bias.requires_grad
    batch = make_batch(CAPTIONS)
    losses = train_step(model, batch, cfg.loss, torch.Generator().manual_seed(0))
    losses["total"].backward()
    with torch.no_grad():
        x = model.encode_image(batch["images"])[1]
        y = model.encode_text(batch["input_ids"], batch["attention_mask"])[1]
    temp, b = float(model.temp.detach()), float(model.logit_bias.detach())
    cos = (x @ y.T).tolist()
    logits = [[c / temp + b for c in row] for row in cos]
    n = len(logits)
    assert float(losses["itc_loss"]) == pytest.approx(loop_loss(logits, lambda i, j: i == j), rel=REL)
    sig = lambda u: 1 / (1 + math.exp(-u))  # noqa: E731
    dl = [[-(1.0 if i == j else -1.0) * sig(-(1.0 if i == j else -1.0) * logits[i][j]) / n for j in range(n)]
          for i in range(n)]
    assert float(model.logit_bias.grad) == pytest.approx(sum(map(sum, dl)), rel=1e-10)
    dtemp = sum(dl[i][j] * -cos[i][j] / temp ** 2 for i in range(n) for j in range(n))
    assert float(model.temp.grad) == pytest.approx(dtemp, rel=1e-10)


@pytest.fixture(scope="module")
def siglip(tmp_path_factory):
    return tiny_siglip(tmp_path_factory.mktemp("siglip") / "s")


def siglip_start(folder, preset: str = "clip", sets=()):
    """A run's resolved config and model as `--init-from clip:FOLDER` builds them (towers, temperature, bias)."""
    spec = f"clip:{folder}"
    cfg = load_config(preset, sets=[f"model.text_model={spec}", f"model.image_model={spec}", *sets])
    cfg, notes = resolve_towers(cfg)
    cfg, more = resolve(cfg, torch.device("cpu"), FACTS)
    model = build_model(cfg.model)
    init_weights(model, hfclip.init_source(spec), spec)
    return cfg, model, notes + more


@pytest.mark.slow  # the tiny SigLIP's SentencePiece tokenizer and towers: ~4 s
def test_a_siglip_start_trains_with_siglips_loss_from_step_0(siglip, default_float64):
    """Default sigmoid for SigLIP towers; the step-0 loss is transformers' SiglipModel(return_loss=True) on the same
    captions (padded to SigLIP's full length, as SigLIP pads them) and pixels; the export's logit_bias is the
    trained one."""
    from transformers import SiglipModel

    cfg, model, notes = siglip_start(siglip)
    assert cfg.loss.itc_kind == "sigmoid" and cfg.model.itc_bias
    assert any(n.startswith("note: loss.itc_kind sigmoid: SigLIP's own loss") for n in notes)
    model.eval()
    assert float(model.logit_bias.detach()) == -3.0 and model.logit_bias.requires_grad  # the folder's own bias, trained
    source = SiglipModel.from_pretrained(str(siglip), torch_dtype=torch.float64).eval()
    captions = ["red dog", "a cat on the grass", "blue sky", "a small house next to a tree"]
    tok = tokenizer_for(cfg.model.text_model)
    enc = tok(captions, padding="longest", truncation=True, max_length=cfg.data.max_len, return_tensors="pt")
    images = torch.randn(len(captions), 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    batch = {"images": images, "input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
             "captions": captions}
    losses = train_step(model, batch, cfg.loss, torch.Generator().manual_seed(0))
    full = tok(captions, padding="max_length", max_length=SIGLIP_TEXT_LEN, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = source(input_ids=full, pixel_values=images, return_loss=True).loss
    # vltrain holds the temperature as a float32 (hfclip.to_vltrain: exp(-logit_scale) rounded once, relative error
    # <= 2^-24): the loss moves by at most |dL/dlog t| 2^-24 <= sum_ij |dL/dl_ij| t |x.y| 2^-24 <= B t 2^-24
    t = math.exp(float(source.logit_scale))
    assert float(losses["itc_loss"]) == pytest.approx(float(want), rel=REL, abs=len(captions) * t * 2.0 ** -24)
    losses["total"].backward()
    assert float(model.logit_bias.grad) != 0 and float(model.temp.grad) != 0
    with torch.no_grad():  # one SGD step on the head: the export holds the bias and temperature as trained
        model.logit_bias -= 0.5 * model.logit_bias.grad
        model.temp -= 0.001 * model.temp.grad
    exported = hf_model(model, "SiglipModel")
    assert float(exported.logit_bias) == float(model.logit_bias.detach()) != -3.0
    assert float(exported.logit_scale) == pytest.approx(-math.log(float(model.temp.detach())), rel=1e-6)


@pytest.mark.slow  # the tiny SigLIP's towers: ~3 s
def test_a_siglip_start_keeps_softmax_where_asked_or_where_the_config_needs_it(siglip):
    cfg, model, _ = siglip_start(siglip, sets=["loss.itc_kind=softmax"])
    assert cfg.loss.itc_kind == "softmax" and not cfg.model.itc_bias
    # kept, untrained, so that it exports back
    assert not model.logit_bias.requires_grad and float(model.logit_bias.detach()) == -3.0
    cfg, _, notes = siglip_start(siglip, "albef", ["model.fusion_layers=1", "model.queue_size=16"])
    assert cfg.loss.itc_kind == "softmax"
    assert "note: loss.itc_kind softmax, not SigLIP's sigmoid loss: model.momentum=True needs the softmax ITC" in notes


def test_a_fresh_sigmoid_head_starts_at_siglips_temperature_unless_set():
    cfg = load_config("clip", sets=TINY + ["loss.itc_kind=sigmoid"])
    resolved, notes = resolve(cfg, torch.device("cpu"), FACTS)
    assert resolved.model.temp == SIGLIP_TEMP
    assert f"note: model.temp 0.07 -> {SIGLIP_TEMP}: SigLIP's initial t = 10 for a fresh sigmoid head (its bias " \
           "starts at -10)" in notes
    cfg = load_config("clip", sets=TINY + ["loss.itc_kind=sigmoid", "model.temp=0.07"])
    assert resolve(cfg, torch.device("cpu"), FACTS)[0].model.temp == 0.07  # the user's choice stands
    cfg = load_config("clip", sets=TINY)
    resolved, notes = resolve(cfg, torch.device("cpu"), FACTS)
    assert resolved.loss.itc_kind == "softmax" and resolved.model.temp == 0.07 and not resolved.model.itc_bias
    assert build_model(resolved.model).logit_bias is None  # no bias parameter outside the sigmoid ITC and SigLIP


@pytest.mark.parametrize(("preset", "sets", "key"), [
    ("albef", [], "model.momentum=True"),
    ("clip", ["model.queue_size=8"], "model.queue_size=8"),
    ("fistful", [], "model.momentum=True"),
    ("softmask", ["model.momentum=false", "model.queue_size=0"], "loss.focal_gamma=2.0"),
    ("grit", [], "loss.consistency=0.2"),
    ("clip", ["loss.itc_detach_keys=true"], "loss.itc_detach_keys=True"),
])
def test_sigmoid_refuses_what_siglip_does_not_have_in_one_line(preset, sets, key):
    with pytest.raises(ConfigError, match=rf"^loss.itc_kind=sigmoid \(SigLIP's loss\) does not combine with "
                                          rf"{key}: [^\n]*$"):
        load_config(preset, sets=[*sets, "loss.itc_kind=sigmoid"])
    with pytest.raises(ConfigError, match=r"^unknown loss.itc_kind 'logistic'; use one of softmax, sigmoid$"):
        load_config("clip", sets=["loss.itc_kind=logistic"])


@pytest.mark.slow  # the tiny CLIP's towers: ~3 s
def test_a_clip_start_trained_with_sigmoid_exports_a_clip_model(tmp_path, default_float64):
    """CLIPModel has no logit_bias: a CLIP trained with the sigmoid ITC still exports as one; its bias is vltrain's
    (the hf export's vltrain_heads keeps it)."""
    spec = f"clip:{tiny_clip(tmp_path / 'clip')}"
    cfg = load_config("clip", sets=[f"model.text_model={spec}", f"model.image_model={spec}",
                                    "loss.itc_kind=sigmoid"])
    cfg, _ = resolve_towers(cfg)
    cfg, _ = resolve(cfg, torch.device("cpu"), FACTS)
    model = build_model(cfg.model)
    record = init_weights(model, hfclip.init_source(spec), spec)
    assert float(model.logit_bias.detach()) == SIGLIP_BIAS and record["new"] >= 1  # a fresh bias over CLIP's towers
    with torch.no_grad():
        model.logit_bias.fill_(-7.25)  # as if trained
    exported = hf_model(model, "CLIPModel")
    assert float(exported.logit_scale) == pytest.approx(-math.log(float(model.temp.detach())), rel=1e-6)
    assert "logit_bias" in write_heads(model, tmp_path)["heads"]
    assert float(load_file(str(tmp_path / HEADS))["logit_bias"]) == -7.25
