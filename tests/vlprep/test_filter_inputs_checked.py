"""`vlprep filter` on inputs that looked right and were not: embeddings of the wrong modality, of two encoders or of
two dimensions, embeddings and datasets that repeat a key, a WebDataset without sidecars, a decompression bomb."""

import copy
import io
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import make_dataset
from tests.vlprep.test_filter_embed import T, clip, write_embeddings  # noqa: F401 (clip: a fixture)
from tests.vlprep.test_probe_faults import error_line
from vlprep import VlprepError
from vlprep.embed import EmbedConfig, embed
from vlprep.filter import FilterConfig, filter_dataset
from vlprep.shards import ShardsConfig, build_shards


def run(ds, out, encoder=None, warn=None, **kw) -> dict:
    return filter_dataset(FilterConfig(src=Path(ds), out=Path(out), workers=1, **kw), encoder,
                          **({"warn": warn} if warn is not None else {}))


@pytest.fixture(scope="module")
def made(clip):  # noqa: F811
    """`vlprep embed` outputs of clip's dataset (meta.json and all): image and text by its encoder, text by the same
    encoder with another checkpoint fingerprint (the file changed), and image by another encoder."""
    tmp = clip["tmp"]
    enc = clip["enc"]
    later = copy.copy(enc)
    later.fingerprint = "fake:2"
    other = copy.copy(enc)
    other.info = {"fake": "another model"}
    for name, modality, e in (("m-img", "image", enc), ("m-txt", "text", enc), ("m-txt-later", "text", later),
                              ("m-img-other", "image", other)):
        if not (tmp / name).exists():
            embed(EmbedConfig(src=clip["ds"], out=tmp / name, modality=modality), e)
    return {n: tmp / n for n in ("m-img", "m-txt", "m-txt-later", "m-img-other")}


def one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


# --- 7. embeddings: modality, encoder, dimension, unique keys ------------------------------------------------------


def test_text_vectors_as_embeddings_are_refused_naming_the_modality(clip, made, tmp_path):  # noqa: F811
    """Before: text vectors as --embeddings ran, and near-dup dropped what the captions' vectors said."""
    with pytest.raises(VlprepError) as e:
        run(clip["ds"], tmp_path / "o", near_dup=T, embeddings=made["m-txt"])
    assert "--embeddings" in one_line(e) and "holds text embeddings" in str(e.value)
    assert "--modality image" in str(e.value)
    assert not (tmp_path / "o").exists()


def test_image_vectors_as_text_embeddings_are_refused(clip, made, tmp_path):  # noqa: F811
    """Before: image vectors as --text-embeddings gave every sample a clip score of 1.0."""
    with pytest.raises(VlprepError) as e:
        run(clip["ds"], tmp_path / "o", clip_score_min=0.1, embeddings=made["m-img"], text_embeddings=made["m-img"])
    assert "--text-embeddings" in one_line(e) and "holds image embeddings" in str(e.value)
    assert not (tmp_path / "o").exists()


def test_image_and_text_vectors_of_two_encoders_are_refused(clip, made, tmp_path):  # noqa: F811
    with pytest.raises(VlprepError) as e:
        run(clip["ds"], tmp_path / "o", clip_score_min=0.1, embeddings=made["m-img"],
            text_embeddings=made["m-txt-later"])
    assert "as it was at two times" in one_line(e)
    with pytest.raises(VlprepError) as e:
        run(clip["ds"], tmp_path / "o", clip_score_min=0.1, embeddings=made["m-img-other"],
            text_embeddings=made["m-txt"])
    assert "both must come from one checkpoint" in one_line(e)
    assert not (tmp_path / "o").exists()
    rep = run(clip["ds"], tmp_path / "ok", clip_score_min=0.1, embeddings=made["m-img"], text_embeddings=made["m-txt"])
    assert rep["warnings"] == [] and rep["kept"] > 0


def test_embeddings_that_record_nothing_get_a_warning_not_a_refusal(clip, tmp_path):  # noqa: F811
    said = []
    rep = run(clip["ds"], tmp_path / "o", clip_score_min=0.1, embeddings=clip["img"], text_embeddings=clip["txt"],
              warn=said.append)
    assert rep["warnings"] == said and len(said) == 3, said
    assert "--embeddings" in said[0] and "records no modality" in said[0]
    assert "records no encoder" in said[2] and all("\n" not in line for line in said)


def test_image_and_text_vectors_of_two_dimensions_are_refused(clip, tmp_path):  # noqa: F811
    """Before: a numpy broadcasting traceback from the clip-score pass."""
    txt = write_embeddings(tmp_path / "t32", clip["keys"], np.ones((20, 32), np.float32))
    with pytest.raises(VlprepError) as e:
        run(clip["ds"], tmp_path / "o", clip_score_min=0.1, embeddings=clip["img"], text_embeddings=txt)
    assert "32-dimensional" in one_line(e) and "64-dimensional" in str(e.value)


def test_a_key_twice_in_keys_parquet_is_refused_naming_it(clip, tmp_path):  # noqa: F811
    """Before: the key's first row was used and the second ignored, silently."""
    x = np.load(clip["img"] / "embeddings.npy")
    keys = clip["keys"] + [clip["keys"][3]]
    emb = write_embeddings(tmp_path / "e", keys, np.concatenate([x, x[:1]]))
    with pytest.raises(VlprepError) as e:
        run(clip["ds"], tmp_path / "o", near_dup=T, embeddings=emb)
    assert f"key {clip['keys'][3]!r} is in keys.parquet twice (rows 3 and 20)" in one_line(e)


# --- 8. a key twice in SRC -------------------------------------------------------------------------------------------


def rename_key(ds: Path, old: str, new: str) -> None:
    """Give sample `old` of `ds` the key `new` in its tar and its sidecar (sizes.json stays right)."""
    for tar in sorted(ds.glob("*.tar")):
        with tarfile.open(tar) as t:
            members = [(m, t.extractfile(m).read()) for m in t.getmembers()]
        if not any(m.name.startswith(old + ".") for m, _ in members):
            continue
        with tarfile.open(tar, "w", format=tarfile.USTAR_FORMAT) as t:
            for m, body in members:
                if m.name.startswith(old + "."):
                    m.name = new + m.name[len(old):]
                t.addfile(m, io.BytesIO(body))
        side = tar.with_suffix(".parquet")
        table = pq.read_table(side)
        keys = [new if k == old else k for k in table.column("key").to_pylist()]
        pq.write_table(table.set_column(table.column_names.index("key"), "key", pa.array(keys, pa.string())), side)


@pytest.fixture
def small(tmp_path) -> Path:
    """8 samples in 2 shards of 4 (keys shard_000000000 ... 7)."""
    return make_dataset(tmp_path / "ds", [f"caption {i} of a thing" for i in range(8)], 4)


@pytest.mark.parametrize("old, where", [("shard_000000005", "in shards shard-000000.tar and shard-000001.tar"),
                                        ("shard_000000003", "twice in shard shard-000000.tar")])
def test_a_key_twice_in_src_is_refused_naming_it_and_its_shards(small, tmp_path, old, where):
    """Before: the two samples were two samples to every rule: `--keys` and `--dedup` kept both, near-dup gave the
    second the first's vector."""
    rename_key(small, old, "shard_000000001")
    (tmp_path / "keep.txt").write_text("shard_000000001\n")
    for rule in (dict(keys=tmp_path / "keep.txt"), dict(dedup=["image"])):
        with pytest.raises(VlprepError) as e:
            run(small, tmp_path / "o", **rule)
        assert f"key 'shard_000000001' is {where}" in one_line(e)
        assert not (tmp_path / "o").exists()


# --- 11. sizes.json without sidecars ----------------------------------------------------------------------------------


def test_a_webdataset_without_sidecars_is_one_line(small, tmp_path, monkeypatch, capsys):
    """Before: a FileNotFoundError traceback from the scan (bow and stats said it in one line)."""
    for side in small.glob("*.parquet"):
        side.unlink()
    with pytest.raises(VlprepError) as e:
        run(small, tmp_path / "o", dedup=["image"])
    assert "missing sidecar shard-000000.parquet" in one_line(e)
    line = error_line(monkeypatch, capsys, "filter", small, tmp_path / "c", "--dedup", "image")
    assert "missing sidecar shard-000000.parquet" in line


# --- Pillow's decompression-bomb warning -----------------------------------------------------------------------------


def test_a_huge_image_is_no_raw_pillow_warning(tmp_path, monkeypatch):
    """Before: Pillow's DecompressionBombWarning was printed with its source line by filter's scan. An image above
    the warning size is read as any other; one above the refusal size is a counted bad sample."""
    from PIL import Image

    from tests.conftest import image_bytes
    from vlprep.dataset import decode_rgb

    src = tmp_path / "src"
    src.mkdir()
    for i, (w, h) in enumerate([(20, 16), (40, 40), (48, 48), (20, 16)]):
        (src / f"{i}.png").write_bytes(image_bytes(w, h, seed=i))
        (src / f"{i}.txt").write_text(f"caption {i}")
    build_shards(ShardsConfig(src=src, out=tmp_path / "ds", samples_per_shard=4, workers=1))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 40 x 40 warns, 48 x 48 (above twice that) is refused
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        rep = run(tmp_path / "ds", tmp_path / "o", dedup=["image"], min_side=8)
        assert decode_rgb(image_bytes(40, 40)).size == (40, 40)
    assert rep["bad"] == {"undecodable": 1} and rep["kept"] == 3
