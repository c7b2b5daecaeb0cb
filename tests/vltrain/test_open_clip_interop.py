"""open_clip both ways: `--init-from open_clip:...` (converted to a CLIPModel folder, then a clip: start) and
`vltrain export --format open_clip` (read back by open_clip alone, and whole by vltrain).

Tolerance: open_clip's towers (nn.MultiheadAttention with a fused in-projection) and transformers' (separate q, k, v
projections, scaled-dot-product attention) compute the same float32 network with sums in another order: a few float32
ulps per layer on unit vectors, 2 layers here; 16 ulps of 1 (2e-6) holds it with room. Where both sides run
open_clip's own modules on the same weights, the result is bit for bit."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from typer.testing import CliRunner

from tests.vltrain.test_clip_start import BASE, TEXTS, pairs  # noqa: F401  (the pairs fixture)
from tests.vltrain.test_init_from import ok
from tests.vltrain.tinyclip import SIZE, tiny_open_clip
from vltrain import openclip
from vltrain.checkpoint import load, model_from
from vltrain.cli import app
from vltrain.model import tokenizer_for

TOL = 16 * 2.0 ** -23


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return tiny_open_clip(tmp_path_factory.mktemp("oc") / "tiny-open-clip")


def open_clip_features(model, images, texts):
    """open_clip's own embeddings (its tokenizer: CLIP's BPE, zero-padded to 77), L2-normalised."""
    import open_clip

    with torch.no_grad():
        img = F.normalize(model.encode_image(images), dim=-1)
        txt = F.normalize(model.encode_text(open_clip.get_tokenizer("ViT-B-32")(texts)), dim=-1)
    return img, txt


def test_state_dict_names_convert_both_ways_without_loss(source):
    _, model = source
    state = model.state_dict()
    hf = openclip.to_hf(state)
    back = openclip.from_hf(hf)
    assert set(back) == set(state) - {"attn_mask"}
    assert all(torch.equal(back[k], state[k]) for k in back)
    # the fused in-projection split in three: q is the first third of the rows
    w = state["transformer.resblocks.0.attn.in_proj_weight"]
    assert torch.equal(hf["text_model.encoder.layers.0.self_attn.q_proj.weight"], w[:32])
    assert torch.equal(hf["text_model.encoder.layers.0.self_attn.v_proj.weight"], w[64:])
    assert torch.equal(hf["visual_projection.weight"], state["visual.proj"].t())


@pytest.mark.slow
def test_open_clip_start_and_export_embed_as_open_clip(source, pairs, tmp_path):  # noqa: F811
    import vltrain

    folder, model = source
    out = tmp_path / "run"
    spec = f"open_clip:local-dir:{folder}"
    r = ok(CliRunner().invoke(app, ["run", str(pairs), "--out", str(out), "--steps", "2", "--preset", "clip",
                                    "--init-from", spec, "--set", "optim.lr=0", *BASE]))
    assert f"init-from {spec}: loaded 78 tensors" in r.output
    assert (out / "open_clip-init" / "config.json").is_file()  # the converted CLIPModel folder
    net = model_from(load(out / "last.pt"), out / "last.pt").eval()
    images = torch.randn(3, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    ref_img, ref_txt = open_clip_features(model, images, TEXTS)
    tok = tokenizer_for(net.cfg.text_model)(TEXTS, padding="longest", return_tensors="pt")
    with torch.no_grad():
        assert torch.allclose(net.encode_image(images)[1], ref_img, rtol=0, atol=TOL)
        assert torch.allclose(net.encode_text(tok["input_ids"], tok["attention_mask"])[1], ref_txt, rtol=0, atol=TOL)
    assert float(net.temp.detach()) == pytest.approx(np.exp(-2.5), rel=1e-6)

    # a resume finds the converted folder through its record
    ok(CliRunner().invoke(app, ["run", str(pairs), "--out", str(out), "--steps", "3", "--preset", "clip",
                                "--resume", "--set", "optim.lr=0", *BASE]))

    export = tmp_path / "oc-export"
    ok(CliRunner().invoke(app, ["export", str(out / "last.pt"), str(export), "--format", "open_clip"]))
    paths = []
    rng = np.random.default_rng(1)
    for i in range(3):  # at the tower's size: open_clip resizes with PIL, vltrain with torchvision (a no-op here)
        p = tmp_path / f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(p)
        paths.append(str(p))
    got = open_clip_alone(export, paths)
    assert not got["vltrain"]
    loaded = vltrain.load(export, device="cpu")
    assert torch.allclose(loaded.encode_images(paths), torch.tensor(got["image"]), rtol=0, atol=TOL)
    assert torch.allclose(loaded.encode_texts(TEXTS), torch.tensor(got["text"]), rtol=0, atol=TOL)
    assert got["logit_scale"] == pytest.approx(2.5, rel=1e-6)
    ckpt = load(out / "last.pt")
    back = load(export)["model"]
    online = {k: v for k, v in ckpt["model"].items() if not k.startswith("momentum.")}
    online = {k: v for k, v in online.items() if not k.endswith("position_ids")}
    assert set(back) == set(online) and all(torch.equal(back[k], online[k]) for k in online)


OPEN_CLIP_ALONE = r"""
import importlib.abc, json, sys
class NoVltrain(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vltrain" or name.startswith("vltrain."):
            raise ImportError("vltrain must not be imported here")
sys.meta_path.insert(0, NoVltrain())
import open_clip, torch
from PIL import Image
out = sys.argv[1]
model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
tokenizer = open_clip.get_tokenizer(f"local-dir:{out}")
images = torch.stack([preprocess(Image.open(p).convert("RGB")) for p in json.loads(sys.argv[2])])
model.eval()
with torch.no_grad():
    img = torch.nn.functional.normalize(model.encode_image(images), dim=-1)
    txt = torch.nn.functional.normalize(model.encode_text(tokenizer(json.loads(sys.argv[3]))), dim=-1)
print(json.dumps({"image": img.tolist(), "text": txt.tolist(), "logit_scale": float(model.logit_scale),
                  "vltrain": any(m.startswith("vltrain") for m in sys.modules)}))
"""


def open_clip_alone(export, paths):
    r = subprocess.run([sys.executable, "-c", OPEN_CLIP_ALONE, str(export), json.dumps(paths), json.dumps(TEXTS)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_builtin_architecture_converts_to_the_same_network_shape():
    """OpenAI's ViT-B/32 as open_clip describes it, as a CLIPConfig: the shapes transformers' own hub copy has."""
    config = openclip.hf_config(openclip.builtin_config("ViT-B-32-quickgelu"))
    v = config.vision_config
    t = config.text_config
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.intermediate_size, v.patch_size,
            v.image_size) == (768, 12, 12, 3072, 32, 224)
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.intermediate_size,
            t.max_position_embeddings) == (512, 12, 8, 2048, 77)
    assert (v.hidden_act, t.hidden_act, config.projection_dim) == ("quick_gelu", "quick_gelu", 512)
    assert openclip.hf_config(openclip.builtin_config("ViT-B-32")).vision_config.hidden_act == "gelu"
    assert openclip.model_cfg_of(config)["quick_gelu"] is True
    assert openclip.builtin_config("no-such-arch") is None


def test_open_clip_errors_are_one_line(pairs, tmp_path):  # noqa: F811
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "open_clip_config.json").write_text(json.dumps({"model_cfg": {
        "embed_dim": 16, "vision_cfg": {"timm_model_name": "vit_tiny_patch16_224"}, "text_cfg": {"width": 32}},
        "preprocess_cfg": {}}))
    (bad / "open_clip_model.safetensors").write_bytes(b"")
    for spec, part in ((f"open_clip:local-dir:{tmp_path}/none", "no open_clip_config.json"),
                       (f"open_clip:local-dir:{bad}", "not readable weights"),
                       ("open_clip:ViT-B-32:/nowhere.bin", "not found")):
        r = CliRunner().invoke(app, ["run", str(pairs), "--out", str(tmp_path / "run"), "--init-from", spec, *BASE])
        assert r.exit_code == 2, r.output + repr(r.exception)
        line = r.output.strip()
        assert line.startswith("error:") and "\n" not in line and part in line, line
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="timm_model_name"):
        openclip.check_plain({"embed_dim": 16, "vision_cfg": {"timm_model_name": "x"}, "text_cfg": {}})
