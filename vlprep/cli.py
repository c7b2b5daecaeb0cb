"""`vlprep` command line: one thin typer command per stage; validation and work live in the stage modules."""

import signal
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, SpinnerColumn,
                           TextColumn, TimeElapsedColumn, TimeRemainingColumn)
from rich.text import Text

from vlprep import VlprepError
from vlprep.urls import redact, redact_text
from vlprep.cliargs import refuse_urls, tidy_help, version_option, writing

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Prepare image-caption WebDataset shards for vision-language alignment.")
console = Console(stderr=True, emoji=False)


class RateColumn(ProgressColumn):
    def render(self, task) -> Text:
        return Text(f"{task.speed:,.0f}/s" if task.speed else "", style="progress.data.speed")


def progress_bar() -> Progress:
    """Items done / total, rate, elapsed and ETA; silent when stderr is not a terminal."""
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    RateColumn(), TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                    disable=not console.is_terminal)


def skip_bad_option():
    return typer.Option(False, "--skip-bad-shards", help="Leave out (and count) input shards whose tar does not hold "
                        "the samples its sidecar and sizes.json list, instead of stopping at the first one; costs a "
                        "scan of every tar's headers first.")


def distributor_option():
    return typer.Option("local", help="Where the shards are processed: local (this machine: a process pool, or this "
                        "process with --workers 1) or ray (needs the \\[ray] extra: Ray actors on RAY_ADDRESS or a "
                        "local Ray; docs/SCALE.md).")


def workers_option(default: str):
    return typer.Option(None, help=f"Workers (processes or Ray actors), each processing one shard at a time and "
                        f"loading any model once \\[default: {default}].")


def engine(cfg, workers: int | None, distributor: str):
    """Set the engine options on a stage config; they never enter the recorded options (outputs do not depend on them)."""
    if workers is not None:
        cfg.workers = workers
    cfg.distributor = distributor
    return cfg


def run_stage(cfg, workers: int | None, distributor: str, stage, printer, out: Path, wrote: str = "",
              empty: str = "", report_console: Console | None = None, early_warnings: bool = False,
              encoder=None) -> dict:
    """What every stage command does once its config is built: the engine options, the stage under a progress bar
    (with the encoder, for embed and pseudolabel), its report table, its warnings (each once, whether the stage
    said it early through `warn` or only in the report), a warning when nothing was written, and "wrote OUT/"."""
    engine(cfg, workers, distributor)
    said = []

    def warn(line: str) -> None:
        said.append(line)
        console.print("warning: " + redact_text(line), style="yellow", highlight=False, markup=False)

    args = (cfg,) if encoder is None else (cfg, encoder)
    try:
        with writing(out), progress_bar() as progress:
            report = stage(*args, progress=progress, **({"warn": warn} if early_warnings else {}))
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM through the engine's `Stopped`; typer would print nothing
        console.print("interrupted: completed shards are kept; run the same command again to resume",
                      highlight=False)
        raise typer.Exit(128 + getattr(e, "signum", signal.SIGINT)) from None
    printer(report, report_console or console)
    warn_report(report)
    for line in report.get("warnings", []):
        if line not in said:
            warn(line)
    if empty and report.get("written") == 0:
        console.print(f"[yellow]warning:[/] {empty}")
    console.print(f"wrote {redact(str(out)).rstrip('/')}/" + (f" ({wrote})" if wrote else ""), highlight=False)
    return report


def checkpoint_encoder(checkpoint: Path, device: str):
    """The one place vlprep brings in vltrain: a checkpoint's encoders as the object embed and pseudolabel take."""
    from vltrain.checkpoint_encoder import CheckpointEncoder

    return CheckpointEncoder(checkpoint, device)


def warn_report(report: dict) -> None:
    """The report's data warnings as one yellow line each: bad shards left out, duplicate uids."""
    for shard, why in report.get("bad_shards", {}).items():
        console.print(f"warning: left out bad shard {shard}: {why}", style="yellow", highlight=False, markup=False)
    if report.get("duplicate_uids"):
        console.print(f"warning: {report['duplicate_uids']:,} written samples repeat an earlier uid (e.g. "
                      f"{', '.join(map(str, report['duplicate_uid_examples'][:3]))}); they are kept, and the report "
                      "counts them", style="yellow", highlight=False, markup=False)


@app.callback()
def _main(version: bool = version_option("vlprep")) -> None:
    pass


@app.command()
def shards(
    src: Path = typer.Argument(..., help="A table (.parquet/.csv/.tsv, or JSON Lines .jsonl/.json), a Karpathy "
                               "split file (dataset_coco.json, dataset_flickr30k.json: one sample per image with all "
                               "its captions), a folder of images with same-named .txt captions, or a "
                               "WebDataset/img2dataset folder or .tar to re-shard."),
    out: Path = typer.Argument(..., help="Output dataset folder (created; an earlier run there is resumed)."),
    samples_per_shard: int = typer.Option(1000, "--samples-per-shard", "-n", help="Source records per shard."),
    resize: Optional[int] = typer.Option(None, help="Shorter side to N pixels, aspect kept, never upscaled. "
                                         "Default: original bytes pass through untouched."),
    format: Optional[str] = typer.Option(None, "--format", help="Re-encode format: jpg, png or webp. Default: keep "
                                         "the source format (other formats become png)."),
    quality: int = typer.Option(95, help="JPEG/WebP quality when re-encoding."),
    workers: Optional[int] = workers_option("CPU count, at most 4"),
    distributor: str = distributor_option(),
    prefix: str = typer.Option("shard", help="Shard name prefix: PREFIX-000000.tar; keys are PREFIX_000000000."),
    image_col: Optional[str] = typer.Option(None, help="Table column with image paths or bytes (auto-detected)."),
    caption_col: Optional[str] = typer.Option(None, help="Table column with captions (auto-detected)."),
    uid_col: Optional[str] = typer.Option(None, help="Table column with a source id, kept as json.uid (optional)."),
    image_root: Optional[Path] = typer.Option(None, help="Karpathy split file: the folder its images' filepath/"
                                              "filename are relative to \\[default: the JSON file's folder]."),
    split: Optional[List[str]] = typer.Option(None, "--split", metavar="<split>", help="Karpathy split file: keep "
                                              "the images of this split (train, restval, val, test); repeat or "
                                              "comma-separate for several \\[default: all]."),
    follow_symlinks: bool = typer.Option(False, "--follow-symlinks", help="Karpathy split file: also read images "
                                         "through symlinks that lead out of the image root (refused by default)."),
    decode_check: bool = typer.Option(False, help="Fully decode pass-through images to catch corrupt data "
                                      "(slower; the default checks headers and end markers)."),
    overwrite: bool = typer.Option(False, help="Replace the vlprep files in a non-empty OUT written otherwise."),
) -> None:
    """Build WebDataset shards (+ sizes.json, index.json, meta.json, Parquet sidecars, report.json) from SRC."""
    from vlprep.report import print_shards_report
    from vlprep.shards import ShardsConfig, build_shards

    cfg = ShardsConfig(src=src, out=out, samples_per_shard=samples_per_shard, resize=resize, format=format,
                       quality=quality, prefix=prefix, image_col=image_col, caption_col=caption_col,
                       uid_col=uid_col, image_root=image_root, split=list(split) if split else None,
                       follow_symlinks=follow_symlinks, decode_check=decode_check, overwrite=overwrite)
    run_stage(cfg, workers, distributor, build_shards, print_shards_report, out, "report.json has the skip counts",
              empty="no sample was written; the skip reasons above say why")


@app.command()
def bow(
    src: Path = typer.Argument(..., help="Input shard dataset (from `vlprep shards` or any vlprep stage)."),
    out: Path = typer.Argument(..., help="Output dataset folder (an earlier run there with the same options resumes)."),
    ops: str = typer.Option("shuffle,rmstop,basevocab,rmtop:1000,keep:4", help="Comma-separated cascade: shuffle, "
                            "rmstop, basevocab, rmtop:T, keep:N (keep always runs last)."),
    base_frac: float = typer.Option(0.1, help="Fraction of samples kept intact as the base set (chosen by key hash)."),
    seed: int = typer.Option(0, help="Seed of the base split and of shuffle."),
    deform_base: bool = typer.Option(False, "--deform-base", help="Deform the base captions too."),
    workers: Optional[int] = workers_option("CPU count, at most 4"),
    distributor: str = distributor_option(),
    skip_bad_shards: bool = skip_bad_option(),
    overwrite: bool = typer.Option(False, help="Replace the vlprep files in a non-empty OUT written otherwise."),
) -> None:
    """Deform captions into bags of words (A Fistful of Words, sec. 2.2); images are copied untouched."""
    from vlprep.bow import BowConfig, bow as run_bow
    from vlprep.report import print_bow_report

    cfg = BowConfig(src=src, out=out, ops=ops, base_frac=base_frac, seed=seed, deform_base=deform_base,
                    overwrite=overwrite, skip_bad_shards=skip_bad_shards)
    run_stage(cfg, workers, distributor, run_bow, print_bow_report, out, "report.json has every figure",
              early_warnings=True)


@app.command("filter")
def filter_(
    src: Path = typer.Argument(..., help="Input shard dataset (from `vlprep shards` or any vlprep stage)."),
    out: Path = typer.Argument(..., help="Output dataset folder: the kept samples, unchanged, plus report.json and "
                                "dropped.parquet (an earlier run there with the same rules resumes)."),
    keys: Optional[Path] = typer.Option(None, help="Rule 1: keep only the keys listed in this file (one per line)."),
    drop_keys: Optional[Path] = typer.Option(None, help="Rule 2: drop the keys listed in this file (one per line)."),
    min_side: Optional[int] = typer.Option(None, help="Rule 4: drop images whose short side is below PX pixels.",
                                           metavar="PX"),
    max_aspect: Optional[float] = typer.Option(None, help="Rule 5: drop images whose long side / short side is "
                                               "above R (R >= 1).", metavar="R"),
    max_pixels: Optional[int] = typer.Option(None, help="Rule 6: drop images of more than N pixels (width x "
                                             "height, read from the header).", metavar="N"),
    caption_words: Optional[str] = typer.Option(None, help="Rule 7: keep captions of MIN to MAX words (as vlprep "
                                                "tokenises them; 3: or :40 leave one side open).",
                                                metavar="MIN:MAX"),
    dedup: Optional[List[str]] = typer.Option(None, help="Rules 8-10: drop exact duplicates of an earlier sample: "
                                              "image (decoded pixels), caption (normalised text), pair (both); "
                                              "repeat or comma-separate. The first in dataset order is kept.",
                                              metavar="KIND"),
    phash: Optional[int] = typer.Option(None, help="Rule 11: drop a sample whose image's 64-bit perceptual hash "
                                        "is within Hamming distance D (0-32) of an EARLIER KEPT sample's (resized "
                                        "or re-encoded copies; no model needed).", metavar="D"),
    near_dup: Optional[float] = typer.Option(None, help="Rule 12: drop a sample whose image is within cosine T "
                                             "(0 < T <= 1) of an EARLIER KEPT sample's (greedy, in dataset order; "
                                             "FAISS range search); needs --embeddings or --checkpoint.",
                                             metavar="T"),
    embeddings: Optional[Path] = typer.Option(None, help="A `vlprep embed` output over SRC's images (for rules "
                                              "12-14).", metavar="EMB"),
    text_embeddings: Optional[Path] = typer.Option(None, help="A `vlprep embed --modality text` output over SRC "
                                                   "(rule 14 with --embeddings).", metavar="EMB"),
    checkpoint: Optional[Path] = typer.Option(None, help="Embed with this vltrain checkpoint instead (the vectors "
                                              "are kept under OUT/_embed/, so a re-run encodes nothing again).",
                                              metavar="CKPT"),
    device: str = typer.Option("auto", help="--checkpoint's device: auto (CUDA when present), cpu, cuda."),
    exclude: Optional[List[Path]] = typer.Option(None, help="Rule 13: drop samples whose image has the same pixels "
                                                 "as (or with --phash / --near-dup, is within D / T of) an image of "
                                                 "this eval dataset; repeatable.", metavar="DATASET"),
    exclude_embeddings: Optional[List[Path]] = typer.Option(None, help="With --near-dup and --embeddings: each "
                                                            "--exclude set's `vlprep embed` output (same checkpoint, "
                                                            "same order), instead of --checkpoint.", metavar="EMB"),
    clip_score_min: Optional[float] = typer.Option(None, help="Rule 14: drop pairs whose image-caption cosine "
                                                   "(clip score) is below S; OUT's sidecars get `clip_score`.",
                                                   metavar="S"),
    clip_score_top: Optional[float] = typer.Option(None, help="Rule 14: keep the top F (0 < F <= 1) of the samples "
                                                   "still kept, by clip score (ties: dataset order).", metavar="F"),
    workers: Optional[int] = workers_option("CPU count, at most 4"),
    distributor: str = distributor_option(),
    skip_bad_shards: bool = skip_bad_option(),
    overwrite: bool = typer.Option(False, help="Replace the vlprep files in a non-empty OUT written otherwise."),
) -> None:
    """Keep the samples that pass every rule, copied unchanged. Rules run in a fixed order (1 keys, 2 drop-keys,
    3 bad images (always), 4-6 image size, 7 caption words, 8-10 dedup image, caption, pair, 11 phash,
    12 near-dup, 13 exclude, 14 clip score); each dropped sample is charged to the first rule that drops it
    (docs/FILTER.md)."""
    from vlprep.filter import FilterConfig, filter_dataset
    from vlprep.filterreport import print_filter_report

    cfg = FilterConfig(src=src, out=out, keys=keys, drop_keys=drop_keys, min_side=min_side, max_aspect=max_aspect,
                       max_pixels=max_pixels, caption_words=caption_words, dedup=list(dedup or []),
                       phash=phash, near_dup=near_dup, embeddings=embeddings, text_embeddings=text_embeddings,
                       exclude=list(exclude or []), exclude_embeddings=list(exclude_embeddings or []),
                       clip_score_min=clip_score_min, clip_score_top=clip_score_top,
                       overwrite=overwrite, skip_bad_shards=skip_bad_shards)
    run_stage(cfg, workers, distributor, filter_dataset, print_filter_report, out,
              "report.json and dropped.parquet say what was dropped", empty="every sample was dropped",
              early_warnings=True, encoder=checkpoint_encoder(checkpoint, device) if checkpoint is not None else None)


@app.command()
def detect(
    src: Path = typer.Argument(..., help="Input shard dataset."),
    out: Path = typer.Argument(..., help="Output dataset folder: the same samples with json.objects added."),
    backend: str = typer.Option("ssd", help="ssd (SSD-MobileNet-v2 COCO via OpenCV, packaged) or torchvision:ARCH "
                                "(e.g. torchvision:fasterrcnn_resnet50_fpn, needs --weights)."),
    weights: Optional[Path] = typer.Option(None, help="Local state dict for a torchvision backend."),
    from_file: Optional[Path] = typer.Option(None, "--from-file", help="Import detections from a JSONL file of "
                                             '{"key": ..., "objects": [{"label", "score", "box"}]} instead.'),
    min_score: float = typer.Option(0.3, help="Keep detections with at least this score."),
    batch_size: int = typer.Option(8, help="Images per detector call."),
    device: str = typer.Option("auto", help="torchvision backend: auto (CUDA when present), cpu, cuda."),
    workers: Optional[int] = workers_option("1"),
    distributor: str = distributor_option(),
    skip_bad_shards: bool = skip_bad_option(),
    overwrite: bool = typer.Option(False, help="Replace the vlprep files in a non-empty OUT written otherwise."),
) -> None:
    """Detect objects in every image (boxes normalised to [0, 1]); images are copied untouched."""
    from vlprep.detect import DetectConfig, detect as run_detect
    from vlprep.report import print_detect_report

    cfg = DetectConfig(src=src, out=out, backend=backend, weights=weights, from_file=from_file, min_score=min_score,
                       batch_size=batch_size, device=device, overwrite=overwrite,
                       skip_bad_shards=skip_bad_shards)
    run_stage(cfg, workers, distributor, run_detect, print_detect_report, out)


@app.command()
def features(
    src: Path = typer.Argument(..., help="Input shard dataset."),
    out: Path = typer.Argument(..., help="Output dataset: the same samples (members copied byte for byte) plus "
                               "KEY.npy, the encoder's (N, D) token grid; `vltrain run OUT` then trains on tokens."),
    image_model: str = typer.Option("efficientnet-lite0", help="efficientnet-lite0 (packaged ImageNet weights, "
                                    "1280 x 7 x 7 at 224), torchvision:ARCH (a CNN or ViT, e.g. torchvision:resnet50, "
                                    "torchvision:vit_b_16) or timm:NAME (with the [timm] extra); those need --weights."),
    weights: Optional[Path] = typer.Option(None, help="torchvision:ARCH / timm:NAME: a local state dict file, saved "
                                           "with torch.save(model.state_dict(), FILE); nothing is downloaded."),
    size: Optional[int] = typer.Option(None, help="Resize the shorter side to N and centre-crop N x N (vltrain's "
                                       "eval view); about N/32 x N/32 tokens (7 x 7 at 224); 32 to 1024 (the encoders "
                                       "downsample by 32; 1024 gives 32 x 32 tokens) \\[default: 224]."),
    dtype: str = typer.Option("float16", help="npy dtype: float16 (half the disk) or float32."),
    batch_size: Optional[int] = typer.Option(None, help="Images per encoder call, a fixed shape (the last call of a "
                                             "shard is padded): part of the result, like --dtype \\[default: 4 on "
                                             "a CPU, 64 on CUDA]."),
    decode_threads: Optional[int] = typer.Option(None, help="Threads per worker decoding and resizing images for "
                                                 "the encoder; 0 = in the worker's main thread \\[default: CPU count, "
                                                 "at most 2]."),
    workers: Optional[int] = workers_option("1"),
    distributor: str = distributor_option(),
    device: str = typer.Option("auto", help="auto (CUDA when present), cpu, cuda."),
    precision: str = typer.Option("auto", help="auto (bf16 autocast on a CUDA card with native bf16, else float32), "
                                  "fp32 (float32, TF32 off: a GPU's tokens equal a CPU's within float16 storage "
                                  "rounding) or bf16 (CUDA only); recorded in meta.json."),
    skip_bad_shards: bool = skip_bad_option(),
    overwrite: bool = typer.Option(False, help="Replace the vlprep files in a non-empty OUT written otherwise."),
) -> None:
    """Cache a frozen image encoder's tokens as an npy member of every sample (fast training on a CPU)."""
    from vlprep import cut
    from vlprep.features import DTYPES, FeaturesConfig, features as run_features
    from vlprep.report import print_features_report

    if dtype not in DTYPES:  # vlprep.features says the same, quoting the whole value
        raise VlprepError(f"--dtype must be float16 or float32, got {cut(repr(dtype))}")
    cfg = FeaturesConfig(src=src, out=out, image_model=image_model, weights=weights, size=size, dtype=dtype,
                         batch_size=batch_size, device=device, precision=precision, overwrite=overwrite,
                         skip_bad_shards=skip_bad_shards)
    if decode_threads is not None:
        cfg.decode_threads = decode_threads
    run_stage(cfg, workers, distributor, run_features, print_features_report, out, "report.json has every figure",
              empty="no sample was written; the skip reasons above say why")


@app.command()
def ontology(
    src: Path = typer.Argument(..., help="A dataset with detections (the output of `vlprep detect`)."),
    out: Path = typer.Argument(..., help="Output folder: ontology.json, triplets.parquet, annotated shards, report."),
    min_instances: Optional[int] = typer.Option(None, help="Drop classes with fewer triplets (default: "
                                                "max(5, ceil(T x 5000 / 5.8M)) for T triplets, the paper's ratio)."),
    min_cooccur: int = typer.Option(5, help="Noun-class pairs must co-occur this often to be mapped."),
    min_cooccur_rate: float = typer.Option(0.0, help="Also at least ceil(RATE x pairs with objects) times, so the "
                                           "mapping does not grow with the dataset (docs/ONTOLOGY.md)."),
    min_score: float = typer.Option(0.3, help="Object labels count when their score is at least this."),
    overrides: Optional[Path] = typer.Option(None, help="YAML of noun: class (force) or noun: null (exclude)."),
    triplets: str = typer.Option("all", help="all: one triplet per mapped noun of the caption (TOnICS appendix "
                                 "A.1); detected: only when the detector found the noun's class in the image."),
    workers: Optional[int] = workers_option("1"),
    distributor: str = distributor_option(),
    skip_bad_shards: bool = skip_bad_option(),
    overwrite: bool = typer.Option(False, help="Replace the vlprep files in a non-empty OUT written otherwise."),
) -> None:
    """Build the TOnICS noun-object PMI ontology and its triplets (sample, noun span, class)."""
    from vlprep.ontology import OntologyConfig, ontology as run_ontology
    from vlprep.report import print_ontology_report

    cfg = OntologyConfig(src=src, out=out, min_instances=min_instances, min_cooccur=min_cooccur, min_score=min_score,
                         overrides=overrides, triplets=triplets, overwrite=overwrite,
                         skip_bad_shards=skip_bad_shards, min_cooccur_rate=min_cooccur_rate)
    run_stage(cfg, workers, distributor, run_ontology, print_ontology_report, out,
              "ontology.json, triplets.parquet, report.json, pmi_heatmap.png", report_console=Console(emoji=False))


@app.command()
def embed(
    dataset: Path = typer.Argument(..., help="A shard dataset folder."),
    out: Path = typer.Argument(..., help="Output folder: embeddings.npy (N, E) float32, keys.parquet (row i -> key), "
                               "meta.json, report.json."),
    checkpoint: Path = typer.Option(..., help="A vltrain checkpoint (last.pt / best.pt); its config rebuilds the "
                                    "model, image size and caption length."),
    modality: str = typer.Option("image", help="image (centre crop, like vltrain eval) or text (the intact "
                                 "caption: caption_raw after bow)."),
    deformed: bool = typer.Option(False, "--deformed", help="text: embed the stored caption even when "
                                  "caption_raw is there."),
    batch_size: int = typer.Option(64, help="Images or captions per encoder call."),
    device: str = typer.Option("auto", help="auto (CUDA when present), cpu, cuda."),
    workers: Optional[int] = workers_option("1"),
    distributor: str = distributor_option(),
    skip_bad_shards: bool = skip_bad_option(),
    overwrite: bool = typer.Option(False, help="Replace the files of an earlier run in OUT written otherwise."),
) -> None:
    """L2-normalised ITC embeddings of every image or caption of DATASET, keyed by sample key."""
    from vlprep.embed import EmbedConfig, embed as run_embed
    from vlprep.report import print_embed_report

    cfg = EmbedConfig(src=dataset, out=out, modality=modality, batch_size=batch_size, deformed=deformed,
                      gpu=device == "cuda", overwrite=overwrite, skip_bad_shards=skip_bad_shards)
    run_stage(cfg, workers, distributor, run_embed, print_embed_report, out,
              encoder=checkpoint_encoder(checkpoint, device))


@app.command()
def pseudolabel(
    aligned: Path = typer.Argument(..., help="Captioned shard dataset whose intact captions are retrieved "
                                   "(json caption_raw when it went through bow)."),
    unaligned: Path = typer.Argument(..., help="Shard dataset of the images to pseudo-caption (captions ignored)."),
    out: Path = typer.Argument(..., help="Output dataset: UNALIGNED's images with pseudo-BoW captions, plus the "
                               "saved caption index, report.json and PNGs."),
    checkpoint: Path = typer.Option(..., help="The aligned model: a vltrain checkpoint (last.pt / best.pt)."),
    strategy: str = typer.Option("weighted", help="Word ranking: maxcount, rmtopmaxcount, rmtoprand or weighted "
                                 "(count in NN / count in ALIGNED; best in the paper's Table 7)."),
    k: int = typer.Option(10, "--k", help="Captions retrieved per crop."),
    crops: int = typer.Option(5, help="Random-resized crops per image (seeded per key)."),
    words: int = typer.Option(4, help="Words per pseudo-caption (p); images with none are dropped."),
    rmtop: int = typer.Option(1000, help="rmtop* strategies: drop the T most frequent ALIGNED words first."),
    index: str = typer.Option("auto", help="Caption index: flat (exact), ivf, or auto (flat below 100,000 "
                              "captions, ivf above)."),
    nprobe: Optional[int] = typer.Option(None, help="IVF lists searched per query \\[default: 32]."),
    seed: int = typer.Option(0, help="Seed of the crops and of rmtoprand."),
    batch_size: int = typer.Option(16, help="Images per encoder call (each brings --crops crops)."),
    device: str = typer.Option("auto", help="auto (CUDA when present; the index goes to GPU with faiss-gpu), "
                               "cpu, cuda."),
    workers: Optional[int] = workers_option("1"),
    distributor: str = distributor_option(),
    skip_bad_shards: bool = skip_bad_option(),
    overwrite: bool = typer.Option(False, help="Replace the vlprep files in a non-empty OUT written otherwise."),
) -> None:
    """Pseudo bag-of-words captions for uncaptioned images by kNN over ALIGNED's captions (Fistful of Words 2.3)."""
    from vlprep.pseudolabel import PseudolabelConfig, pseudolabel as run_pseudolabel
    from vlprep.report import print_pseudolabel_report

    cfg = PseudolabelConfig(aligned=aligned, unaligned=unaligned, out=out, strategy=strategy, k=k, crops=crops,
                            words=words, rmtop=rmtop, index=index, nprobe=nprobe, seed=seed, batch_size=batch_size,
                            device=device, overwrite=overwrite, skip_bad_shards=skip_bad_shards)
    run_stage(cfg, workers, distributor, run_pseudolabel, print_pseudolabel_report, out,
              "report.json has every figure", empty="no image got a pseudo-caption; the counts above say why",
              report_console=Console(emoji=False), encoder=checkpoint_encoder(checkpoint, device))


@app.command()
def stats(
    dataset: Path = typer.Argument(..., help="A shard dataset folder (with sizes.json)."),
    out: Optional[Path] = typer.Option(None, help="Where to write report.json and stats.png \\[default: DATASET/stats]."),
    top: int = typer.Option(20, help="How many top words to list."),
) -> None:
    """Sample count, caption lengths, vocabulary, top words and image sizes of a dataset."""
    from vlprep.stats import dataset_stats, print_stats

    if out is None and not isinstance(dataset, Path):
        raise VlprepError(f"DATASET {dataset} is a URL: give --out, a local folder for report.json and stats.png")
    status = console.status("reading sidecars") if console.is_terminal else nullcontext()
    with writing(out or dataset / "stats"), status:
        report = dataset_stats(dataset, out=out, top=top)
    print_stats(report, Console(emoji=False))
    console.print(f"wrote {', '.join(report['outputs'])}")


@app.command()
def view(
    dataset: Path = typer.Argument(..., help="A shard dataset folder or URL (s3://, gs://, http(s)://)."),
    out: Optional[Path] = typer.Option(None, help="Where to write index.html and thumbs/ \\[default: DATASET/view]."),
    samples: int = typer.Option(200, help="Samples to show, drawn across the shards in proportion to their sizes."),
    seed: int = typer.Option(0, help="Seed of the draw (the same seed shows the same samples)."),
    serve: bool = typer.Option(False, "--serve", help="Serve the page on 127.0.0.1 until Ctrl-C."),
    port: int = typer.Option(8000, help="The port for --serve (0: any free port)."),
    input_: Optional[Path] = typer.Option(None, "--input", help="A filter output's input dataset: its dropped "
                                          "samples' images and captions (never read from where meta.json says)."),
    aligned: Optional[Path] = typer.Option(None, help="A pseudolabel output's aligned dataset: its neighbours' "
                                           "captions (never read from where meta.json says)."),
) -> None:
    """A static HTML page of a sample of a dataset: thumbnails, captions and what each stage added (docs/VIEW.md)."""
    from vlprep.dataset import MAX_JSON_DEPTH
    from vlprep.view import ViewConfig, build_view, make_server

    cfg = ViewConfig(dataset=dataset, out=out, samples=samples, seed=seed, port=port if serve else None,
                     input=input_, aligned=aligned)
    with writing(out or Path(str(dataset)) / "view"):
        report = build_view(cfg)
    warnings = []
    if report["no_image"]:
        warnings.append(f"{report['no_image']:,} of the drawn samples have no image that decodes; their cards show "
                        "none")
    if report["bad_json"]:
        warnings.append(f"{report['bad_json']:,} of the drawn samples' json member is not a JSON object nested at "
                        f"most {MAX_JSON_DEPTH} deep; their cards show none of its fields")
    if report["not_read"]:
        warnings.append(f"files of the dataset left out: {', '.join(report['not_read'])}")
    for line in warnings:
        console.print(f"warning: {line}", style="yellow", highlight=False, markup=False, soft_wrap=True)
    for line in report["notes"]:
        console.print(f"note: {line}", highlight=False, markup=False, soft_wrap=True)
    console.print(f"wrote {report['out']}/index.html ({report['samples']:,} of {report['total']:,} samples)",
                  highlight=False, markup=False, soft_wrap=True)
    if serve:
        server = make_server(Path(report["out"]), port)
        print(f"serving http://127.0.0.1:{server.server_address[1]}/index.html (Ctrl-C stops)", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()


# Dataset folders may be URLs (s3://, gs://, http(s)://; OUT s3:// or gs://, docs/SCALE.md); every other Path argument
# refuses one in one line, never the folder ./s3:/...
refuse_urls(app, {"shards": ("out",), "bow": ("src", "out"), "detect": ("src", "out"), "features": ("src", "out"),
                  "ontology": ("src", "out"), "embed": ("dataset", "out"), "pseudolabel": ("aligned", "unaligned", "out"),
                  "stats": ("dataset",), "filter": ("src", "out", "exclude"),
                  "view": ("dataset", "input_", "aligned")})
tidy_help(app)


def main() -> None:
    try:
        app()
    except VlprepError as e:
        # escaped: a message may hold brackets (".[ray]", a path) that rich would take for markup and drop
        console.print(f"[bold red]error:[/] {escape(redact_text(str(e)))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        console.print("interrupted: completed shards are kept; run the same command again to resume")
        sys.exit(130)


if __name__ == "__main__":
    main()
