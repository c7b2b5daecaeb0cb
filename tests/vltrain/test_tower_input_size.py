"""An image tower that cannot read data.image_size images (a CNN that shrinks them to nothing, a ViT of a fixed input
size) is a one-line ConfigError when the run is built, naming the tower, the size given and the size it needs."""

import pytest
from typer.testing import CliRunner

from tests.conftest import make_dataset
from tests.vltrain.test_trainer_usability import error_line
from vltrain.cli import app
from vltrain.config import ConfigError, ModelConfig


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("towers")
    return make_dataset(tmp / "data", [f"a {c} picture number {i}" for i, c in enumerate("abcdefgh")], 8)


def run(data, out, image_model, size):
    sets = ["model.text_model=tiny", f"model.image_model={image_model}", "model.embed_dim=16",
            "model.fusion_layers=0", f"data.image_size={size}", "data.workers=0", "data.max_len=12",
            "data.val_frac=0"]
    return CliRunner().invoke(app, ["run", str(data), "--out", str(out), "--preset", "clip", "--steps", "1",
                                    "--batch-size", "4", "--device", "cpu", *[x for s in sets for x in ("--set", s)]])


@pytest.mark.parametrize("image_model, needs", [("torchvision:alexnet", "at least 64"),
                                                ("timm:vit_tiny_patch16_224", "224 x 224")])
def test_a_tower_too_small_for_the_image_size_is_one_line_at_build(data, tmp_path, image_model, needs):
    line = error_line(run(data, tmp_path / "run", image_model, 32))
    assert image_model in line and "data.image_size=32" in line and needs in line, line
    assert not (tmp_path / "run" / "last.pt").exists()


def test_the_check_passes_what_a_tower_reads_and_names_what_it_needs():
    from vltrain.model import check_input_size

    check_input_size(ModelConfig(image_model="torchvision:alexnet"), 64)
    check_input_size(ModelConfig(image_model="timm:resnet10t"), 32)
    check_input_size(ModelConfig(image_model="tiny"), 32)  # not a named backbone: nothing to check
    with pytest.raises(ConfigError, match=r"timm:vit_tiny_patch16_224 reads 224 x 224 images only"):
        check_input_size(ModelConfig(image_model="timm:vit_tiny_patch16_224"), 256)
