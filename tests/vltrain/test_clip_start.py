"""Starting from a pretrained CLIP (`--init-from clip:PATH`, `model.text_model=clip:PATH`) and exporting what
transformers loads (`vltrain export --format hf`), on tiny random CLIPModel folders built offline
(tests.vltrain.tinyclip).

Tolerances: the same transformers modules run the same float32 kernels on the same inputs in vltrain and in
transformers, so the embeddings agree to float32 rounding of unit vectors: 8 ulps of 1 (8 * 2**-23 ~ 1e-6) where the
calls are the same; 1e-5 where the pixels come from two implementations of the same resize (torchvision's, called
by vltrain's transform and by transformers' CLIPImageProcessor with other argument paths)."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from PIL import Image
from typer.testing import CliRunner

from tests.conftest import colour_pairs
from tests.vltrain.test_init_from import ok, one_line_error
from tests.vltrain.tinyclip import PROJECTION, SIGLIP_TEXT_LEN, SIZE, tiny_clip, tiny_siglip
from vltrain import hfclip
from vltrain.checkpoint import load, model_from
from vltrain.cli import app
from vltrain.config import ModelConfig
from vltrain.init_from import init_weights
from vltrain.model import build_model, image_interpolation, image_stats, mask_token_id, tokenizer_for

ULPS = 8 * 2.0 ** -23
BASE = ["--batch-size", "8", "--device", "cpu", "--set", "data.workers=0", "--set", "log_every=1",
        "--set", "data.max_len=12"]
FUSION = ["--set", "model.fusion_layers=1", "--set", "model.queue_size=16"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return tiny_clip(tmp_path_factory.mktemp("clip") / "tiny-clip")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return colour_pairs(tmp_path_factory.mktemp("pairs"), 24)


def run(*args):
    return CliRunner().invoke(app, [*args])


def reference(clip_dir, images, ids, mask):
    """The source CLIPModel's own features, L2-normalised, and its temperature 1 / exp(logit_scale)."""
    from transformers import CLIPModel

    m = CLIPModel.from_pretrained(str(clip_dir)).eval()
    with torch.no_grad():
        img = m.get_image_features(pixel_values=images).pooler_output
        txt = m.get_text_features(input_ids=ids, attention_mask=mask).pooler_output
    return F.normalize(img, dim=-1), F.normalize(txt, dim=-1), 1 / math.exp(float(m.logit_scale.detach()))


def inputs(clip_dir):
    tok = tokenizer_for(f"clip:{clip_dir}")
    enc = tok(["a photo of a dog", "red", "a blue car next to a small tree"], padding="longest", return_tensors="pt")
    images = torch.randn(3, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    return images, enc["input_ids"], enc["attention_mask"]


def test_clip_towers_from_init_embed_as_the_source_model(clip_dir):
    spec = f"clip:{clip_dir}"
    model = build_model(ModelConfig(text_model=spec, image_model=spec, embed_dim=PROJECTION, fusion_layers=0))
    info = init_weights(model, hfclip.init_source(spec), spec)
    assert (info["new"], info["dropped"]) == (0, 0)
    model.eval()
    images, ids, mask = inputs(clip_dir)
    ref_img, ref_txt, ref_temp = reference(clip_dir, images, ids, mask)
    with torch.no_grad():
        assert torch.allclose(model.encode_image(images)[1], ref_img, rtol=0, atol=ULPS)
        assert torch.allclose(model.encode_text(ids, mask)[1], ref_txt, rtol=0, atol=ULPS)
    assert float(model.temp.detach()) == pytest.approx(ref_temp, rel=ULPS)  # exp(-3): the folder's, not vltrain's 0.07


def test_clip_preprocessing_and_tokenizer_come_from_the_folder(clip_dir):
    cfg = ModelConfig(text_model=f"clip:{clip_dir}", image_model=f"clip:{clip_dir}")
    mean, std, size = image_stats(cfg)
    assert (mean, std, size) == (hfclip.OPENAI_MEAN, hfclip.OPENAI_STD, SIZE)
    assert image_interpolation(cfg) == "bicubic"  # CLIPImageProcessor's resample 3
    tok = tokenizer_for(cfg.text_model)
    assert type(tok).__name__ == "CLIPTokenizer"
    shown = yaml.safe_load(ok(run("config", "--preset", "albef", "--set", f"model.text_model={cfg.text_model}",
                                  "--set", f"model.image_model={cfg.image_model}")).output)
    assert shown["model"]["towers"]["image"]["preprocess"] == {"size": SIZE, "mean": list(hfclip.OPENAI_MEAN),
                                                               "std": list(hfclip.OPENAI_STD),
                                                               "interpolation": "bicubic", "resize": "shorter"}
    assert (shown["data"]["image_size"], shown["model"]["embed_dim"], shown["model"]["fusion_from"]) == (
        SIZE, PROJECTION, "new")
    assert tok.mask_token_id is None and mask_token_id(tok) == tok.unk_token_id  # MLM's stand-in for [MASK]


def test_grad_checkpointing_recomputes_both_clip_towers_with_the_same_gradients(clip_dir):
    """HF's own per-layer checkpointing in both towers (CLIP's dropout is 0: the recompute is the same arithmetic)."""
    spec = f"clip:{clip_dir}"
    images, ids, mask = inputs(clip_dir)
    grads = []
    for on in (False, True):
        torch.manual_seed(0)
        model = build_model(ModelConfig(text_model=spec, image_model=spec, embed_dim=PROJECTION, fusion_layers=1,
                                        fusion_from="new")).train()
        model.set_grad_checkpointing(on)
        assert model.image_encoder.is_activation_checkpointing == on
        assert model.text_encoder.is_activation_checkpointing == on
        _, img = model.encode_image(images)
        hidden, txt = model.encode_text(ids, mask)
        fused = model.fuse(hidden, mask, model.encode_image(images)[0])
        ((img @ txt.t()).sum() + fused.square().mean()).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


def test_init_from_clip_run_starts_from_the_source_weights(clip_dir, pairs, tmp_path):
    """A run from --init-from clip:PATH with lr 0 keeps every tensor as loaded: step 0's model is the source."""
    out = tmp_path / "run"
    r = ok(run("run", str(pairs), "--out", str(out), "--steps", "2", "--preset", "clip", "--init-from",
               f"clip:{clip_dir}", "--set", "optim.lr=0", *BASE))
    assert f"init-from clip:{clip_dir}: loaded 78 tensors" in r.output
    assert "data.image_size 224 -> 32" in r.output and f"model.embed_dim 256 -> {PROJECTION}" in r.output
    result = json.loads((out / "result.json").read_text())
    assert (result["init_from"]["loaded"], result["init_from"]["new"]) == (78, 0)
    ckpt = load(out / "last.pt")
    assert ckpt["config"]["model"]["towers"]["image"]["preprocess"]["interpolation"] == "bicubic"
    model = model_from(ckpt, out / "last.pt").eval()
    images, ids, mask = inputs(clip_dir)
    ref_img, ref_txt, _ = reference(clip_dir, images, ids, mask)
    with torch.no_grad():
        assert torch.allclose(model.encode_image(images)[1], ref_img, rtol=0, atol=ULPS)
        assert torch.allclose(model.encode_text(ids, mask)[1], ref_txt, rtol=0, atol=ULPS)
    # a resume finds the towers in the checkpoint's record: no --init-from, no --set
    ok(run("run", str(pairs), "--out", str(out), "--steps", "3", "--preset", "clip", "--resume",
           "--set", "optim.lr=0", *BASE))
    assert load(out / "last.pt")["step"] == 3


# A subprocess with transformers alone: importing vltrain there fails, so nothing of vltrain can be in the path.
TRANSFORMERS_ALONE = r"""
import importlib.abc, json, sys
class NoVltrain(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vltrain" or name.startswith("vltrain."):
            raise ImportError("vltrain must not be imported here")
sys.meta_path.insert(0, NoVltrain())
import numpy as np, torch, transformers
from PIL import Image
out, kind, texts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
cls = getattr(transformers, kind)
model, info = cls.from_pretrained(out, output_loading_info=True)
processor = transformers.AutoProcessor.from_pretrained(out)
images = [Image.open(p).convert("RGB") for p in json.loads(sys.argv[4])]
padding = sys.argv[5] if len(sys.argv) > 5 else "longest"  # SigLIP's processor pads to max_length
x = processor(images=images, text=texts, return_tensors="pt", padding=padding)
with torch.no_grad():
    img = model.get_image_features(pixel_values=x.pixel_values).pooler_output
    mask = {} if padding == "max_length" else {"attention_mask": x.attention_mask}  # SigLIP reads no mask
    txt = model.get_text_features(input_ids=x.input_ids, **mask).pooler_output
img = torch.nn.functional.normalize(img, dim=-1)
txt = torch.nn.functional.normalize(txt, dim=-1)
print(json.dumps({"info": {k: sorted(map(str, v)) for k, v in info.items()}, "image": img.tolist(),
                  "text": txt.tolist(), "vltrain": any(m.startswith("vltrain") for m in sys.modules)}))
"""


def photos(tmp_path) -> list[str]:
    """Three RGB images of different sizes and aspect ratios (the resize and the crop both matter)."""
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate([(40, 52), (64, 33), (32, 32)]):
        p = tmp_path / f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(p)
        paths.append(str(p))
    return paths


def transformers_alone(out, kind: str, texts: list[str], images: list[str], padding: str = "longest") -> dict:
    r = subprocess.run([sys.executable, "-c", TRANSFORMERS_ALONE, str(out), kind, json.dumps(texts),
                        json.dumps(images), padding], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


TEXTS = ["a photo of a dog", "red", "a blue car next to a small tree"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["albef", "grit"])
def test_fusion_preset_from_clip_trains_and_exports_what_transformers_loads(clip_dir, pairs, tmp_path, preset):
    import vltrain

    out = tmp_path / "run"
    args = ["--steps", "3", "--preset", preset, "--init-from", f"clip:{clip_dir}", *BASE, *FUSION]
    r = ok(run("run", str(pairs), "--out", str(out), *args))
    assert "model.fusion_from split -> new" in r.output
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [x["total"] for x in rows if "total" in x]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    export = tmp_path / "hf"
    ok(run("export", str(out / "last.pt"), str(export), "--format", "hf"))
    got = transformers_alone(export, "CLIPModel", TEXTS, photos(tmp_path))
    assert got["info"]["missing_keys"] == [] and got["info"]["unexpected_keys"] == [] and not got["vltrain"]
    model = vltrain.load(export, device="cpu")
    images = photos(tmp_path)
    assert torch.allclose(model.encode_images(images), torch.tensor(got["image"]), rtol=0, atol=1e-5)
    assert torch.allclose(model.encode_texts(TEXTS), torch.tensor(got["text"]), rtol=0, atol=1e-5)
    # vltrain reads the whole model back: every tensor of the checkpoint's online model, bit for bit
    ckpt = load(out / "last.pt")
    back = load(export)
    online = {k: v for k, v in ckpt["model"].items() if not k.startswith(("momentum.", "image_queue", "text_queue",
                                                                          "queue_ptr"))}
    assert set(back["model"]) == set(online)
    assert all(torch.equal(back["model"][k], online[k]) for k in online)
    assert model.match(images[:2], TEXTS[:2]).shape == (2,)  # the ITM head came back from vltrain_heads


@pytest.mark.slow
def test_towers_of_two_clips_export_as_a_dual_encoder(tmp_path, pairs):
    a = tiny_clip(tmp_path / "a", seed=1)
    b = tiny_clip(tmp_path / "b", seed=2)
    out = tmp_path / "run"
    ok(run("run", str(pairs), "--out", str(out), "--steps", "2", "--preset", "clip", "--set",
           f"model.text_model=clip:{a}", "--set", f"model.image_model=clip:{b}", *BASE))
    export = tmp_path / "hf"
    ok(run("export", str(out / "last.pt"), str(export), "--format", "hf"))
    got = transformers_alone(export, "VisionTextDualEncoderModel", TEXTS, photos(tmp_path))
    assert got["info"]["missing_keys"] == [] and got["info"]["unexpected_keys"] == []
    import vltrain

    model = vltrain.load(export, device="cpu")
    assert torch.allclose(model.encode_texts(TEXTS), torch.tensor(got["text"]), rtol=0, atol=1e-5)
    assert torch.allclose(model.encode_images(photos(tmp_path)), torch.tensor(got["image"]), rtol=0, atol=1e-5)


def test_format_hf_refuses_towers_transformers_cannot_hold(tmp_path):
    from tests.conftest import tiny_checkpoint

    ckpt = tiny_checkpoint(tmp_path / "tiny.pt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    one_line_error(run("export", str(ckpt), str(out), "--format", "hf"), "--format hf", "tiny")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    one_line_error(run("export", str(ckpt), str(tmp_path / "o2"), "--format", "onnx"), "--format")


def test_clip_start_errors_are_one_line(clip_dir, pairs, tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    one_line_error(run("run", str(pairs), "--out", out, "--init-from", f"clip:{tmp_path}/none", *BASE),
                   "no config.json")
    one_line_error(run("run", str(pairs), "--out", out, "--init-from", f"clip:{clip_dir}", "--set",
                       "model.text_model=tiny", *BASE), "model.text_model", "leave")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    one_line_error(run("run", str(pairs), "--out", out, "--init-from", f"clip:{bert}", *BASE), "model_type 'bert'")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here either way: fail fast, naming the id
    one_line_error(run("run", str(pairs), "--out", out, "--init-from", "clip:hf-hub:openai/clip-vit-base-patch32",
                       *BASE), "openai/clip-vit-base-patch32", "Hugging Face Hub")
    assert not (tmp_path / "run").exists()  # nothing was written


SHORT = ["red dog", "a cat", "blue sky"]  # within data.max_len in the tiny SentencePiece vocabulary


@pytest.mark.slow
def test_siglip_start_embeds_as_the_source_and_exports_a_siglip_model(pairs, tmp_path):
    """A SigLIP folder: no projections (its heads give the embeddings), captions padded to its full length and read
    unmasked, the whole image resized to S x S; its logit_bias kept so the export is a whole SiglipModel."""
    from transformers import SiglipModel

    import vltrain

    folder = tiny_siglip(tmp_path / "siglip")
    out = tmp_path / "run"
    r = ok(run("run", str(pairs), "--out", str(out), "--steps", "2", "--preset", "albef", "--init-from",
               f"clip:{folder}", "--set", "optim.lr=0", *BASE, *FUSION))
    assert "model.embed_dim 256 -> 32" in r.output
    net = model_from(load(out / "last.pt"), out / "last.pt").eval()
    source = SiglipModel.from_pretrained(str(folder)).eval()
    tok = tokenizer_for(net.cfg.text_model)
    ids = tok(SHORT, padding="longest", return_tensors="pt")
    full = tok(SHORT, padding="max_length", max_length=SIGLIP_TEXT_LEN, return_tensors="pt")["input_ids"]
    images = torch.randn(3, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref_txt = F.normalize(source.get_text_features(input_ids=full).pooler_output, dim=-1)
        ref_img = F.normalize(source.get_image_features(pixel_values=images).pooler_output, dim=-1)
        assert torch.allclose(net.encode_text(ids["input_ids"], ids["attention_mask"])[1], ref_txt, rtol=0, atol=ULPS)
        assert torch.allclose(net.encode_image(images)[1], ref_img, rtol=0, atol=ULPS)
    assert float(net.temp.detach()) == pytest.approx(math.exp(-2.0), rel=ULPS)
    export = tmp_path / "hf"
    ok(run("export", str(out / "last.pt"), str(export), "--format", "hf"))
    got = transformers_alone(export, "SiglipModel", SHORT, photos(tmp_path), "max_length")
    assert got["info"]["missing_keys"] == [] and got["info"]["unexpected_keys"] == [] and not got["vltrain"]
    model = vltrain.load(export, device="cpu")
    assert torch.allclose(model.encode_texts(SHORT), torch.tensor(got["text"]), rtol=0, atol=1e-5)
    assert torch.allclose(model.encode_images(photos(tmp_path)), torch.tensor(got["image"]), rtol=0, atol=1e-5)
    back = load(export)["model"]
    assert float(back["logit_bias"]) == -3.0  # SigLIP's bias went out and came back
    one_line_error(run("export", str(out / "last.pt"), str(tmp_path / "oc"), "--format", "open_clip"), "SigLIP")


@pytest.mark.slow
def test_an_export_reads_without_the_clip_folder_it_came_from(pairs, tmp_path):
    """The towers' record rebuilds the model and the export's own tokenizer tokenizes: the source folder may be gone
    (an export downloaded elsewhere); vltrain.load and `vltrain eval` both work."""
    import shutil

    import vltrain

    folder = tiny_clip(tmp_path / "gone")
    out = tmp_path / "run"
    ok(run("run", str(pairs), "--out", str(out), "--steps", "2", "--preset", "clip", "--init-from", f"clip:{folder}",
           *BASE))
    for fmt in ("hf", "vltrain"):
        ok(run("export", str(out / "last.pt"), str(tmp_path / fmt), "--format", fmt))
    before = vltrain.load(tmp_path / "hf", device="cpu").encode_texts(TEXTS)
    shutil.rmtree(folder)
    for fmt in ("hf", "vltrain"):
        moved = shutil.move(str(tmp_path / fmt), str(tmp_path / f"elsewhere-{fmt}"))
        assert torch.equal(vltrain.load(moved, device="cpu").encode_texts(TEXTS), before)
        r = ok(run("eval", moved, str(pairs), "--device", "cpu"))
        assert "R@1" in r.output or "TR@1" in r.output
