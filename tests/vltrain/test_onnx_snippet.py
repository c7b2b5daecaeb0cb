"""The onnxruntime + numpy snippet of docs/API.md, run as written in a process that never imports torch or vltrain,
reproduces `vltrain.load(OUT)`'s pixels bit for bit and its embeddings, for a pixel model and for a model trained on
`vlprep features` tokens (whose image graph holds its frozen encoder)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vltrain
from tests.conftest import tiny_checkpoint
from vltrain.export import export

pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[2] / "docs" / "API.md"
BLOCKED = ("torch", "torchvision", "vltrain", "vlprep", "transformers")
# Runs before the snippet: any import of BLOCKED fails, and the snippet does not need one.
PRELUDE = f"""
import sys

BLOCKED = {BLOCKED!r}


class Blocker:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(name + " may not be imported here")
        return None


sys.meta_path.insert(0, Blocker)
"""
# Runs after it: its functions on more images and captions than it names, saved for the parent to compare.
EPILOGUE = """
extra = json.loads(open("extra.json").read())
px = np.stack([pixels(p) for p in extra["images"]])
enc = tok.encode_batch(extra["texts"])
feed = {"input_ids": np.array([e.ids for e in enc], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in enc], dtype=np.int64)}
np.savez("got.npz", img=img, txt=txt, px=px, extra_img=image.run(None, {"pixels": px})[0],
         extra_txt=text.run(None, feed)[0])
assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED], "a blocked module was imported"
"""
SNIPPET_IMAGES = ["photo.jpg", "logo.png"]
SNIPPET_TEXTS = ["a dog on the grass", "a red car"]
TEXTS = ["", "a cat", "a very long caption that goes on and on well past the twelve tokens the model reads",
         "Ünïcode café — naïve 東京"]


def snippet() -> str:
    """docs/API.md's code between the onnx-without-torch markers."""
    text = DOCS.read_text(encoding="utf-8")
    block = re.search(r"<!-- onnx-without-torch -->\s*```python\n(.*?)```\s*<!-- /onnx-without-torch -->", text, re.S)
    assert block, "docs/API.md lost its onnx-without-torch snippet"
    return block.group(1)


def native_uint8_resize() -> bool:
    """Whether torchvision resizes uint8 images with its fixed-point kernel on this CPU (the snippet's recipe)."""
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2.functional._geometry import _do_native_uint8_resize_on_cpu

    return _do_native_uint8_resize_on_cpu(InterpolationMode.BILINEAR)


def write_images(folder: Path) -> list[str]:
    """The snippet's two images and more: other aspect ratios, grey and palette modes, transparency, an image smaller
    than the crop (upscaled), one exactly the crop size, and small random ones of many sizes."""
    import skimage.data

    folder.mkdir(exist_ok=True)
    Image.fromarray(skimage.data.chelsea()).save(folder / "photo.jpg", quality=90)  # 451 x 300
    Image.fromarray(skimage.data.logo()).save(folder / "logo.png")  # RGBA 500 x 500, transparent background
    Image.fromarray(skimage.data.coffee().transpose(1, 0, 2)).save(folder / "portrait.png")  # 400 x 600
    Image.fromarray(skimage.data.camera()[:301, :509]).save(folder / "grey.png")  # L, odd sides
    Image.fromarray(skimage.data.logo()).convert("LA").save(folder / "grey-alpha.png")
    Image.fromarray(skimage.data.logo()[::7, ::5]).convert("P").save(folder / "palette.png")
    logo = Image.fromarray(skimage.data.logo()[::3, ::3])
    logo.convert("P").save(folder / "palette-transparent.png", transparency=0)
    Image.fromarray(skimage.data.rocket()[:17, :23]).save(folder / "small.png")  # smaller than any crop here
    Image.fromarray(skimage.data.astronaut()[:64, :64]).save(folder / "exact.png")
    names = ["photo.jpg", "logo.png", "portrait.png", "grey.png", "grey-alpha.png", "palette.png",
             "palette-transparent.png", "small.png", "exact.png"]
    rng = np.random.default_rng(0)
    for i in range(24):
        h, w = (int(v) for v in rng.integers(1, 200, 2))
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / f"r{i}.png")
        names.append(f"r{i}.png")
    return names


def run_snippet(export_dir: Path, folder: Path, images: list[str]) -> dict:
    """The snippet, verbatim, with OUT at `export_dir` (as models/albef) and the images in `folder` (its cwd)."""
    (folder / "models").mkdir(exist_ok=True)
    link = folder / "models" / "albef"
    if link.is_symlink():
        link.unlink()
    link.symlink_to(export_dir.resolve(), target_is_directory=True)
    (folder / "extra.json").write_text(json.dumps({"images": images, "texts": TEXTS}))
    code = PRELUDE + snippet() + EPILOGUE
    # -I: no user site, no PYTHONPATH, no current folder on sys.path (the blocker would stop vltrain anyway)
    r = subprocess.run([sys.executable, "-I", "-c", code], cwd=folder, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with np.load(folder / "got.npz") as got:
        return dict(got)


def test_the_prelude_stops_torch_and_vltrain():
    for module in ("torch", "vltrain.api", "transformers"):  # not vacuous: they are installed here
        r = subprocess.run([sys.executable, "-I", "-c", PRELUDE + f"import {module}"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode != 0 and f"{module.split('.')[0]} may not be imported here" in r.stderr, r.stderr[-500:]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """--onnx exports of a tiny pixel model (32 px) and of a features model over EfficientNet-Lite0 at 64 px, tokens
    stored as float16 (random heads: the snippet reproduces whatever the weights are)."""
    from vlprep.encoders import load_token_encoder
    from vltrain.config import Config, DataConfig, ModelConfig, to_dict
    from vltrain.model import build_model

    tmp = tmp_path_factory.mktemp("onnx-snippet")
    pix = tiny_checkpoint(tmp / "pix.pt")
    spec = {**load_token_encoder("efficientnet-lite0", size=64).spec, "dtype": "float16"}
    torch.manual_seed(1)
    mc = ModelConfig(text_model="tiny", image_model="features", feature_dim=spec["dim"], feature_encoder=spec,
                     embed_dim=16, fusion_layers=0)
    feat = tmp / "feat.pt"
    torch.save({"model": build_model(mc).state_dict(),
                "config": to_dict(Config(model=mc, data=DataConfig(image_size=32, max_len=12)))}, feat)
    found = {"tmp": tmp}
    for name, ckpt in (("pixels", pix), ("features", feat)):
        export(ckpt, tmp / name, onnx=True)
        found[name] = tmp / name
    return found


def test_the_snippet_reproduces_a_pixel_models_embeddings_without_torch(exports):
    if not native_uint8_resize():
        pytest.skip("torchvision resizes uint8 images in float32 on this CPU, not with the kernel the snippet does")
    folder = exports["tmp"] / "run-pixels"
    folder.mkdir()
    images = write_images(folder)
    got = run_snippet(exports["pixels"], folder, images)
    model = vltrain.load(exports["pixels"], device="cpu")
    paths = [folder / p for p in images]
    # decode, resize, crop, scale and normalise as vltrain does them, to the bit
    assert np.array_equal(got["px"], model.pixels(paths).numpy())
    # the graphs match torch to float32 rounding: write_onnx's check bound, ONNX_TOLERANCE
    assert np.abs(got["img"] - model.encode_images([folder / p for p in SNIPPET_IMAGES]).numpy()).max() < 1e-4
    assert np.abs(got["extra_img"] - model.encode_images(paths).numpy()).max() < 1e-4
    assert np.abs(got["txt"] - model.encode_texts(SNIPPET_TEXTS).numpy()).max() < 1e-4
    assert np.abs(got["extra_txt"] - model.encode_texts(TEXTS).numpy()).max() < 1e-4


def test_a_features_models_image_graph_reads_pixels_through_its_encoder(exports):
    if not native_uint8_resize():
        pytest.skip("torchvision resizes uint8 images in float32 on this CPU, not with the kernel the snippet does")
    out = exports["features"]
    meta = json.loads((out / "config.json").read_text())
    assert meta["preprocessing"]["image_input"] == "pixels" and meta["preprocessing"]["image_size"] == 64
    assert meta["onnx"]["image"]["input"] == {"name": "pixels", "dtype": "float32", "shape": ["batch", 3, 64, 64]}
    assert meta["onnx"]["image_tokens"]["input"] == {"name": "tokens", "dtype": "float32",
                                                     "shape": ["batch", "tokens", 1280]}
    assert max(meta["onnx"]["max_abs_diff"].values()) < 1e-4
    folder = exports["tmp"] / "run-features"
    folder.mkdir()
    images = write_images(folder)[:9]
    got = run_snippet(out, folder, images)
    model = vltrain.load(out, device="cpu")
    paths = [folder / p for p in images]
    px = model.pixels(paths)
    assert np.array_equal(got["px"], px.numpy())
    assert np.abs(got["extra_txt"] - model.encode_texts(TEXTS).numpy()).max() < 1e-4
    # The graph's encoder agrees with torch's to float32 rounding, and both round its tokens to float16; a token that
    # lands either side of a float16 step between them moves the embedding, through the linear head (the features
    # model's image encoder is the identity: e = normalise(W mean_n(t_n) + b)), by at most
    # 2 |W| mean_n(step_n) / |W mean_n(t_n) + b| plus float32 rounding, with step the float16 spacing at each token.
    net = model.net
    with torch.no_grad():
        tokens = net.pixel_tokens(px)  # (B, N, D) as stored, float16 values
        raw = net.image_proj(tokens.mean(dim=1))
        step = torch.from_numpy(np.spacing(tokens.abs().numpy().astype(np.float16)).astype(np.float32))
        shift = step.mean(dim=1) @ net.image_proj.weight.abs().t()  # (B, E): the largest |change| of each raw entry
    bound = 2 * shift.norm(dim=1) / raw.norm(dim=1) + 1e-4
    diff = torch.from_numpy(np.abs(got["extra_img"] - model.encode_images(paths).numpy())).max(dim=1).values
    assert (diff <= bound).all(), (diff, bound)
    # and the tokens graph beside it reads the cached tokens as the model does
    import onnxruntime

    session = onnxruntime.InferenceSession(str(out / "image_tokens_encoder.onnx"), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        want = net.encode_image(tokens)[1].numpy()
    assert np.abs(session.run(None, {"tokens": tokens.numpy()})[0] - want).max() < 1e-4
