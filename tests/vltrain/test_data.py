import io

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from tests.conftest import image_bytes
from vlprep.shards import ShardsConfig, build_shards
from vlprep.dataset import decode_rgb
from vlprep.encoders import eval_transform
from vltrain.data.collate import Collate, to_device
from vltrain.data.samples import train_transform
from vltrain.data.shards import count_split, in_val, shard_paths
from vltrain.data.stream import ShardStream

MEAN, STD = [0.5, 0.5, 0.5], [0.25, 0.25, 0.25]


def make(tmp_path, name, n, per_shard=4):
    src = tmp_path / f"{name}-src"
    src.mkdir()
    for i in range(n):
        (src / f"{i:03d}.png").write_bytes(image_bytes(40, 30, seed=i))
        (src / f"{i:03d}.txt").write_text(f"{name} caption {i}")
    build_shards(ShardsConfig(src=src, out=tmp_path / name, samples_per_shard=per_shard, workers=1, prefix=name))
    return tmp_path / name


class FakeTokenizer:
    def __call__(self, texts, padding, truncation, max_length, return_tensors):
        ids = [[101] + [len(w) for w in t.split()][: max_length - 2] + [102] for t in texts]
        width = max(map(len, ids))
        return {"input_ids": torch.tensor([x + [0] * (width - len(x)) for x in ids]),
                "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])}


def test_split_is_by_key_hash_and_disjoint(tmp_path):
    ds = make(tmp_path, "a", 40)
    tf = eval_transform(16, MEAN, STD)
    train = {k for _, _, k in ShardStream([ds], "train", 0.25, tf, shuffle=False)}
    val = {k for _, _, k in ShardStream([ds], "val", 0.25, tf, shuffle=False)}
    assert not train & val and len(train | val) == 40 and 0 < len(val) < 40
    assert val == {k for k in train | val if in_val(k, 0.25)}
    assert count_split([ds], 0.25) == {"train": len(train), "val": len(val)}


def test_mixing_folders_and_epoch_shuffles(tmp_path):
    a, b = make(tmp_path, "a", 8), make(tmp_path, "b", 12)
    assert [p.name for p in shard_paths([a, b])] == ["a-000000.tar", "b-000000.tar", "a-000001.tar",
                                                     "b-000001.tar", "b-000002.tar"]
    s = ShardStream([a, b], "train", 0.0, eval_transform(16, MEAN, STD), buffer=5, seed=1)
    e0 = [k for _, _, k in s]
    assert sorted(e0) == sorted([f"a_{i:09d}" for i in range(8)] + [f"b_{i:09d}" for i in range(12)])
    assert e0 == [k for _, _, k in s]  # same (seed, epoch): same order
    s.set_epoch(1)
    assert [k for _, _, k in s] != e0


def test_transforms_and_collate(tmp_path):
    ds = make(tmp_path, "a", 6)
    tf = train_transform(24, MEAN, STD)
    s = ShardStream([ds], "train", 0.0, tf, shuffle=False)
    dl = DataLoader(s, batch_size=4, collate_fn=Collate(FakeTokenizer(), max_len=5, norm=tf.norm), num_workers=2)
    batches = list(dl)
    assert sum(len(b["keys"]) for b in batches) == 6
    b = batches[0]
    # uint8 through the workers' queue, float32 normalised once on the device
    assert b["images"].shape[1:] == (3, 24, 24) and b["images"].dtype == torch.uint8
    assert to_device(b, torch.device("cpu"))["images"].dtype == torch.float32
    assert b["input_ids"].shape[1] <= 5 and b["attention_mask"].shape == b["input_ids"].shape
    # eval: resize + centre crop + the encoder's normalisation, computed by hand
    x = eval_transform(8, MEAN, STD)(Image.new("RGB", (16, 8), (255, 0, 128)))
    assert x.shape == (3, 8, 8)
    assert torch.allclose(x[:, 0, 0], torch.tensor([(1 - 0.5) / 0.25, (0 - 0.5) / 0.25, (128 / 255 - 0.5) / 0.25]), atol=1e-5)


def test_transparent_images_become_white_and_features_load(tmp_path):
    buf = io.BytesIO()
    Image.new("RGBA", (4, 4), (0, 0, 0, 0)).save(buf, format="PNG")
    assert decode_rgb(buf.getvalue()).getpixel((0, 0)) == (255, 255, 255)
    import tarfile

    root = tmp_path / "feat"
    root.mkdir()
    with tarfile.open(root / "f-000000.tar", "w") as tf:
        for i in range(2):
            arr = io.BytesIO()
            np.save(arr, np.full((3, 5), i, dtype=np.float32))
            for ext, data in [("npy", arr.getvalue()), ("txt", b"x"), ("png", image_bytes(8, 8))]:
                info = tarfile.TarInfo(f"k{i}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    (root / "sizes.json").write_text('{"f-000000.tar": 2}')
    got = list(ShardStream([root], "train", 0.0, None, shuffle=False, use_features=True))
    assert [x.shape for x, _, _ in got] == [(3, 5), (3, 5)] and got[1][0][0, 0] == 1.0


def test_no_shards_is_an_error(tmp_path):
    from vlprep import VlprepError

    with pytest.raises(VlprepError, match="dataset not found"):
        ShardStream([tmp_path / "none"], "train", 0.1, None)


def test_skip_bad_shards_leaves_out_a_shard_that_is_an_html_page(tmp_path, capsys):
    """A server's HTML error page (a 200 with a proxy's "502 Bad Gateway" body) where a tar should be is a bad shard:
    one line without --skip-bad-shards, a counted skip with it."""
    from vlprep import VlprepError

    ds = make(tmp_path, "h", 8)
    (ds / "h-000001.tar").write_bytes(b"<html><body><h1>502 Bad Gateway</h1></body></html>\n" * 40)
    tf = eval_transform(16, MEAN, STD)
    with pytest.raises(VlprepError, match=r"h-000001\.tar: not a readable tar file"):
        list(ShardStream([ds], "train", 0.0, tf, shuffle=False))
    stream = ShardStream([ds], "train", 0.0, tf, shuffle=False, skip_bad_shards=True)
    assert len(list(stream)) == 4
    assert stream.counts.io_totals()["shards_skipped"] == 1
    assert "left out the rest of shard" in capsys.readouterr().err
