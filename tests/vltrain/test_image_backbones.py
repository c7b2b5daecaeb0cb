"""Image towers by name, trained end to end: torchvision:ARCH and timm:NAME, CNNs and ViTs (a tiny random config
per family, built here), each trained 2 steps, exported, loaded, with the same embeddings; weights and warnings."""

import warnings

import pytest
import torch
from typer.testing import CliRunner

import vltrain
from tests.conftest import make_dataset
from vltrain.cli import app
from vltrain.config import ModelConfig
from vltrain.model import build_model


def tiny_vit(arch, weights=None):
    """torchvision's VisionTransformer at 32 px, patch 8, 1 layer of width 16: vit_b_16's code, a test's size."""
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(image_size=32, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """16 pairs in 2 shards, built once for the module: training, export and load only read them (each run writes
    under its own tmp_path)."""
    return make_dataset(tmp_path_factory.mktemp("backbones") / "data",
                        [f"a {c} picture number {i}" for i, c in enumerate("abcdefgh" * 2)], 8)


@pytest.mark.parametrize("image_model, size", [("torchvision:resnet18", 32), ("torchvision:vit_b_16", 32),
                                               ("timm:resnet10t", 64),
                                               pytest.param("timm:vit_tiny_patch16_224", 224, marks=pytest.mark.slow)])
def test_a_backbone_trains_exports_and_loads_with_the_same_embeddings(tmp_path, data, monkeypatch, image_model, size):
    import torchvision

    if image_model == "torchvision:vit_b_16":
        monkeypatch.setattr(torchvision.models, "get_model", tiny_vit)
    sets = ["model.text_model=tiny", f"model.image_model={image_model}", "model.embed_dim=16",
            "model.fusion_layers=1", f"data.image_size={size}", "data.workers=0", "data.max_len=12", "data.val_frac=0",
            "optim.warmup_steps=1", "model.queue_size=8"]
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["run", str(data), "--out", str(out), "--preset", "albef", "--steps", "2",
                                 "--batch-size", "4", "--device", "cpu", *[x for s in sets for x in ("--set", s)]])
    assert r.exit_code == 0, r.output + repr(r.exception)
    ckpt = torch.load(out / "last.pt", weights_only=True)
    before = build_model(ModelConfig(**ckpt["config"]["model"]), pretrained=False).state_dict()
    trained = [k for k, v in ckpt["model"].items() if k.startswith("image_encoder.") and v.is_floating_point()
               and not torch.equal(v, before[k])]
    assert trained  # the image tower trained end to end
    r = CliRunner().invoke(app, ["export", str(out / "last.pt"), str(tmp_path / "export")])
    assert r.exit_code == 0, r.output + repr(r.exception)
    a, b = vltrain.load(out / "last.pt", "cpu"), vltrain.load(tmp_path / "export", "cpu")
    images = [(torch.rand(size + 5, size + 9, 3) * 255).byte().numpy() for _ in range(3)]
    assert torch.equal(a.encode_images(images), b.encode_images(images))
    assert a.encode_images(images).shape == (3, 16)


def test_a_vit_pools_its_class_token_and_a_cnn_its_mean(monkeypatch):
    import torchvision

    monkeypatch.setattr(torchvision.models, "get_model", tiny_vit)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vit = build_model(ModelConfig(text_model="tiny", image_model="torchvision:vit_b_16", embed_dim=8,
                                      fusion_layers=0)).eval()
    x = torch.rand(2, 3, 32, 32)
    tokens, emb = vit.encode_image(x)
    assert tokens.shape == (2, 1 + 16, 16)  # class token + 4 x 4 patches, width 16
    assert torch.allclose(emb, torch.nn.functional.normalize(vit.image_proj(tokens[:, 0]), dim=-1))
    with pytest.raises(ValueError, match="reads 32 x 32 images"):
        vit.encode_image(torch.rand(1, 3, 64, 64))


def test_weights_load_from_a_local_state_dict_and_none_is_a_warning(tmp_path):
    import torchvision

    source = torchvision.models.get_model("resnet18", weights=None)
    torch.save(source.state_dict(), tmp_path / "r18.pt")
    cfg = dict(text_model="tiny", image_model="torchvision:resnet18", embed_dim=8, fusion_layers=0)
    net = build_model(ModelConfig(**cfg, image_weights=str(tmp_path / "r18.pt")))
    assert torch.equal(net.image_encoder.net[0].weight, source.conv1.weight)  # the trunk: children but avgpool, fc
    with pytest.warns(UserWarning, match="starts from random weights"):
        build_model(ModelConfig(**cfg))
    torch.save({"conv1.weight": torch.zeros(1)}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="cannot load .* into torchvision:resnet18"):
        build_model(ModelConfig(**cfg, image_weights=str(tmp_path / "bad.pt")))
    with pytest.raises(ValueError, match="unknown torchvision classification model"):
        build_model(ModelConfig(**{**cfg, "image_model": "torchvision:resnet19"}))
