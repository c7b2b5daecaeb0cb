"""vltrain.load and the Model it returns: the README snippet, inputs of every kind, zero-shot and ITM by hand."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import vltrain
from tests.conftest import tiny_checkpoint
from vlprep.dataset import decode_rgb
from vltrain.zeroshot import class_embeddings

README = Path(__file__).resolve().parents[2] / "README.md"


def fusion_checkpoint(path: Path) -> Path:
    """A random tiny model with a 1-layer fusion encoder (ITM head), in vltrain's checkpoint format."""
    from vltrain.config import Config, DataConfig, to_dict
    from vltrain.config import ModelConfig
    from vltrain.model import build_model

    torch.manual_seed(1)
    mc = ModelConfig(text_model="tiny", image_model="tiny", embed_dim=16, fusion_layers=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": build_model(mc).state_dict(), "step": 7,
                "config": to_dict(Config(model=mc, data=DataConfig(image_size=32, max_len=12)))}, path)
    return path


def picture(path: Path, colour, mode="RGB", size=(48, 40)) -> Path:
    rng = np.random.default_rng(sum(colour))
    arr = np.clip(np.array(colour) + rng.integers(-30, 30, (size[1], size[0], len(colour))), 0, 255).astype(np.uint8)
    Image.fromarray(arr, mode).save(path)
    return path


def test_the_readme_snippet_runs(tmp_path, monkeypatch):
    block = re.search(r"```python\n(import numpy as np\n.*?)```", README.read_text(encoding="utf-8"), re.S).group(1)
    monkeypatch.chdir(tmp_path)
    fusion_checkpoint(tmp_path / "runs" / "albef" / "last.pt")
    picture(tmp_path / "a.png", (200, 30, 30))
    picture(tmp_path / "b.jpg", (30, 30, 200))
    scope = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert tuple(scope["img"].shape) == (3, 16) and tuple(scope["txt"].shape) == (2, 16)
    assert torch.allclose(scope["probs"].sum(dim=1), torch.ones(3), atol=1e-6)
    assert scope["p_match"].shape == (2,) and ((scope["p_match"] > 0) & (scope["p_match"] < 1)).all()
    assert isinstance(scope["model"], vltrain.api.Model) and scope["model"].step == 7


def test_a_path_a_pil_image_and_an_array_of_the_same_picture_embed_alike(tmp_path):
    model = vltrain.load(tiny_checkpoint(tmp_path / "ckpt.pt"), device="cpu")
    path = picture(tmp_path / "x.png", (10, 120, 240))
    pil = Image.open(path)
    emb = model.encode_images([path, str(path), pil, np.asarray(pil)])
    assert torch.allclose(emb, emb[:1].expand(4, -1), atol=1e-6)
    # by hand: the eval transform, the image tower, L2 normalisation
    with torch.no_grad():
        want = F.normalize(model.net.encode_image(model.transform(pil.convert("RGB"))[None])[1], dim=-1)
    assert torch.allclose(emb[0], want[0], atol=1e-6)
    assert torch.allclose(emb.norm(dim=1), torch.ones(4), atol=1e-6)
    assert model.encode_images(path).shape == (1, 16)  # a single input is a batch of one


def test_transparency_is_composited_on_white_as_in_training(tmp_path):
    model = vltrain.load(tiny_checkpoint(tmp_path / "ckpt.pt"), device="cpu")
    path = picture(tmp_path / "t.png", (200, 10, 10, 90), mode="RGBA")
    trained_on = model.transform(decode_rgb(path.read_bytes()))  # what training and eval decode
    assert torch.equal(model.pixels([Image.open(path)])[0], trained_on)
    assert torch.equal(model.pixels([np.asarray(Image.open(path))])[0], trained_on)


def test_batching_does_not_change_the_embeddings(tmp_path):
    model = vltrain.load(tiny_checkpoint(tmp_path / "ckpt.pt"), device="cpu")
    paths = [picture(tmp_path / f"{i}.png", (20 * i, 200 - 15 * i, 90)) for i in range(7)]
    texts = [f"a picture number {i} of {'many ' * i}things" for i in range(7)]
    # float32 convolutions and matmuls over batches of another size: rounding only
    assert torch.allclose(model.encode_images(paths, batch_size=2), model.encode_images(paths), atol=1e-5)
    assert torch.allclose(model.encode_texts(texts, batch_size=3), model.encode_texts(texts), atol=1e-5)


def test_zero_shot_is_a_softmax_over_the_prompt_ensemble_at_the_model_temperature(tmp_path):
    model = vltrain.load(tiny_checkpoint(tmp_path / "ckpt.pt"), device="cpu")
    paths = [picture(tmp_path / f"{i}.png", (60 * i, 90, 200 - 60 * i)) for i in range(3)]
    names, templates = ["cat", "dog", "red car", "tree"], ["a photo of a {}.", "{}"]
    probs = model.zero_shot(paths, names, templates)
    classes = class_embeddings(model.net, names, templates, model.max_len, torch.device("cpu"))
    logits = model.encode_images(paths) @ classes.t() / float(model.net.temperature().detach())
    assert probs.shape == (3, 4) and torch.allclose(probs, logits.softmax(dim=1), atol=1e-6)
    assert torch.allclose(model.classifier(names), model.classifier(names, list(vltrain.api.DEFAULT_TEMPLATES)))


def test_match_is_the_itm_probability_of_each_pair(tmp_path):
    model = vltrain.load(fusion_checkpoint(tmp_path / "f.pt"), device="cpu")
    paths = [picture(tmp_path / f"{i}.png", (60 * i, 90, 40)) for i in range(3)]
    texts = ["a red thing", "a green thing", "something else entirely"]
    got = model.match(paths, texts, batch_size=2)
    with torch.no_grad():
        want = []
        for path, text in zip(paths, texts):  # one pair at a time, by hand
            tokens, _ = model.net.encode_image(model.pixels([path]))
            enc = model.tokenizer([text], return_tensors="pt")
            hidden, _ = model.net.encode_text(enc["input_ids"], enc["attention_mask"])
            fused = model.net.fuse(hidden, enc["attention_mask"], tokens)
            want.append(model.net.itm_logits(fused).softmax(dim=-1)[0, 1])
    assert torch.allclose(got, torch.stack(want), atol=1e-5)


@pytest.mark.parametrize("call, message", [
    (lambda m, p: m.match([p], ["a", "b"]), "1 images, 2 texts"),
    (lambda m, p: m.encode_images([3.5]), "must be a path, a PIL image or a uint8 array"),
    (lambda m, p: m.encode_images([np.zeros((4, 4, 3), np.float32)]), "must be uint8"),
])
def test_bad_inputs_are_one_line_errors(tmp_path, call, message):
    model = vltrain.load(fusion_checkpoint(tmp_path / "f.pt"), device="cpu")
    with pytest.raises(ValueError, match=re.escape(message)):
        call(model, picture(tmp_path / "x.png", (1, 2, 3)))


def test_match_needs_a_fusion_encoder_and_load_names_a_bad_file(tmp_path):
    model = vltrain.load(tiny_checkpoint(tmp_path / "ckpt.pt"), device="cpu")
    with pytest.raises(ValueError, match="no fusion encoder"):
        model.match([picture(tmp_path / "x.png", (1, 2, 3))], ["a"])
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a vltrain checkpoint"):
        vltrain.load(tmp_path / "junk.pt")


@pytest.mark.parametrize("call, message", [
    (lambda m, p: m.zero_shot([p], ["dog", "cat"], templates=["no brace"]), "template 'no brace' has no {}"),
    (lambda m, p: m.zero_shot([p], ["dog", "cat"], templates="a photo of a {}."), "expected a list of templates"),
    (lambda m, p: m.classifier(["dog"], templates=[]), "no templates"),
    (lambda m, p: m.classifier(["dog"], templates=[5]), "a template is a int"),
    (lambda m, p: m.classifier([], templates=["a {}"]), "classnames is empty"),
    (lambda m, p: m.encode_texts(["a"], batch_size=-1), "batch_size must be a positive integer, got -1"),
    (lambda m, p: m.encode_texts(["a"], batch_size=0), "batch_size must be a positive integer, got 0"),
    (lambda m, p: m.encode_images([p], batch_size=0), "batch_size must be a positive integer"),
    (lambda m, p: m.encode_images([p], batch_size=1.5), "batch_size must be a positive integer"),
    (lambda m, p: m.encode_images([np.zeros((0, 40, 3), np.uint8)]), "an image must have pixels, not size 40 x 0"),
    (lambda m, p: m.encode_images([Image.new("RGB", (0, 5))]), "an image must have pixels"),
    (lambda m, p: m.encode_texts(["\ud800"]), "text 0 is not valid Unicode"),
    (lambda m, p: m.encode_texts(5), "expected one item or a list of strings, not int"),
    (lambda m, p: m.encode_texts(["a", None]), "text 1 is a NoneType, not a string"),
    (lambda m, p: m.encode_texts({"a": 1}), "not dict"),
    (lambda m, p: m.encode_images(5), "expected one item or a list of images, not int"),
    (lambda m, p: m.encode_images([p.parent / "missing.png"]), "cannot read image"),
    (lambda m, p: m.encode_images([p.parent]), "is not a regular file"),
    (lambda m, p: m.encode_images([p.with_suffix(".txt")]), "not an image format Pillow decodes"),
    (lambda m, p: m.zero_shot([p], ["a", "b"], templates=(t for t in ["a {}"])), "not a generator"),
    (lambda m, p: m.zero_shot([p], ["\udc80", "b"]), "text 0 is not valid Unicode"),
])
def test_every_input_error_is_the_documented_one_line_value_error(tmp_path, call, message):
    model = vltrain.load(tiny_checkpoint(tmp_path / "ckpt.pt"), device="cpu")
    (tmp_path / "x.txt").write_text("not an image")
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        call(model, picture(tmp_path / "x.png", (1, 2, 3)))
    assert "\n" not in str(e.value)


def test_a_decompression_bomb_is_a_value_error(tmp_path):
    model = vltrain.load(tiny_checkpoint(tmp_path / "ckpt.pt"), device="cpu")
    Image.new("1", (20000, 20000)).save(tmp_path / "bomb.png")  # 400M pixels, a few KB on disk
    with pytest.raises(ValueError, match="decompression bomb"):
        model.encode_images([tmp_path / "bomb.png"])


def test_cuda_without_cuda_is_a_value_error_not_a_cli_flag(tmp_path, monkeypatch):
    from vlprep import VlprepError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=r"^device cuda(:1)?: CUDA is not available") as e:
            vltrain.load(tiny_checkpoint(tmp_path / "ckpt.pt"), device=device)
        assert not isinstance(e.value, VlprepError) and "--device" not in str(e.value)
    with pytest.raises(ValueError, match=r"^device must be auto, cpu or cuda\[:N\], got 'tpu'"):
        vltrain.load(tmp_path / "ckpt.pt", device="tpu")
    with pytest.raises(ValueError, match=r"^device must be auto, cpu or cuda\[:N\], got 'cuda:x'"):
        vltrain.load(tmp_path / "ckpt.pt", device="cuda:x")
    assert vltrain.load(tmp_path / "ckpt.pt", device=torch.device("cpu")).device.type == "cpu"


def test_load_refuses_what_is_not_a_path_or_not_a_regular_file(tmp_path):
    import os

    with pytest.raises(ValueError, match="path must be a checkpoint file or an export folder, not NoneType"):
        vltrain.load(None)
    os.mkfifo(tmp_path / "fifo.pt")
    with pytest.raises(ValueError, match="fifo.pt is not a regular file"):
        vltrain.load(tmp_path / "fifo.pt", device="cpu")
    with open(tmp_path / "big.png", "wb") as f:
        f.truncate(300 << 20)  # sparse
    model = vltrain.load(tiny_checkpoint(tmp_path / "ckpt.pt"), device="cpu")
    with pytest.raises(ValueError, match=r"big.png: 314,572,800 bytes, more than 268,435,456"):
        model.encode_images([tmp_path / "big.png"])
