"""Multi-caption samples in vltrain: one caption drawn per sample per epoch in training, every caption scored in
`vltrain eval` and in the held-out checks."""

import dataclasses
import json
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from tests.conftest import tiny_checkpoint
from vlprep.shards import ShardsConfig, build_shards
from vlprep.encoders import eval_transform
from vltrain.cli import app
from vltrain.data.indexed import IndexedShards, InstanceView
from vltrain.data.samples import ALL, drawn_caption
from vltrain.data.stream import ShardStream
from vltrain.evaluate import embed_split, recall_at_k
from vltrain.model import build_model

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
WORDS = ["red", "green", "blue", "cat", "dog", "bird", "tree", "car", "boat", "house", "sun", "moon"]


@pytest.fixture(scope="module")
def karpathy(tmp_path_factory):
    """12 images with 1 to 4 captions each (5 in the test split, the rest train), written as a Karpathy split file
    and sharded by `vlprep shards` (4 samples per shard)."""
    tmp = tmp_path_factory.mktemp("karpathy")
    (tmp / "images" / "val").mkdir(parents=True)
    rng = np.random.default_rng(0)
    entries = []
    for i in range(12):
        name = f"im{i:02d}.png"
        noise = rng.integers(-20, 20, (40, 40, 3))
        Image.fromarray(np.clip(rng.integers(0, 255, 3) + noise, 0, 255).astype(np.uint8)).save(
            tmp / "images" / "val" / name)
        caps = [f"a {WORDS[i % 12]} {WORDS[(i * 5 + j + 1) % 12]} number {i} take {j}" for j in range(1 + i % 4)]
        entries.append({"filepath": "val", "filename": name, "imgid": i, "cocoid": 1000 + i,
                        "split": "test" if i < 5 else "train", "sentids": list(range(len(caps))),
                        "sentences": [{"raw": c, "tokens": c.split(), "imgid": i, "sentid": j}
                                      for j, c in enumerate(caps)]})
    path = tmp / "dataset_tiny.json"
    path.write_text(json.dumps({"images": entries, "dataset": "tiny"}))
    build_shards(ShardsConfig(src=path, out=tmp / "all", image_root=tmp / "images", samples_per_shard=4, workers=1))
    build_shards(ShardsConfig(src=path, out=tmp / "test", image_root=tmp / "images", split=["test"],
                              samples_per_shard=4, workers=1))
    return {"tmp": tmp, "all": tmp / "all", "test": tmp / "test",
            "captions": [[s["raw"] for s in e["sentences"]] for e in entries]}


def no_pixels(image) -> torch.Tensor:
    return torch.zeros(1)


def test_training_draws_one_caption_per_sample_per_epoch_the_same_in_every_worker(karpathy):
    """In the main process and in two loader workers kept across the 24 epochs (persistent_workers, as the trainer's
    Feed keeps them: they read each epoch from the stream's shared counter), one loader each, so the two workers
    start once rather than once per epoch. The claim is about captions: the images are decoded but not transformed
    (torchvision's transform would be most of the time)."""
    tf = no_pixels
    seen = {}
    streams = [ShardStream([karpathy["all"]], "train", 0.0, tf, shuffle=False, seed=3) for _ in range(2)]
    loaders = [torch.utils.data.DataLoader(streams[0], batch_size=None, num_workers=0),
               torch.utils.data.DataLoader(streams[1], batch_size=None, num_workers=2, persistent_workers=True)]
    for epoch in range(24):
        runs = []
        for stream, loader in zip(streams, loaders):
            stream.set_epoch(epoch)
            runs.append(sorted((key, caption) for _, caption, key in loader))
        assert runs[0] == runs[1]  # the draw is a function of (seed, epoch, key): no worker or order in it
        for key, caption in runs[0]:
            seen.setdefault(key, Counter())[caption] += 1
    for i, captions in enumerate(karpathy["captions"]):
        key = f"shard_{i:09d}"
        assert set(seen[key]) == set(captions), key  # over 24 epochs every caption of every sample comes up
        assert drawn_caption(captions, 3, 5, key) in captions
    assert drawn_caption(["only"], 3, 5, "k") == "only"


def test_the_index_samplers_view_draws_per_epoch_and_the_first_caption_for_spans(karpathy):
    shards = IndexedShards([karpathy["all"]])
    tf = eval_transform(16, MEAN, STD)
    view = InstanceView(shards, np.arange(12), tf, captions="draw", seed=3)
    first = InstanceView(shards, np.arange(12), tf)
    stream = ShardStream([karpathy["all"]], "train", 0.0, tf, shuffle=False, seed=3)
    for epoch in (0, 7):
        view.set_epoch(epoch)
        stream.set_epoch(epoch)
        assert [view[p][1] for p in range(12)] == [c for _, c, _ in stream]  # the same draw as the stream's
    assert [first[p][1] for p in range(12)] == [c[0] for c in karpathy["captions"]]


def test_eval_scores_every_caption_of_every_image(karpathy, tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt")
    r = CliRunner().invoke(app, ["eval", str(ckpt), str(karpathy["test"]), "--device", "cpu",
                                 "--out", str(tmp_path / "eval.json")])
    assert r.exit_code == 0, r.output + repr(r.exception)
    res = json.loads((tmp_path / "eval.json").read_text())
    caps = karpathy["captions"][:5]  # the test split: images 0-4 with 1, 2, 3, 4, 1 captions
    assert res["retrieval"]["n_images"] == 5 and res["retrieval"]["n_captions"] == sum(map(len, caps)) == 11
    assert "5 images, 11 captions" in r.output and "TR@1" in r.output and "IR@10" in r.output
    assert res["data"] and res["protocol"].startswith("multi-caption")

    # The same numbers from the embeddings, with the caption -> image map rebuilt from the file
    ck = torch.load(ckpt, weights_only=True)
    from vltrain.config_load import from_dict

    cfg = from_dict(ck["config"])
    model = build_model(cfg.model)
    model.load_state_dict(ck["model"])
    data = dataclasses.replace(cfg.data, val_frac=0.0, workers=0)
    emb = embed_split(model.eval(), [str(karpathy["test"])], "train", data, 3, torch.device("cpu"), False)
    assert emb["captions"] == [c for cs in caps for c in cs]  # file order, image by image
    assert emb["txt2img"].tolist() == [i for i, cs in enumerate(caps) for _ in cs]
    want = recall_at_k(emb["img"] @ emb["txt"].t(), emb["txt2img"])
    assert {k: res["retrieval"][k] for k in want} == want
    # chance for 1..4 captions per image among 11 (the first image has 1 caption: 1/11 at K=1)
    assert res["chance"]["i2t_r1"] == round(100 * sum(len(c) / 11 for c in caps) / 5, 2)


def test_caption_labelled_zero_shot_labels_an_image_by_its_first_caption(karpathy, tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt")
    classes = tmp_path / "classes.txt"
    classes.write_text("red\ngreen\nblue\ncat\n")  # image i's first caption starts "a WORDS[i] ..."
    r = CliRunner().invoke(app, ["eval", str(ckpt), str(karpathy["test"]), "--zeroshot", str(classes),
                                 "--device", "cpu", "--out", str(tmp_path / "eval.json")])
    assert r.exit_code == 0, r.output + repr(r.exception)
    zs = json.loads((tmp_path / "eval.json").read_text())["zeroshot"]
    # images 0-3 name red, green, blue, cat in their first caption; image 4 ("dog ...") names none of them
    assert (zs["samples"], zs["skipped"], zs["classes"]) == (4, 1, 4) and len(zs["templates"]) == 7


def test_held_out_checks_score_every_caption_of_the_held_out_images(karpathy, tmp_path):
    tiny = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
            "data.workers=0", "data.max_len=16", "log_every=1", "data.val_frac=0.5", "eval_every=2"]
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["run", str(karpathy["all"]), "--out", str(out), "--batch-size", "2", "--steps", "2",
                                 "--preset", "clip", "--device", "cpu", *[x for s in tiny for x in ("--set", s)]])
    assert r.exit_code == 0, r.output + repr(r.exception)
    ev = json.loads((out / "result.json").read_text())["eval"]
    assert ev is not None and ev["n_captions"] > ev["n_val"] >= 2  # several captions per held-out image
    assert "captions)" in r.output
    from vltrain.data.shards import in_val

    held = [i for i in range(12) if in_val(f"shard_{i:09d}", 0.5)]
    assert ev["n_val"] == len(held) and ev["n_captions"] == sum(len(karpathy["captions"][i]) for i in held)


def test_all_captions_mode_returns_a_tuple_per_sample(karpathy):
    stream = ShardStream([karpathy["test"]], "train", 0.0, eval_transform(16, MEAN, STD), shuffle=False,
                         captions=ALL)
    assert [c for _, c, _ in stream] == [tuple(c) for c in karpathy["captions"][:5]]
