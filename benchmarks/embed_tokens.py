"""Benchmark `vlprep embed --checkpoint` on a `vlprep features` dataset: cached tokens against pixels, same run.

Set-up (untimed): --images synthetic photograph-like JPEGs (smooth random colour fields with noise, 320 x 240,
quality 90) sharded 50 a shard by `vlprep shards`; their `vlprep features` output through the packaged
EfficientNet-Lite0 at --size (224: 49 x 1280 float16 tokens, as the demo's bow-feat), default batch; a checkpoint
of a model trained on those tokens (image_model features with that feature_encoder, the tiny text model, random
weights: the image side's cost is a mean and a projection whatever the weights), saved as vltrain saves one.
Sides: the CLI, `python -m vlprep.cli embed SRC OUT --checkpoint CKPT --device cpu --batch-size 64` into a fresh
folder, in its own process (a user's run: imports and the checkpoint load included):
- tokens: SRC the features dataset: each sample's `npy` member is read and goes through the model's image side; no
  image is decoded and the frozen encoder never runs.
- pixels: SRC the pixel shards (the same images): decode, eval view, the recorded frozen encoder run as `vlprep
  features` runs it, the stored dtype's rounding, then the same image side.
Two figures per run: the process's wall time, and the stage's own `elapsed_s` from OUT/report.json (the stage alone:
no imports). Rounds alternate the order (benchmarks/common.py) after one untimed round; medians decide. Both outputs
are compared once: np.array_equal of the two embeddings.npy and equal keys.parquet (the test suite checks it too).
Target: tokens / pixels stage time <= 0.2 (the frozen encoder dominates the pixel path; the tokens are 125 KB of
float16 a sample to read).

    .venv/bin/python benchmarks/embed_tokens.py [--images 200] [--repeats 3] [--size 224]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_line, median, print_table, ratio_row, time_sides  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def make_images(folder: Path, n: int) -> None:
    """n JPEGs with captions: a random 8 x 6 colour field upsampled to 320 x 240, plus noise (seeded)."""
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        field = Image.fromarray(rng.integers(0, 255, (6, 8, 3), dtype=np.uint8)).resize((320, 240), Image.BICUBIC)
        img = np.clip(np.asarray(field, np.int16) + rng.integers(-12, 12, (240, 320, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(folder / f"{i:05d}.jpg", quality=90)
        (folder / f"{i:05d}.txt").write_text(f"a picture number {i}")


def features_checkpoint(path: Path, spec: dict) -> Path:
    """A random model reading `spec`'s tokens, in vltrain's checkpoint format."""
    import torch

    from vltrain.config import Config, ModelConfig, to_dict
    from vltrain.model import build_model

    torch.manual_seed(0)
    mc = ModelConfig(text_model="tiny", image_model="features", embed_dim=64, fusion_layers=0,
                     feature_dim=spec["dim"], feature_encoder=spec)
    config = to_dict(Config(model=mc))
    config["data"].update(max_len=12, input="features")
    torch.save({"model": build_model(mc).state_dict(), "config": config}, path)
    return path


def cli_embed(src: Path, out: Path, ckpt: Path) -> dict:
    """`vlprep embed` as a user runs it, in its own process; its report.json."""
    r = subprocess.run([sys.executable, "-m", "vlprep.cli", "embed", str(src), str(out), "--checkpoint", str(ckpt),
                        "--device", "cpu", "--batch-size", "64"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"vlprep embed failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    return json.loads((out / "report.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args()

    import pyarrow.parquet as pq

    from vlprep.features import FeaturesConfig, features
    from vlprep.shards import ShardsConfig, build_shards

    print(load_line("start"), flush=True)
    with tempfile.TemporaryDirectory(prefix="embed-tokens-") as tmp:
        tmp = Path(tmp)
        make_images(tmp / "src", args.images)
        build_shards(ShardsConfig(src=tmp / "src", out=tmp / "pix", samples_per_shard=50, workers=1))
        features(FeaturesConfig(src=tmp / "pix", out=tmp / "feat", size=args.size, device="cpu"))
        spec = json.loads((tmp / "feat" / "meta.json").read_text())["features"]
        ckpt = features_checkpoint(tmp / "ckpt.pt", spec)
        stage = {"pixels": [], "tokens": []}  # report.json's elapsed_s of each timed run
        reports = {}

        def side(name: str, src: Path):
            def run(out: Path) -> None:
                reports[name] = cli_embed(src, out / "emb", ckpt)
                stage[name].append(reports[name]["elapsed_s"])
            return run

        sides = {"pixels": side("pixels", tmp / "pix"), "tokens": side("tokens", tmp / "feat")}
        (tmp / "scratch").mkdir()
        times = time_sides(sides, args.repeats, tmp / "scratch")
        stage = {n: {"wall": v[-args.repeats:], "cpu": v[-args.repeats:]} for n, v in stage.items()}  # no warm-up
        for name, src in (("pixels", tmp / "pix"), ("tokens", tmp / "feat")):
            cli_embed(src, tmp / f"keep-{name}", ckpt)
        same = (np.array_equal(np.load(tmp / "keep-pixels" / "embeddings.npy"),
                               np.load(tmp / "keep-tokens" / "embeddings.npy"))
                and pq.read_table(tmp / "keep-pixels" / "keys.parquet").equals(
                    pq.read_table(tmp / "keep-tokens" / "keys.parquet")))
        print(f"  paths: pixels side {reports['pixels']['image_input']}, "
              f"tokens side {reports['tokens']['image_input']}")
        print(f"  embeddings.npy identical (np.array_equal, same keys): {same}")
        for name in ("pixels", "tokens"):
            wall, st = median(times[name]["wall"]), median(stage[name]["wall"])
            print(f"  {name}: median process {wall:.3f} s, stage {st:.3f} s ({args.images / st:.1f} images/s)")
        rows = [ratio_row(f"stage, {args.images} images", stage["pixels"], stage["tokens"], 0.2,
                          note="report.json elapsed_s; cpu column repeats it"),
                ratio_row(f"process, {args.images} images", times["pixels"], times["tokens"], None,
                          note="the CLI run, imports included")]
        print_table(rows, candidate="tokens")
    print(load_line("end"), flush=True)


if __name__ == "__main__":
    main()
