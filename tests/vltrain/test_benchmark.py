"""`vltrain benchmark` and the CLIP_benchmark loader (vltrain/benchmark.py) against `vltrain eval`.

The two sides share no code for the model call: `vltrain eval` embeds through vltrain's own data path
(vltrain.zeroshot, vltrain.evaluate), CLIP_benchmark through the loader's encode_image / encode_text inside its own
loops, datasets (its WebDataset layout, read by its builder) and metrics (clip_benchmark.metrics). Both read the
same image files and the same prompts, so the numbers must agree; the data leave no near-ties (checked), so
"agree" means equal to the printed digits.
"""

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image
from typer.testing import CliRunner

from tests.conftest import tiny_checkpoint
from tests.vltrain.test_trainer_usability import error_line
from vltrain.cli import app

CLASSES = ["red car", "cat", "blue house", "tree", "small dog"]
TEMPLATES = ["a photo of a {}.", "art of the {}."]
PER_CLASS = 4
N_RET = 12
# The same pixels or tokens embedded in another batch shape: float32 reductions that may group their terms
# differently, on unit-norm outputs (measured: at most 1 ulp, 6e-8); 16 ulps at 1.0 (16 * 2**-24 = 9.5e-7) allowed
EMB_TOL = 1e-6
# How far a cosine can move when each of its two E-dim unit vectors moves by at most EMB_TOL per entry:
# |a.b - a'.b'| <= |a - a'| + |b - b'| <= 2 sqrt(E) EMB_TOL. A score gap above twice that cannot flip between sides.
EMBED_DIM = 16
SCORE_TOL = 2 * EMBED_DIM ** 0.5 * EMB_TOL
TINY = ["model.text_model=tiny", "model.image_model=tiny", f"model.embed_dim={EMBED_DIM}", "data.image_size=32",
        "data.workers=0", "data.max_len=12", "log_every=100", "optim.warmup_steps=2", "optim.lr=0.003",
        "data.val_frac=0", "model.fusion_layers=0"]


def png(rng, alpha: bool = False) -> bytes:
    """A 28 x 24 PNG: a random colour plus noise; with alpha, partly transparent."""
    base = rng.integers(0, 255, 3)
    arr = np.clip(base + rng.integers(-30, 30, (24, 28, 3)), 0, 255).astype(np.uint8)
    if alpha:
        arr = np.concatenate([arr, rng.integers(60, 200, (24, 28, 1)).astype(np.uint8)], axis=2)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def write_wds(root: Path, samples: list[dict], split: str = "test") -> None:
    """CLIP_benchmark's WebDataset layout: ROOT/SPLIT/nshards.txt and ROOT/SPLIT/0.tar."""
    (root / split).mkdir(parents=True)
    (root / split / "nshards.txt").write_text("1\n")
    with wds.TarWriter(str(root / split / "0.tar")) as sink:
        for s in samples:
            sink.write(s)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny checkpoint; one zero-shot set as an image folder (vltrain eval) and as CLIP_benchmark's WebDataset;
    one retrieval set (12 images, 1 to 3 captions each) as vlprep shards and as CLIP_benchmark's WebDataset."""
    from vlprep.shards import ShardsConfig, build_shards

    tmp = tmp_path_factory.mktemp("bench")
    rng = np.random.default_rng(3)
    folder = tmp / "zs-folder"
    samples = []
    for c in range(len(CLASSES)):
        (folder / f"c{c}").mkdir(parents=True)
        for i in range(PER_CLASS):
            data = png(rng)
            (folder / f"c{c}" / f"{i}.png").write_bytes(data)
            samples.append({"__key__": f"c{c}_{i}", "png": data, "cls": c})
    (folder / "classnames.txt").write_text("\n".join(CLASSES) + "\n")
    train_src = tmp / "train-src"
    train_src.mkdir()
    for s in samples:
        (train_src / f"{s['__key__']}.png").write_bytes(s["png"])
        (train_src / f"{s['__key__']}.txt").write_text(f"a photo of a {CLASSES[s['cls']]}.")
    build_shards(ShardsConfig(src=train_src, out=tmp / "zs-shards", samples_per_shard=10, workers=1))
    (folder / "templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    zs = tmp / "zs-wds"
    write_wds(zs, samples)
    (zs / "classnames.txt").write_text("\n".join(CLASSES) + "\n")
    (zs / "zeroshot_classification_templates.txt").write_text("\n".join(t.replace("{}", "{c}") for t in TEMPLATES))

    (tmp / "images").mkdir()
    entries = []
    ret = []
    words = ["red", "green", "cat", "dog", "tree", "boat", "sun", "moon"]
    for i in range(N_RET):
        data = png(rng)
        (tmp / "images" / f"im{i:02d}.png").write_bytes(data)
        caps = [f"a {words[i % 8]} {words[(i * 3 + j + 1) % 8]} number {i} take {j}" for j in range(1 + i % 3)]
        entries.append({"filepath": "images", "filename": f"im{i:02d}.png", "imgid": i, "split": "test",
                        "sentences": [{"raw": c} for c in caps]})
        ret.append({"__key__": f"im{i:02d}", "png": data, "txt": "\n".join(caps)})
    (tmp / "karpathy.json").write_text(json.dumps({"images": entries}))
    build_shards(ShardsConfig(src=tmp / "karpathy.json", out=tmp / "ret-shards", image_root=tmp,
                              samples_per_shard=5, workers=1))
    write_wds(tmp / "ret-wds", ret)
    (tmp / "ret-wds" / "dataset_type.txt").write_text("retrieval\n")
    return {"tmp": tmp, "ckpt": tiny_checkpoint(tmp / "ckpt.pt"), "folder": folder, "zs": zs,
            "ret_shards": tmp / "ret-shards", "ret": tmp / "ret-wds", "captions": [e["sentences"] for e in entries],
            "zs_shards": tmp / "zs-shards"}


@pytest.fixture(scope="module")
def trained(data) -> Path:
    """The tiny model trained for 60 ITC steps on both sets' images and captions: a random one scores every class
    and caption within a few 1e-6 of each other, too close to call either way."""
    out = data["tmp"] / "run"
    r = invoke("run", data["zs_shards"], data["ret_shards"], "--out", out, "--preset", "clip", "--steps", 60,
               "--batch-size", 8, "--device", "cpu", *[x for t in TINY for x in ("--set", t)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    return out / "last.pt"


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def benchmark(data, ckpt, dataset: str, root, task: str, name: str, *extra) -> dict:
    out = data["tmp"] / f"{name}.json"
    r = invoke("benchmark", ckpt, "--dataset", dataset, "--dataset-root", root, "--task", task,
               "--output", out, "--batch-size", 7, "--num-workers", 0, *extra)
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "CLIP_benchmark" in r.output
    return json.loads(out.read_text())


@pytest.mark.slow
def test_zero_shot_equals_vltrain_eval(data, trained):
    """top-1, top-5 and mean per-class recall from CLIP_benchmark's zero-shot code equal `vltrain eval`'s on the same
    20 images, 5 class names and 2 templates; the classifier and the image embeddings agree entry by entry."""
    cb = benchmark(data, trained, "wds/tiny", data["zs"], "zeroshot_classification", "zs")
    assert cb["task"] == "zeroshot_classification" and cb["model"] == "vltrain"
    r = invoke("eval", trained, "--zeroshot-folder", data["folder"], "--device", "cpu",
               "--out", data["tmp"] / "eval-zs.json")
    assert r.exit_code == 0, r.output + repr(r.exception)
    ours = json.loads((data["tmp"] / "eval-zs.json").read_text())["zeroshot"]
    assert ours["images"] == len(CLASSES) * PER_CLASS and ours["templates"] == TEMPLATES
    m = cb["metrics"]
    assert [round(100 * m[k], 2) for k in ("acc1", "acc5", "mean_per_class_recall")] == [
        ours["top1"], ours["top5"], ours["mean_per_class"]]

    # Per item, through the loader and CLIP_benchmark's own classifier builder, against vltrain.load
    import vltrain
    from clip_benchmark.metrics.zeroshot_classification import zero_shot_classifier
    from vltrain.benchmark import load_vltrain

    model, transform, tokenizer = load_vltrain("vltrain", str(trained), None, "cpu")
    ref = vltrain.load(trained, device="cpu")
    files = sorted(data["folder"].glob("c*/*.png"))
    theirs = model.encode_image(torch.stack([transform(Image.open(f)) for f in files]))
    mine = ref.encode_images(files)
    assert (theirs - mine).abs().max() < EMB_TOL
    clf = zero_shot_classifier(model, tokenizer, CLASSES, [t.replace("{}", "{c}") for t in TEMPLATES], "cpu",
                               amp=False)
    classes = ref.classifier(CLASSES, TEMPLATES)
    assert (clf.t() - classes).abs().max() < EMB_TOL
    # no near-ties: each image's true-class score is apart from every other class's by more than the two sides'
    # embeddings can move a score, so top-1 and top-5 cannot differ between them
    scores = mine @ classes.t()
    labels = torch.arange(len(CLASSES)).repeat_interleave(PER_CLASS)
    gaps = (scores - scores.gather(1, labels[:, None])).abs()
    gaps[torch.arange(len(labels)), labels] = float("inf")
    assert gaps.min() > 2 * SCORE_TOL


@pytest.mark.slow
def test_retrieval_equals_vltrain_eval(data, trained):
    """Image->text and text->image R@1/5/10 from CLIP_benchmark's retrieval code (any caption of an image counts for
    image->text, as in the papers) equal `vltrain eval`'s multi-caption recalls on the same 12 images and 24
    captions."""
    cb = benchmark(data, trained, "wds/tinyret", data["ret"], "zeroshot_retrieval", "ret", "--num-workers", 2)
    r = invoke("eval", trained, data["ret_shards"], "--device", "cpu", "--out", data["tmp"] / "eval-ret.json")
    assert r.exit_code == 0, r.output + repr(r.exception)
    ours = json.loads((data["tmp"] / "eval-ret.json").read_text())["retrieval"]
    assert ours["n_images"] == N_RET and ours["n_captions"] == sum(map(len, data["captions"])) == 24
    for k in (1, 5, 10):
        # CLIP_benchmark's "text retrieval" is image->text (TR), its "image retrieval" text->image (IR)
        assert round(100 * cb["metrics"][f"text_retrieval_recall@{k}"], 2) == ours[f"i2t_r{k}"]
        assert round(100 * cb["metrics"][f"image_retrieval_recall@{k}"], 2) == ours[f"t2i_r{k}"]

    import vltrain

    ref = vltrain.load(trained, device="cpu")
    sim = ref.encode_images(sorted((data["tmp"] / "images").glob("*.png"))) @ ref.encode_texts(
        [s["raw"] for caps in data["captions"] for s in caps]).t()
    txt2img = torch.tensor([i for i, caps in enumerate(data["captions"]) for _ in caps])
    positive = torch.zeros_like(sim, dtype=torch.bool)
    positive[txt2img, torch.arange(len(txt2img))] = True
    # no near-ties where a rank is decided: an image's best caption against its wrong captions, a caption's image
    # against the other images
    best = sim.masked_fill(~positive, float("-inf")).amax(dim=1, keepdim=True)
    assert (best - sim)[~positive].abs().min() > 2 * SCORE_TOL
    own = sim[txt2img, torch.arange(len(txt2img))]
    assert (own[None, :] - sim)[~positive].abs().min() > 2 * SCORE_TOL


def test_the_loader_reads_an_export_and_tokens_carry_the_mask(data, tmp_path):
    """`pretrained` may be an export folder; the tokenizer's (B, 2, L) carries the ids and the mask as
    vltrain.Model.tokens makes them, padded captions embed as vltrain.Model.encode_texts does."""
    import vltrain
    from vltrain.benchmark import load_vltrain
    from vltrain.export import export

    export(data["ckpt"], tmp_path / "exp")
    model, _, tokenizer = load_vltrain(pretrained=str(tmp_path / "exp"), device="cpu")
    ref = vltrain.load(data["ckpt"], device="cpu")
    texts = ["a cat", "a much longer caption about a small dog in the park"]
    tok = tokenizer(texts)
    want = ref.tokens(texts)
    assert tok.shape == (2, 2, want["input_ids"].shape[1]) and tok.dtype == torch.long
    assert torch.equal(tok[:, 0], want["input_ids"]) and torch.equal(tok[:, 1], want["attention_mask"])
    assert tok[0, 1].sum() < tok[1, 1].sum()  # the short caption is padded, and its mask says so
    assert (model.encode_text(tok) - ref.encode_texts(texts)).abs().max() < EMB_TOL
    # a transparent image is composited on white, as vltrain.Model reads it (CLIP_benchmark's own readers drop alpha
    # before the transform sees the image: docs/EVALUATION.md)
    _, transform, _ = load_vltrain(pretrained=str(data["ckpt"]))
    clear = Image.open(io.BytesIO(png(np.random.default_rng(0), alpha=True)))
    assert clear.mode == "RGBA" and torch.equal(transform(clear), ref.pixels([clear])[0])
    assert not torch.equal(transform(clear), ref.pixels([clear.convert("RGB")])[0])
    # CLIP_benchmark's --amp wraps the calls in an autocast: the embeddings stay vltrain's (float32 on a CPU)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp = model.encode_text(tok)
    assert amp.dtype == torch.float32 and torch.equal(amp, model.encode_text(tok))


def test_accuracy_is_top_k_hits_over_n_and_stands_in_only_inside_the_block():
    """vltrain.benchmark.accuracy against a loop over rows (the true class among the k highest logits), and the
    registry block: CLIP_benchmark's own accuracy back after it (it fails under NumPy >= 2.4)."""
    from clip_benchmark import models
    from clip_benchmark.metrics import linear_probe, zeroshot_classification
    from vltrain.benchmark import accuracy, registered

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 6, generator=gen)
    target = torch.randint(0, 6, (9,), generator=gen)
    want = [sum(int(target[i]) in logits[i].argsort(descending=True)[:k].tolist() for i in range(9)) / 9
            for k in (1, 3, 5)]
    assert accuracy(logits, target, topk=(1, 3, 5)) == want
    original = zeroshot_classification.accuracy
    types = list(models.MODEL_TYPES)
    with registered():
        assert models.MODEL_TYPES == [*types, "vltrain"] and "vltrain" in models.TYPE2FUNC
        try:
            original(logits, target)
        except TypeError:  # this NumPy refuses float() of a one-element array: the stand-in is in both modules
            assert zeroshot_classification.accuracy is accuracy and linear_probe.accuracy is accuracy
        else:
            assert zeroshot_classification.accuracy is original
    assert zeroshot_classification.accuracy is original and linear_probe.accuracy is original
    assert models.MODEL_TYPES == types and "vltrain" not in models.TYPE2FUNC


def test_clip_benchmarks_own_command_line_takes_model_type_vltrain(data, capsys):
    """`python -m vltrain.benchmark eval --model_type vltrain ...` (vltrain.benchmark.main): CLIP_benchmark's own
    argument parser and main, the numbers of `vltrain benchmark`; the registry is as it was afterwards."""
    from clip_benchmark import models
    from vltrain.benchmark import main

    types = list(models.MODEL_TYPES)
    out = data["tmp"] / "cb-cli.json"
    assert main(["eval", "--model_type", "vltrain", "--model", "vltrain", "--pretrained", str(data["ckpt"]),
                 "--dataset", "wds/tiny", "--dataset_root", str(data["zs"]), "--task", "zeroshot_classification",
                 "--output", str(out), "--no_amp", "--num_workers", "0", "--batch_size", "3", "--quiet"]) == 0
    assert models.MODEL_TYPES == types and "vltrain" not in models.TYPE2FUNC
    ours = benchmark(data, data["ckpt"], "wds/tiny", data["zs"], "zeroshot_classification", "zs2")
    assert json.loads(out.read_text())["metrics"] == ours["metrics"]


@pytest.mark.slow
def test_python_m_vltrain_benchmark_is_clip_benchmarks_command_line(data):
    """The documented `python -m vltrain.benchmark eval --model_type vltrain ...`, in a process of its own."""
    import os
    import subprocess

    out = data["tmp"] / "cb-m.json"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "vltrain.benchmark", "eval", "--model_type", "vltrain", "--model",
                        "vltrain", "--pretrained", str(data["ckpt"]), "--dataset", "wds/tinyret", "--dataset_root",
                        str(data["ret"]), "--task", "zeroshot_retrieval", "--recall_k", "1", "5", "--output", str(out),
                        "--num_workers", "0", "--quiet"], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["task"] == "zeroshot_retrieval" and set(res["metrics"]) == {
        f"{d}_retrieval_recall@{k}" for d in ("image", "text") for k in (1, 5)}


@pytest.mark.parametrize("args, message", [
    (["--dataset", "no_such_set"], "CLIP_benchmark on no_such_set (zeroshot_classification): Unsupported dataset"),
    (["--task", "captioning"], "task 'captioning' is not one of zeroshot_classification, zeroshot_retrieval"),
    (["--dataset", "vtab"], "--dataset 'vtab' names several datasets"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--dataset-root", "MISSING"], "CLIP_benchmark on wds/tiny (zeroshot_classification): [Errno 2]"),
])
def test_bad_arguments_are_one_line_errors(data, args, message):
    base = {"--dataset": "wds/tiny", "--dataset-root": str(data["zs"]), "--task": "zeroshot_classification"}
    extra = []
    for key, value in zip(args[::2], args[1::2]):
        if key in base:
            base[key] = str(data["tmp"] / "missing") if value == "MISSING" else value
        else:
            extra += [key, value]
    r = invoke("benchmark", data["ckpt"], *[x for kv in base.items() for x in kv], *extra, "--num-workers", 0,
               "--output", data["tmp"] / "never.json")
    assert message in error_line(r)
    assert not (data["tmp"] / "never.json").exists()
    from clip_benchmark import models

    assert "vltrain" not in models.TYPE2FUNC and "vltrain" not in models.MODEL_TYPES  # taken out after a failure too


@pytest.mark.slow  # two loader worker processes (one fails while the other may still run): the workers are the point
def test_a_loader_workers_error_is_its_last_line_and_leaves_no_worker(data, tmp_path):
    """nshards.txt promises 2 shards and only 0.tar exists: the second worker fails reading 1.tar; the error is the
    worker's own last line, not its traceback, and (the leak guard checks) no worker process outlives the command.
    Two workers on one real shard (the retrieval test) are capped to one: webdataset stops a worker with no shard."""
    import shutil

    shutil.copytree(data["zs"], tmp_path / "zs")
    (tmp_path / "zs" / "test" / "nshards.txt").write_text("2\n")
    r = invoke("benchmark", data["ckpt"], "--dataset", "wds/tiny", "--dataset-root", tmp_path / "zs", "--task",
               "zeroshot_classification", "--num-workers", 2, "--output", tmp_path / "out.json")
    assert r.exit_code == 2 and "Traceback" not in r.output
    line = r.output.splitlines()[-1]  # after CLIP_benchmark's progress bars
    assert line.startswith("error: CLIP_benchmark on wds/tiny (zeroshot_classification): ") and "1.tar" in line


def test_a_file_that_is_no_checkpoint_and_a_missing_clip_benchmark_are_one_line_errors(data, tmp_path, monkeypatch):
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    r = invoke("benchmark", tmp_path / "bad.pt", "--dataset", "wds/tiny", "--dataset-root", data["zs"])
    assert "bad.pt" in error_line(r)
    r = invoke("benchmark", "s3://b/last.pt", "--dataset", "wds/tiny", "--dataset-root", data["zs"])
    assert error_line(r).startswith("error: CHECKPOINT s3://b/last.pt: ")  # fetched (no credentials here): one line naming it
    monkeypatch.setitem(sys.modules, "clip_benchmark", None)  # as if not installed
    r = invoke("benchmark", data["ckpt"], "--dataset", "wds/tiny", "--dataset-root", data["zs"])
    assert "CLIP_benchmark cannot be imported (missing: clip_benchmark); pip install" in error_line(r)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal; the CUDA run is the next test")
def test_linear_probe_on_a_cpu_is_a_one_line_error(data):
    r = invoke("benchmark", data["ckpt"], "--dataset", "wds/tiny", "--dataset-root", data["zs"],
               "--task", "linear_probe")
    assert "linear probe runs on CUDA only" in error_line(r)


@pytest.mark.cuda
def test_linear_probe_runs_on_cuda(data, tmp_path):
    """CLIP_benchmark's linear probe (a logistic regression trained with torch, CUDA only) on the zero-shot images as
    both train and test split: it runs and reports its accuracies."""
    import shutil

    root = tmp_path / "lp"
    shutil.copytree(data["zs"], root)
    shutil.copytree(root / "test", root / "train")
    res = benchmark(data, data["ckpt"], "wds/tiny", root, "linear_probe", "lp")
    assert 0 <= res["metrics"]["lp_acc1"] <= 1 and res["task"] == "linear_probe"
