"""data.decode gpu: the refusals (no CUDA, cached tokens, an augmentation the device cannot match), the device path
run with the CPU as its device against the worker's CPU view (same pixels, same RNG stream), what happens to a
member that is not an RGB or grey JPEG, and on CUDA (marker `cuda`) nvjpeg's views against the CPU's."""

import io

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from tests.conftest import colour_pairs
from vltrain.cli import app
from vltrain.config import ConfigError, DataConfig
from vltrain.config_load import load_config
from vltrain.data.collate import Collate, to_device
from vltrain.data.samples import DeviceView, JpegView, decode_on_device, load_sample, train_transform
from vltrain.errors import TrainError
from vltrain.resolve import DataFacts, check_gpu_decode, resolve

MEAN, STD = (0.48, 0.46, 0.41), (0.27, 0.26, 0.28)
SIZE = 32
CPU = torch.device("cpu")


def jpeg(w: int, h: int, seed: int, mode: str = "RGB", subsampling: int = 2) -> bytes:
    """A w x h JPEG of smooth colour ramps plus noise (q 90): crops of different boxes differ everywhere."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    ramp = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (w + h)], axis=-1)
    arr = np.clip(ramp + rng.integers(-30, 30, (h, w, 3)), 0, 255).astype(np.uint8)
    im = Image.fromarray(arr).convert(mode)
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=90, **({"subsampling": subsampling} if mode != "CMYK" else {}))
    return buf.getvalue()


def png_rgba(w: int, h: int, seed: int) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 4), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGBA").save(buf, format="PNG")
    return buf.getvalue()


class Tok:
    """A stand-in tokenizer: Collate's image handling is what is tested here."""

    def __call__(self, captions, **kw):
        n = len(captions)
        ones = torch.ones((n, 3), dtype=torch.long)
        return {"input_ids": ones, "attention_mask": ones.clone()}


def views(interpolation: str = "bilinear"):
    """(the CPU view without draft decode, the gpu-decode view) for augment none; both read full-size images."""
    cpu = train_transform(SIZE, MEAN, STD, 0.5, "none", interpolation)
    cpu.draft = None  # the device decodes in full, so the CPU view it matches does too
    return cpu, train_transform(SIZE, MEAN, STD, 0.5, "none", interpolation, decode="gpu")


def raws(members: list[tuple[str, bytes]]) -> list[dict]:
    return [{"__key__": f"s{i}", "txt": b"a caption", ext: data} for i, (ext, data) in enumerate(members)]


def both_paths(samples: list[dict], interpolation: str = "bilinear", seed: int = 7) -> tuple:
    """(CPU batch, gpu-decode batch before to_device, the RNG states after each), from one seed."""
    cpu, gpu = views(interpolation)
    collate = Collate(Tok(), 8, norm=cpu.norm)
    torch.manual_seed(seed)
    a = collate([load_sample(r, cpu, False) for r in samples])
    state_a = torch.get_rng_state()
    torch.manual_seed(seed)
    b = collate([load_sample(r, gpu, False) for r in samples])
    return a, b, state_a, torch.get_rng_state()


# --- refusals ---------------------------------------------------------------------------------------------------

def test_a_cpu_device_refuses_gpu_decode_in_resolve():
    cfg = load_config("clip", shards=["unused"], batch_size=8, sets=["data.decode=gpu"])
    with pytest.raises(ConfigError) as e:
        resolve(cfg, CPU, DataFacts(features=None, n_train=800, per_epoch=100))
    assert str(e.value) == ("data.decode=gpu decodes JPEGs with nvjpeg on a CUDA device, and this run's device is "
                            "cpu; use data.decode=cpu")
    # decode cpu resolves on the same machine
    assert resolve(load_config("clip", shards=["unused"], batch_size=8), CPU, DataFacts(None, 800, 100))


def test_cached_tokens_and_unmatched_augments_are_refused_on_cuda_too():
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    with pytest.raises(ConfigError, match=r"^data.decode=gpu decodes JPEG pixels, and the shards hold `vlprep "
                                          r"features` tokens \(nothing to decode\); leave data.decode at cpu$"):
        check_gpu_decode(DataConfig(decode="gpu", input="features"), cuda)
    for augment in ("albef", "softmask"):
        with pytest.raises(ConfigError) as e:
            check_gpu_decode(DataConfig(decode="gpu", input="pixels", augment=augment), cuda)
        assert f"data.augment={augment} draws its ops per sample" in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(ValueError) as direct:  # the transform, built before resolve runs, says the same line
            train_transform(SIZE, MEAN, STD, 0.5, augment, decode="gpu")
        assert str(direct.value) == str(e.value)
    check_gpu_decode(DataConfig(decode="gpu", input="pixels", augment="none"), cuda)  # the one it runs
    # the albef preset sets augment albef: refused as one line by the same rule
    cfg = load_config("albef", shards=["unused"], batch_size=8, sets=["data.decode=gpu"])
    with pytest.raises(ConfigError, match="data.augment=albef"):
        resolve(cfg, cuda, DataFacts(None, 800, 100))


def test_the_cli_refuses_gpu_decode_on_a_cpu_in_one_line(tmp_path):
    shards = colour_pairs(tmp_path, 8)
    # preset clip: augment none, the one augmentation decode gpu runs (albef's RandAugment is refused first)
    result = CliRunner().invoke(app, ["run", str(shards), "--out", str(tmp_path / "run"), "--batch-size", "4",
                                      "--preset", "clip",
                                      "--steps", "1", "--device", "cpu", "--set", "model.text_model=tiny",
                                      "--set", "model.image_model=tiny", "--set", "data.image_size=32",
                                      "--set", "data.workers=0", "--set", "data.decode=gpu"])
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if "data.decode" in line]
    assert len(lines) == 1 and "this run's device is cpu; use data.decode=cpu" in lines[0], result.output
    assert "Traceback" not in result.output


# --- the device path, with the CPU as the device ----------------------------------------------------------------

@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_cpu_device_views_equal_the_worker_views_exactly(interpolation):
    # Sizes from smaller than the view (upsampled) to several times it, landscape, portrait, 4:2:0 and 4:4:4 and a
    # grey JPEG: every crop box, flip and pixel as the CPU path's. Both decode with libjpeg-turbo (PIL's, and
    # torchvision's, both integer IDCT with fancy upsampling: identical pixels) and both crop with torchvision's
    # resized_crop on the same uint8 image, so the tolerance is zero.
    members = [("jpg", jpeg(23, 19, 0)), ("jpg", jpeg(97, 61, 1)), ("jpg", jpeg(40, 130, 2, subsampling=0)),
               ("jpg", jpeg(150, 150, 3, mode="L")), ("jpg", jpeg(64, 48, 4)), ("jpg", jpeg(211, 77, 5)),
               ("jpg", jpeg(33, 35, 6)), ("jpg", jpeg(120, 90, 7))]
    a, b, state_a, state_b = both_paths(raws(members), interpolation)
    assert b["images"].shape == (0, 3, SIZE, SIZE) and b["jpeg"]["at"].tolist() == list(range(8))
    assert b["jpeg"]["interpolation"] == interpolation
    assert torch.equal(state_a, state_b)  # the same draws, in the same order: the next sample's stream is the same
    ta, tb = to_device(a, CPU), to_device(b, CPU)
    assert "jpeg" not in tb and "pixel_norm" not in tb
    assert torch.equal(ta["images"], tb["images"])
    assert b["jpeg"]["flip"].any() and not b["jpeg"]["flip"].all()  # both flip branches were taken


def test_crop_boxes_are_drawn_as_random_resized_crop_draws_them():
    # Re-derived: torchvision's RandomResizedCrop (v1 get_params, a separate implementation of the same draws) on
    # the decoded image, then the flip's torch.rand(1) < 0.5, from the same seed.
    from torchvision import transforms as v1

    data = jpeg(180, 70, 11)
    _, gpu = views()
    torch.manual_seed(5)
    shipped = [gpu.ship(data) for _ in range(20)]
    torch.manual_seed(5)
    image = torch.zeros((3, 70, 180), dtype=torch.uint8)
    for view in shipped:
        box = v1.RandomResizedCrop.get_params(image, scale=[0.5, 1.0], ratio=[3 / 4, 4 / 3])
        assert view.box == tuple(box) and view.flip == bool(torch.rand(1) < 0.5)
        assert view.size == SIZE and bytes(view.data.numpy()) == data


def test_non_jpeg_members_are_decoded_on_the_worker_and_keep_their_places():
    # A PNG with alpha (composited on white), a CMYK JPEG (PIL's conversion, not libjpeg's) and a WebP: the CPU
    # view's uint8 tensor, made on the worker from the same draws; the JPEGs around them go to the device.
    webp = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (30, 50, 3), dtype=np.uint8)).save(webp, "WEBP")
    members = [("png", png_rgba(60, 40, 0)), ("jpg", jpeg(80, 60, 1)), ("jpg", jpeg(70, 70, 2, mode="CMYK")),
               ("jpg", jpeg(50, 90, 3)), ("webp", webp.getvalue()), ("jpg", jpeg(45, 45, 4))]
    a, b, state_a, state_b = both_paths(raws(members))
    assert b["jpeg"]["at"].tolist() == [1, 3, 5]  # the worker decoded 0, 2 and 4
    assert b["images"].shape == (3, 3, SIZE, SIZE) and torch.equal(b["images"], a["images"][[0, 2, 4]])
    assert torch.equal(state_a, state_b)
    assert torch.equal(to_device(a, CPU)["images"], to_device(b, CPU)["images"])
    assert b["keys"] == a["keys"] == [f"s{i}" for i in range(6)]


def test_a_batch_without_jpegs_is_the_cpu_batch():
    members = [("png", png_rgba(40 + i, 30, i)) for i in range(3)]
    a, b, _, _ = both_paths(raws(members))
    assert "jpeg" not in b and torch.equal(a["images"], b["images"])


def test_to_device_normalises_the_decoded_views_as_the_cpu_path():
    # (x / 255 - mean) / std, written out here, on the views the device decoded
    members = [("jpg", jpeg(90, 70, i)) for i in range(4)]
    a, b, _, _ = both_paths(raws(members))
    got = to_device(b, CPU)["images"]
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    want = (a["images"].to(torch.float32) * (1.0 / 255) - mean) / std
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_an_undecodable_jpeg_stops_with_one_line_naming_its_sample():
    # its header reads, so the worker ships it; the device cannot decode it and cannot drop it from the batch
    good, cut = jpeg(60, 60, 0), jpeg(60, 60, 1)
    members = [("jpg", good), ("jpg", cut[: len(cut) // 2])]
    gpu = views()[1]
    b = Collate(Tok(), 8, norm=gpu.norm)([load_sample(r, gpu, False) for r in raws(members)])
    with pytest.raises(TrainError) as e:
        to_device(b, CPU)
    text = str(e.value)
    assert text.startswith("sample s1: its JPEG does not decode on cpu (") and "\n" not in text
    assert ".cpp" not in text and "data.decode=cpu" in text


def test_device_view_is_picklable_for_spawned_workers():
    import pickle

    _, gpu = views()
    again = pickle.loads(pickle.dumps(gpu))
    assert isinstance(again, DeviceView) and again.norm == gpu.norm and again.size == SIZE


# --- on CUDA ----------------------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_nvjpeg_views_match_the_cpu_views_within_the_decoders_difference():
    # nvjpeg and libjpeg may differ per decoded pixel: each IDCT is held to +-1 on Y, Cb and Cr (ITU-T T.83's
    # accuracy test), and YCbCr -> RGB multiplies those by at most 1 + 1.772 (B = Y + 1.772 Cb), plus the two
    # decoders' own rounding to uint8 (1): |diff| <= 4 per decoded pixel. 4:4:4 JPEGs, so chroma upsampling (where
    # decoders differ by design) plays no part. Bilinear resampling with antialias weighs pixels by non-negative
    # weights summing to 1, so the difference stays <= 4 before each side rounds to uint8: <= 5 after. A wrong box
    # or flip moves the ramps by tens of levels.
    members = [("jpg", jpeg(97 + 13 * i, 61 + 29 * i, i, subsampling=0)) for i in range(8)]
    a, b, _, _ = both_paths(raws(members))
    cpu_views = a["images"]
    data, box, flip = b["jpeg"]["data"], b["jpeg"]["box"], b["jpeg"]["flip"]
    gpu_views = decode_on_device(data, box, flip, SIZE, "bilinear", torch.device("cuda")).cpu()
    diff = (gpu_views.int() - cpu_views.int()).abs()
    assert int(diff.max()) <= 5, f"max |nvjpeg - libjpeg| after the crop: {int(diff.max())}"
    # the whole to_device path on CUDA, normalised: the same views within 5 / 255 / std
    got = to_device(b, torch.device("cuda"))["images"].cpu()
    want = to_device(a, CPU)["images"]
    assert float((got - want).abs().max()) <= 5 / 255 / min(STD) + 1e-5


@pytest.mark.slow  # builds shards and forks a loader worker for each side: about 5 s
def test_a_loader_worker_ships_what_the_cpu_loader_decodes(tmp_path):
    # The whole loader: shards of JPEGs and PNGs streamed by a forked DataLoader worker (reseeded per epoch as in a
    # run), batches collated there, then to_device on the CPU: the same batches, image for image, as decode cpu's.
    from vlprep.shards import ShardsConfig, build_shards
    from vltrain.data.feed import epoch_batches, make_loader, next_batch
    from vltrain.data.stream import ShardStream

    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        if i % 4 == 3:
            (src / f"{i:03d}.png").write_bytes(png_rgba(50 + i, 40, i))
        else:
            (src / f"{i:03d}.jpg").write_bytes(jpeg(60 + 9 * i, 90 - 3 * i, i))
        (src / f"{i:03d}.txt").write_text(f"caption {i}")
    build_shards(ShardsConfig(src=src, out=tmp_path / "ds", samples_per_shard=6, workers=1))
    cpu, gpu = views()
    batches = {}
    for name, tf in (("cpu", cpu), ("gpu", gpu)):
        stream = ShardStream([tmp_path / "ds"], "train", 0.0, tf, seed=3)
        loader = make_loader(3, stream, None, Collate(Tok(), 8, norm=cpu.norm), 4, 1, CPU)
        it, rng = epoch_batches(loader, 0, 3, stream, None)
        got = []
        for _ in range(3):
            batch, rng = next_batch(it, rng)
            got.append(batch)
        batches[name] = got
        del it, loader
    assert sum("jpeg" in b for b in batches["gpu"]) == 3
    assert sum(len(b["jpeg"]["at"]) for b in batches["gpu"]) == 9  # the 3 PNGs were decoded on the worker
    for a, b in zip(batches["cpu"], batches["gpu"]):
        assert a["keys"] == b["keys"]
        assert torch.equal(to_device(a, CPU)["images"], to_device(b, CPU)["images"])


@pytest.mark.slow
def test_a_run_builds_its_training_views_with_the_decode_it_was_given(tmp_path, monkeypatch):
    # The run's data (trainset.training_data) hands data.decode to the training transform: a CUDA run that passes
    # the checks ships JPEG bytes, rather than decoding on the workers as decode cpu would.
    import vltrain.trainset as trainset

    built = []
    real = trainset.train_transform
    monkeypatch.setattr(trainset, "train_transform", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    shards = colour_pairs(tmp_path, 8)
    for decode, kind in (("gpu", DeviceView), ("cpu", type(train_transform(SIZE, MEAN, STD)))):
        cfg = load_config("clip", shards=[str(shards)], batch_size=4,
                          sets=["model.text_model=tiny", "model.image_model=tiny", "data.image_size=32",
                                "data.workers=0", f"data.decode={decode}"])
        trainset.training_data(cfg, False, None, 0, 1)
        assert isinstance(built[-1], kind), (decode, type(built[-1]))
