"""A CLIP folder or an open_clip weights file that cannot be what it claims is refused in one line before OUT is
touched: a folder without a usable tokenizer, a config.json with out-of-range or mistyped values, and open_clip
weights that are no state dict (text, parquet, pickle, a truncated zip, a dict of non-tensors)."""

import json
import pickle
import shutil

import pytest
import torch
from typer.testing import CliRunner

import vltrain
from tests.conftest import colour_pairs
from tests.vltrain.test_clip_start import BASE
from tests.vltrain.test_init_from import ok, one_line_error
from tests.vltrain.tinyclip import PROJECTION, tiny_clip
from vlprep import cut
from vltrain.cli import app

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return tiny_clip(tmp_path_factory.mktemp("clip") / "tiny-clip")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return colour_pairs(tmp_path_factory.mktemp("pairs"), 12)


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def without_tokenizer(src, dst):
    shutil.copytree(src, dst)
    for name in TOKENIZER_FILES:
        (dst / name).unlink(missing_ok=True)
    return dst


def test_a_clip_folder_without_a_tokenizer_is_refused_before_the_run(clip_dir, pairs, tmp_path):
    """transformers builds an empty 2-token CLIPTokenizer for such a folder: every caption would be the same ids."""
    bare = without_tokenizer(clip_dir, tmp_path / "bare")
    out = tmp_path / "run"
    one_line_error(run("run", pairs, "--out", out, "--init-from", f"clip:{bare}", "--steps", 1, *BASE),
                   str(bare), "tokenizer")
    assert not out.exists()
    one_line_error(run("run", pairs, "--out", out, "--steps", 1, "--set", f"model.text_model=clip:{bare}",
                       "--set", f"model.image_model=clip:{bare}", *BASE), "tokenizer")
    assert not out.exists()


def test_an_hf_export_without_its_tokenizer_is_refused_on_load(clip_dir, tmp_path):
    from vltrain.config import Config, DataConfig, ModelConfig, to_dict
    from vltrain.export import export
    from vltrain.model import _tokenizer_at, build_model
    from vltrain.resolve import resolve_towers

    spec = f"clip:{clip_dir}"
    cfg, _ = resolve_towers(Config(model=ModelConfig(text_model=spec, image_model=spec, embed_dim=PROJECTION,
                                                     fusion_layers=0), data=DataConfig(max_len=12)))
    torch.save({"model": build_model(cfg.model).state_dict(), "config": to_dict(cfg)}, tmp_path / "c.pt")
    out = tmp_path / "hf"
    export(tmp_path / "c.pt", out, fmt="hf")
    assert vltrain.load(out, device="cpu").encode_texts(["a dog"]).shape == (1, PROJECTION)
    for name in TOKENIZER_FILES:
        (out / name).unlink(missing_ok=True)
    _tokenizer_at.cache_clear()  # as a new process finds the folder
    with pytest.raises(ValueError, match="tokenizer") as e:
        vltrain.load(out, device="cpu")
    assert "\n" not in str(e.value)


def with_config(src, dst, change):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    change(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def text(key, value):
    return lambda raw: raw["text_config"].__setitem__(key, value)


@pytest.mark.parametrize("change, part", [
    (text("hidden_size", -7), "text_config.hidden_size"),
    (lambda raw: raw.__setitem__("projection_dim", "x"), "projection_dim"),
    (lambda raw: raw.__setitem__("text_config", [1, 2]), "text_config"),
    (lambda raw: raw["vision_config"].__setitem__("image_size", 0), "vision_config.image_size"),
    (lambda raw: raw["vision_config"].__setitem__("patch_size", "8"), "vision_config.patch_size"),
    (text("num_attention_heads", 3), "text_config"),  # 32 wide: not a multiple of the heads
])
def test_a_clip_config_with_bad_values_is_one_line(clip_dir, pairs, tmp_path, change, part):
    bad = with_config(clip_dir, tmp_path / "bad", change)
    out = tmp_path / "run"
    # the path as errors show one: cut to 80 characters (vlprep.cut), so a long temporary folder (an xdist
    # worker's, a long user name's) still matches
    one_line_error(run("run", pairs, "--out", out, "--init-from", f"clip:{bad}", "--steps", 1, *BASE),
                   cut(str(bad / "config.json")), part)
    assert not out.exists()
    r = run("config", "--set", f"model.text_model=clip:{bad}")  # the other reader of a clip: folder's config
    assert r.exit_code == 2 and "Traceback" not in r.output and part in r.output, r.output


def open_clip_files(tmp_path) -> dict:
    """Files that are no open_clip state dict, none of which runs code when read."""
    import pandas as pd

    files = {"text.bin": b"hello world\n" * 10}
    pd.DataFrame({"a": [1, 2]}).to_parquet(tmp_path / "table.parquet")
    files["table.pt"] = (tmp_path / "table.parquet").read_bytes()
    files["objects.pkl"] = pickle.dumps({"w": [1, 2, 3], "cls": object})
    files["plain.pkl"] = pickle.dumps([1, 2, 3], protocol=4)
    torch.save({"visual.proj": torch.zeros(2, 2)}, tmp_path / "whole.pt")
    whole = (tmp_path / "whole.pt").read_bytes()
    files["truncated.pt"] = whole[:len(whole) // 2]
    torch.save({"visual.proj": 1, "name": "x"}, tmp_path / "values.pt")
    files["values.pt"] = (tmp_path / "values.pt").read_bytes()
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    files["list.pt"] = (tmp_path / "list.pt").read_bytes()
    files["text.safetensors"] = b"not safetensors at all"
    return files


def test_open_clip_weights_that_are_no_state_dict_are_one_line(pairs, tmp_path):
    pytest.importorskip("open_clip")
    for name, data in open_clip_files(tmp_path).items():
        path = tmp_path / name
        path.write_bytes(data)
        out = tmp_path / "run"
        line = one_line_error(run("run", pairs, "--out", out, "--init-from", f"open_clip:ViT-B-32:{path}",
                                  "--steps", 1, *BASE), cut(str(path)), "not an open_clip checkpoint")
        assert "Traceback" not in line
        assert not out.exists()


def test_a_working_clip_folder_still_starts_a_run(clip_dir, pairs, tmp_path):
    out = tmp_path / "run"
    ok(run("run", pairs, "--out", out, "--init-from", f"clip:{clip_dir}", "--steps", 1, "--preset", "clip", *BASE))
    assert (out / "last.pt").is_file()
