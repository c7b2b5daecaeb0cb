"""`vltrain` command line: `run` trains, `eval` scores a checkpoint; the work lives in vltrain.train."""

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from vlprep import VlprepError
from vlprep.urls import redact_text
from vlprep.cliargs import check_dataset, is_url, refuse_urls, tidy_help, version_option, writing as remote_writing
from vltrain.config import Config


_DEFAULTS = Config()
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train and evaluate vision-language alignment models on vlprep shards.")
console = Console(stderr=True, emoji=False, soft_wrap=True)
out_console = Console(emoji=False)


@contextmanager
def user_errors():
    """A user mistake becomes one 'error:' line and exit status 2, inside the command so CliRunner sees it too.

    An interrupted run says where its checkpoint is and exits 128 + the signal (Ctrl-C 130, SIGTERM 143)."""
    from vltrain.errors import TrainError
    from vltrain.config import ConfigError
    from vltrain.resume import Interrupted

    from vltrain.distributed import report_error  # under torchrun: once per job, not once per process
    from vltrain.errors import PeerFailed

    try:
        yield
    except Interrupted as e:
        report_error(redact_text(str(e)), lambda line: console.print(line, highlight=False, markup=False,
                                                                      soft_wrap=True))
        raise typer.Exit(128 + e.signum) from None
    except (VlprepError, ConfigError, TrainError, ValueError, FileNotFoundError) as e:
        from vltrain.data.samples import loader_error  # a loader worker's error: its own line, not a traceback

        report_error(redact_text(str(loader_error(e))), lambda line: console.print(
            "error: " + line, style="bold red", highlight=False, markup=False, soft_wrap=True),
            peer=isinstance(e, PeerFailed))
        raise typer.Exit(2) from None


def writing(out: Path):
    """An OSError on OUT or a folder above it is one line (vlprep.cliargs.writing, as a TrainError)."""
    from vltrain.errors import TrainError

    return remote_writing(out, TrainError)


def writable_file(out: Path) -> None:
    """Before the work: the folder of the file OUT must exist (nothing is computed only to fail writing it)."""
    from vltrain.errors import TrainError

    if not out.parent.is_dir():
        raise TrainError(f"cannot write {out}: {out.parent} is not a folder")


def out_url(out: str | None) -> str | None:
    """`vltrain run --out`'s URL in its canonical form when the run lives in object storage (s3://, gs://); None for
    a local folder, and for file://, which vltrain.config refuses as before. Another scheme (http://: read-only), or
    credentials in the URL, is one line."""
    if out is None or not is_url(out):
        return None
    if out.lower().startswith("file:"):
        return None
    return check_dataset(out, "--out", out=True)


@contextmanager
def remote_run(url: str | None):
    """A run in object storage holds OUT's lock object (vlprep.outlock.lock_url; rank 0 under torchrun) from before
    its set-up until its result.json is up, also when it fails or is interrupted (Ctrl-C, SIGTERM: last.pt is up by
    then), so that a restart on another machine is not refused; its staging folder is removed at the end, unless an
    upload failed (after objstore's retries) with a checkpoint there, which the one-line error then names."""
    import shutil

    from vlprep.output import staging
    from vlprep.outlock import lock_url

    from vlprep import objstore
    from vltrain.errors import TrainError

    if url is None or int(os.environ.get("RANK", "0")) > 0:
        yield
        return
    lock = lock_url(url, "vltrain")
    keep = False
    try:
        yield
    except objstore.RemoteError as e:  # an upload that failed after its retries: the steps trained are not lost
        folder = staging(url)
        keep = (folder / "last.pt").exists()
        if not keep:
            raise
        raise TrainError(f"{e}; the run's files are kept in {folder}: copy them to OUT (aws s3 sync / gcloud storage "
                         "rsync) before running again with --resume, which starts from OUT's last.pt") from None
    finally:
        lock.release()
        if not keep:
            shutil.rmtree(staging(url), ignore_errors=True)


def upload_result(result: dict, url: str) -> None:
    """result.json of a run in object storage, written to a temporary file and put whole under OUT."""
    import tempfile

    from vlprep import objstore

    with tempfile.TemporaryDirectory(prefix="vltrain-result-") as tmp:
        path = Path(tmp, "result.json")
        path.write_text(json.dumps(result, indent=2) + "\n")
        objstore.put_file(path, objstore.join(url, "result.json"))


def config_file(path: Path | None) -> Path | None:
    """--config as given, or a ConfigError when it names something that is neither a file nor a folder (a FIFO, a
    device, a socket): reading one waits forever. vltrain.config_load.read_config_file says the rest."""
    from vltrain.config import ConfigError

    if path is not None and path.exists() and not path.is_file() and not path.is_dir():
        raise ConfigError(f"--config {path} is not a regular file (a FIFO, device or socket); give a YAML file")
    return path


def known_preset(preset: str | None) -> str | None:
    """--preset as given, or a ConfigError quoting at most 80 characters of an unknown one (vltrain.config's own
    check quotes it whole)."""
    from vlprep import cut
    from vltrain.config import PRESETS, ConfigError

    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"unknown preset {cut(repr(preset))}; presets: {', '.join(PRESETS)}")
    return preset


# Column order and headers of every retrieval table, as the papers print them: TR (text retrieval: an image finds
# its captions, image->text) R@1/5/10, then IR (image retrieval: a caption finds its image, text->image), then the mean.
COLUMNS = [("i2t_r1", "TR@1"), ("i2t_r5", "TR@5"), ("i2t_r10", "TR@10"),
           ("t2i_r1", "IR@1"), ("t2i_r5", "IR@5"), ("t2i_r10", "IR@10"), ("mean_recall", "mean")]


def preset_note(cfg: Config, cuda: bool) -> str | None:
    """What `vltrain run` without --preset trains, said before its first step: the default preset and its input; on
    a CPU with pixels, the cached-token path (`vlprep features`, then --preset clip) that trains in minutes. None
    when the folders mix inputs (the run's own check says so in one line)."""
    from vltrain.data.shards import feature_input

    try:
        features = feature_input(cfg.shards, cfg.data.input) is not None
    except (ValueError, VlprepError):
        return None
    line = (f"no --preset: training {cfg.preset} (the default) on "
            f"{'cached image tokens (vlprep features)' if features else 'pixels'}")
    if features or cuda:
        return line
    return (f"{line}, on a CPU: both encoders end to end, hours of training (docs/TRAINING.md, \"On a CPU\"). The "
            "fast CPU path caches the frozen image tower once and trains the rest: `vlprep features DATA DATA-feat`, "
            "then `vltrain run DATA-feat --preset clip`")


def _recall_table(title: str, rows: dict[str, dict]) -> Table:
    """R@1/5/10 image→text and text→image (and their mean), one row per result dict (ITC, ITM re-rank, chance)."""
    table = Table(title=title, caption="TR: text retrieval (an image finds one of its captions, image→text); "
                                       "IR: image retrieval (a caption finds its image, text→image)")
    table.add_column("")
    for _, header in COLUMNS:
        table.add_column(header, justify="right")
    for name, r in rows.items():
        table.add_row(name, *(f"{r[k]:.2f}" if k in r else "" for k, _ in COLUMNS))
    return table


@app.callback()
def _main(version: bool = version_option("vltrain")) -> None:
    pass


@app.command()
def run(
    shards: list[Path] = typer.Argument(..., help="One or more shard dataset folders (mixed)."),
    preset: Optional[str] = typer.Option(None, help="clip, fistful, albef, albef-base, grit, tonics, tonics-ir or "
                                         "softmask \\[default: albef]; docs/TRAINING.md and docs/SAMPLERS.md."),
    config: Optional[Path] = typer.Option(None, "--config", help="YAML file of config keys."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="Dotted override key=value (repeatable), "
                                             "e.g. --set model.queue_size=1024."),
    out: Optional[str] = typer.Option(None, help=f"Run folder \\[default: {_DEFAULTS.out}]: metrics.jsonl, "
                                      "learning_curve.png, tb/, last.pt, best.pt; or s3://, gs://: trained in a "
                                      "local staging folder and uploaded after every checkpoint."),
    steps: Optional[int] = typer.Option(None, help=f"Optimiser steps \\[default: {_DEFAULTS.steps}]."),
    epochs: Optional[float] = typer.Option(None, help="Epochs over the training split (instead of --steps)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Pairs per step "
                                             f"\\[default: {_DEFAULTS.batch_size}]."),
    device: Optional[str] = typer.Option(None, help="auto (CUDA when present), cpu, cuda or cuda:N "
                                         f"\\[default: {_DEFAULTS.device}]."),
    sampler: Optional[str] = typer.Option(None, help="random, tonics (needs `vlprep ontology` output as the first "
                                          "folder) or grit \\[default: the preset's]."),
    refresh_every: Optional[int] = typer.Option(None, "--refresh-every", help="TOnICS: steps between held-out "
                                                "checks that may refresh the curriculum \\[default: 500]."),
    resume: bool = typer.Option(False, "--resume", help="Continue exactly from OUT/last.pt."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start over in an OUT that holds another run "
                                   "(its checkpoints, metrics and tb/ are deleted)."),
    skip_bad_shards: bool = typer.Option(False, "--skip-bad-shards", help="Leave out (and count) a shard that is cut "
                                         "short or, at a URL, cannot be read after the retries, instead of stopping "
                                         "(data.skip_bad_shards)."),
    init_from: Optional[Path] = typer.Option(None, "--init-from", help="Start a new run from trained weights: a "
                                             "checkpoint (last.pt, best.pt), a `vltrain export` folder, or "
                                             "clip:PATH, a pretrained Hugging Face CLIPModel folder (its towers, "
                                             "projections and temperature; clip:hf-hub:ORG/NAME downloads one). "
                                             "Weights "
                                             "only: fresh optimiser, schedule and step 0; --preset and --set decide "
                                             "the architecture, tensors are matched by name (those the model adds "
                                             "start as built, the momentum copy as the loaded online weights; those "
                                             "it lacks are dropped; a shape mismatch stops the run), and the run "
                                             "prints the counts. With --resume: the start of a run that restarts "
                                             "from OUT/last.pt once it has one."),
) -> None:
    """Train on the shards (ITC / ITM / MLM or the TOnICS aligner; random, TOnICS or GRIT batches), evaluating
    retrieval on the held-out split as it goes.

    Shards made by `vlprep features` are read as cached image tokens (fast on a CPU); others as pixels. The run
    prints a summary, then an estimate of its duration after 10 steps. Ctrl-C saves OUT/last.pt; --resume goes on.
    --init-from fine-tunes another run's weights. `vltrain config --preset P` prints every config key."""
    from vltrain.config import ConfigError
    from vltrain.config_load import load_config
    from vltrain.train import train

    with user_errors():
        if steps is not None and epochs is not None:
            raise ConfigError("give --steps or --epochs, not both")
        url = out_url(out)  # a run in object storage (s3://, gs://) trains in a local staging folder
        cfg = load_config(known_preset(preset), config_file(config), set_ or [], shards=[str(s) for s in shards],
                          out=None if url else out, steps=steps, epochs=epochs, batch_size=batch_size, device=device,
                          **{"sampler.kind": sampler, "sampler.refresh_every": refresh_every,
                             "data.skip_bad_shards": skip_bad_shards or None})
        if resume and overwrite:
            raise ConfigError("give --resume or --overwrite, not both")
        if url is not None:
            from vltrain.init_from import check_out_apart

            cfg.out = url  # checked by out_url (vltrain.config's own check takes a local folder only)
            check_out_apart(url, cfg.shards, init_from, cfg.eval.zeroshot_folder)  # before the lock object is written there
        note = None
        if preset is None:
            from vltrain.session import train_device

            cuda = train_device(cfg.device).type == "cuda"  # a device this machine lacks: its one line, first
            note = preset_note(cfg, cuda)
        from vlprep.output import staging

        # a full or read-only disk under a URL OUT's staging folder is one line too
        with remote_run(url), writing(staging(url) if url else Path(cfg.out)):
            # the note is said once the run is set up: an error before then stays the only line
            result = train(cfg, resume=resume, overwrite=overwrite, init_from=init_from, note=note)
            if url is not None and result["rank"] == 0:
                result["out"] = url
                upload_result(result, url)
    if result["rank"] > 0:  # under torchrun rank 0 reports
        return
    ev = result["eval"]
    if ev is not None:
        size = (f"{ev['n_val']} pairs" if ev.get("n_captions", ev["n_val"]) == ev["n_val"]
                else f"{ev['n_val']} images, {ev['n_captions']} captions")
        if ev.get("skipped", {}).get("count"):
            size += f"; {ev['skipped']['count']} bad sample(s) skipped"
        out_console.print(_recall_table(f"held-out retrieval (%) at step {result['step']} ({size})",
                                        {"model": ev, "chance": ev["chance"]}))
    else:
        console.print("no held-out samples: retrieval not evaluated (raise data.val_frac)")
    if url is None:
        with user_errors(), writing(Path(result["out"])):
            Path(result["out"], "result.json").write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {result['out']}/ (last.pt, metrics.jsonl, learning_curve.png, tb/, result.json)",
                  highlight=False)


@app.command("config")
def config_(
    preset: Optional[str] = typer.Option(None, help="A preset \\[default: albef]."),
    config: Optional[Path] = typer.Option(None, "--config", help="YAML file of config keys."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="Dotted override key=value (repeatable)."),
) -> None:
    """Print the fully resolved config as YAML: every key `--set` and `--config` accept, with its value."""
    from vltrain.config import to_yaml
    from vltrain.config_load import load_config

    from vltrain.resolve import resolve_towers

    with user_errors():
        cfg = load_config(known_preset(preset), config_file(config), set_ or [])
        cfg, _ = resolve_towers(cfg)  # clip: towers: their sizes, preprocessing and record, as a run resolves them
    sys.stdout.write(to_yaml(cfg))


@app.command("eval")
def eval_(
    checkpoint: Path = typer.Argument(..., help="A checkpoint from `vltrain run` (last.pt or best.pt), or a "
                                      "`vltrain export` folder; or the s3://, gs:// or http(s):// URL of a checkpoint "
                                      "file (downloaded once to a private temporary file, removed after)."),
    shards: Optional[list[Path]] = typer.Argument(None, help="Shard folders: retrieval over every image and every "
                                                  "caption in them (several captions per image: docs/FORMAT.md)."),
    zeroshot_folder: Optional[Path] = typer.Option(None, "--zeroshot-folder", help="Zero-shot benchmark ROOT/CLASS/"
                                                   "*.jpg, with optional ROOT/classnames.txt and ROOT/templates.txt."),
    zeroshot: Optional[Path] = typer.Option(None, help="classes.txt, one class name per line: zero-shot on the images "
                                            "of SHARDS, labelled by the class their caption names (others skipped)."),
    templates: Optional[Path] = typer.Option(None, help="Prompt templates, one per line with {} for the class name "
                                             "\\[default: ROOT/templates.txt, else CLIP's 7 ImageNet templates]."),
    itm_rerank_k: int = typer.Option(0, "--itm-rerank-k", help="Re-rank each query's ITC top-k by ITM (0: off; "
                                     "ALBEF uses 256 on COCO, 128 on Flickr30K)."),
    out: Optional[Path] = typer.Option(None, help="Result JSON \\[default: eval.json in the checkpoint's folder, "
                                       "or in the export folder; beside a checkpoint at an s3:// or gs:// URL, "
                                       "uploaded there; an http(s):// one needs --out]."),
    device: str = typer.Option("auto", help="auto (CUDA when present), cpu or cuda."),
    skip_bad_shards: bool = typer.Option(False, "--skip-bad-shards", help="Leave out (and count, shards_skipped) a "
                                         "shard that is cut short or, at a URL, cannot be read after the retries."),
) -> None:
    """Retrieval R@1/5/10 both ways (optionally ITM re-ranked) and zero-shot top-1/top-5 of a checkpoint, scored
    as the papers do (docs/EVALUATION.md); a TOnICS aligner checkpoint is scored on noun-to-image retrieval over the
    triplets of the first folder (vlprep ontology output)."""
    from vltrain.evaluate import check_eval_args, evaluate_checkpoint
    from vltrain.fetchckpt import is_url, result_url, upload_result

    target = None  # a checkpoint at a URL: eval.json goes beside it, as for a local one (s3://, gs://)
    with user_errors():
        if is_url(checkpoint) and out is None:
            target = result_url(checkpoint, "eval.json", "--out")  # http(s):// cannot be written: one line
    if target is None:
        out = out or (checkpoint if checkpoint.is_dir() else checkpoint.parent) / "eval.json"  # an export: inside it
    with user_errors():
        if target is None:
            writable_file(out)
        from vltrain.init_from import result_apart

        check_eval_args(checkpoint, shards or [])  # swapped arguments first: OUT's default derives from CHECKPOINT
        if target is None:
            result_apart(out, checkpoint, [*(shards or []), *([zeroshot_folder] if zeroshot_folder else [])],
                         [zeroshot, templates])
        result = evaluate_checkpoint(checkpoint, shards or [], zeroshot=zeroshot, itm_rerank_k=itm_rerank_k,
                                     device=device, zeroshot_folder=zeroshot_folder, templates=templates,
                                     skip_bad_shards=skip_bad_shards)
    if "retrieval" in result:
        r = result["retrieval"]
        rows = {"aligner" if "task" in result else "ITC": r}
        if "itm_rerank" in result:
            rr = result["itm_rerank"]
            rows[f"ITM re-rank top-{rr['k']}"] = rr
            console.print(f"ITM re-rank: {rr['pairs']:,} pairs in {rr['seconds']:.1f} s "
                          f"({rr['seconds_per_1k_images']:.1f} s per 1K images)", highlight=False)
        rows["chance"] = result["chance"]
        size = (f"{r['n_images']:,} images, {r['n_captions']:,} captions" if "n_images" in r
                else f"{result['n_samples']} pairs")
        if result.get("skipped", {}).get("count"):
            size += f"; {result['skipped']['count']} bad sample(s) skipped"
        out_console.print(_recall_table(f"retrieval (%) on {size}", rows))
    if "zeroshot" in result:
        _print_zeroshot(result["zeroshot"])
    if target is not None:
        import tempfile

        with user_errors(), tempfile.TemporaryDirectory(prefix="vltrain-eval-") as tmp:
            Path(tmp, "eval.json").write_text(json.dumps(result, indent=2) + "\n")
            upload_result(Path(tmp, "eval.json"), target, "--out")
        console.print(f"wrote {redact_text(target)}", highlight=False)
        return
    with user_errors(), writing(out):
        out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {out}", highlight=False)


def _print_zeroshot(zs: dict) -> None:
    if zs.get("unreadable_folders"):  # a class folder that cannot be listed drops out, and chance changes with it
        bad = zs["unreadable_folders"]
        console.print(f"warning: {len(bad)} folder(s) of the zero-shot benchmark could not be read and were left out "
                      f"(scored over the {zs['classes']} classes found): {'; '.join(bad[:3])}"
                      f"{'; ...' if len(bad) > 3 else ''}", style="yellow", highlight=False, markup=False)
    if "top1" not in zs:
        console.print(f"zero-shot: no caption names one of the {zs['classes']} classes; nothing to score")
        return
    n = zs.get("images", zs.get("samples"))
    skipped = f", {zs['skipped']} skipped" if zs.get("skipped") else ""
    table = Table(title=f"zero-shot (%) on {n:,} images, {zs['classes']} classes, {len(zs['templates'])} "
                        f"templates{skipped}")
    for header in ("", "top-1", "top-5", "mean per class"):
        table.add_column(header, justify="right" if header else "left")
    for name, row in (("model", zs), ("chance", zs["chance"])):
        table.add_row(name, *(f"{row[k]:.2f}" for k in ("top1", "top5", "mean_per_class")))
    out_console.print(table)
    if zs["confusions"]:
        out_console.print("most confused (true → predicted: images): " + "; ".join(
            f"{c['true']} → {c['predicted']}: {c['count']}" for c in zs["confusions"]), highlight=False)


@app.command("benchmark")
def benchmark_(
    checkpoint: Path = typer.Argument(..., help="A checkpoint from `vltrain run` or a `vltrain export` folder; or "
                                      "the s3://, gs:// or http(s):// URL of a checkpoint file (downloaded once, "
                                      "removed after)."),
    dataset: str = typer.Option(..., help="A CLIP_benchmark dataset name: cifar10, imagenet1k, flickr30k, ..., or "
                                "wds/NAME for its WebDataset layout."),
    dataset_root: str = typer.Option(..., "--dataset-root", help="The dataset's folder (or URL, for wds/)."),
    task: str = typer.Option("auto", help="zeroshot_classification, zeroshot_retrieval, linear_probe (CUDA only), "
                             "or auto (CLIP_benchmark's choice for the dataset)."),
    split: str = typer.Option("test", help="The split to score."),
    output: Optional[Path] = typer.Option(None, help="Result JSON, CLIP_benchmark's format \\[default: "
                                          "benchmark_DATASET_TASK.json beside the checkpoint, or in the export; "
                                          "uploaded beside one at an s3:// or gs:// URL; an http(s):// one needs "
                                          "--output]."),
    batch_size: int = typer.Option(64, "--batch-size", help="Images per batch."),
    num_workers: int = typer.Option(4, "--num-workers", help="Data loader worker processes."),
    recall_k: list[int] = typer.Option([1, 5, 10], "--recall-k", help="Retrieval K (repeatable; at most the "
                                       "number of images)."),
) -> None:
    """Score a model with CLIP_benchmark's own evaluation code (zero-shot classification, retrieval, linear probe)
    on its datasets, for numbers comparable with published CLIP-like models (docs/EVALUATION.md)."""
    from vltrain.benchmark import run as run_benchmark

    with user_errors():
        if output is not None:
            writable_file(output)
            from vltrain.init_from import result_apart

            result_apart(output, checkpoint, [dataset_root] if "://" not in dataset_root else [])
        result = run_benchmark(checkpoint, dataset, dataset_root, task=task, out=output, split=split,
                               batch_size=batch_size, workers=num_workers, recall_k=recall_k)
    table = Table(title=f"CLIP_benchmark {result['task']} on {result['dataset']} (fractions)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result["metrics"].items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    out_console.print(table)


@app.command("gradcam")
def gradcam_(
    checkpoint: Path = typer.Argument(..., help="A checkpoint with a fusion encoder (albef, grit, softmask presets), "
                                      "or the s3://, gs:// or http(s):// URL of one (downloaded once, removed after)."),
    image: Path = typer.Argument(..., help="An image file."),
    caption: str = typer.Argument(..., help="Its caption (quoted)."),
    words: Optional[str] = typer.Option(None, help="Comma-separated caption words to map \\[default: the first 3]."),
    out: Path = typer.Option(Path("gradcam.png"), help="The PNG to write."),
    device: str = typer.Option("auto", help="auto (CUDA when present), cpu or cuda."),
) -> None:
    """Where each word looks: SoftMask++'s Grad-CAM over the fusion cross-attention and the soft mask it makes."""
    from vltrain.figures import gradcam_figure
    from vltrain.fetchckpt import local_checkpoint

    with user_errors(), writing(out):
        writable_file(out)
        wanted = [w.strip() for w in (words or "").split(",") if w.strip()]
        with local_checkpoint(checkpoint) as local:
            info = gradcam_figure(local, image, caption, wanted, out, device)
    console.print(f"ITM p(match) {info['p_match']:.3f}; words at token positions {info['words']}; wrote {out}",
                  highlight=False)


@app.command("export")
def export_(
    checkpoint: Path = typer.Argument(..., help="A checkpoint from `vltrain run` (last.pt or best.pt), or the s3://, "
                                      "gs:// or http(s):// URL of one (downloaded once with the result.json and "
                                      "eval.json beside it, removed after)."),
    out: Path = typer.Argument(..., help="The folder to write: model.safetensors, config.json, tokenizer/, "
                               "README.md."),
    onnx: bool = typer.Option(False, "--onnx", help="Also image_encoder.onnx and text_encoder.onnx (ITC embeddings; "
                              "needs the \\[onnx] extra)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an export of another checkpoint, or write "
                                   "into a non-empty OUT that is not an export (only the export's files are "
                                   "replaced). The export is written beside OUT and swapped in when complete."),
    fmt: str = typer.Option("vltrain", "--format", help="vltrain (the layout above); hf: a transformers CLIPModel "
                            "(VisionTextDualEncoderModel for CLIP towers of two sources) with its tokenizer and image "
                            "processor; open_clip: open_clip's `local-dir:` layout. hf and open_clip load without "
                            "vltrain, keep the fusion/ITM/MLM heads in vltrain_heads.safetensors, and need CLIP "
                            "towers (a run from --init-from clip:PATH or open_clip:...)."),
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", help="Then upload OUT to this Hugging Face model "
                                              "repository (ORG/NAME; created if missing), its README as the model "
                                              "card; needs a network and a login (huggingface-cli login or HF_TOKEN)."),
    private: bool = typer.Option(False, "--private", help="With --push-to-hub: create the repository private."),
) -> None:
    """A trained model as a folder to ship: the weights inference needs as safetensors (no optimiser, RNG, momentum
    copy or queues), config.json with preprocessing, provenance and eval numbers, the tokenizer and a README;
    `vltrain.load(OUT)`, `vltrain eval OUT` and the other commands read it without pickle (docs/TRAINING.md)."""
    from vltrain.export import export

    with user_errors(), writing(out):  # OUT below a file, read-only or on a full disk: one line
        info = export(checkpoint, out, onnx=onnx, overwrite=overwrite, fmt=fmt)
    for warning in info.get("warnings", []):
        console.print(f"warning: {warning}", style="yellow", highlight=False, markup=False)
    dropped = (f"; left out {len(info['dropped'])} training-only tensors (momentum copy, queues)"
               if info["dropped"] else "")
    console.print(f"wrote {out}/ ({', '.join(info['files'])}){dropped}", highlight=False)
    if push_to_hub:
        from vltrain.hub import push

        with user_errors():
            url = push(out, push_to_hub, fmt, private)
        console.print(f"uploaded {out}/ to {url}", highlight=False)


# SHARDS may be URLs (s3://, gs://, http(s)://; docs/SCALE.md), and so may the CHECKPOINT of eval, export, benchmark
# and gradcam (vltrain.fetchckpt); every other Path argument refuses one in one line, never the folder ./s3:/...
refuse_urls(app, {"run": ("shards",), "eval": ("shards", "checkpoint"), "export": ("checkpoint",),
                  "benchmark": ("checkpoint",), "gradcam": ("checkpoint",)})
tidy_help(app)


def exit_status(code) -> int:
    """sys.exit's argument as a process exit status: None is 0, a message is printed and 1 (as Python does)."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def main() -> None:
    try:
        app()  # click ends with SystemExit, success included
        status = 0
    except SystemExit as e:
        status = exit_status(e.code)
    except KeyboardInterrupt:  # a second Ctrl-C during a step, or one outside the loop
        console.print("interrupted: OUT/last.pt (if any) holds the last checkpoint; add --resume to continue")
        status = 130
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # A torchrun rank leaves without the interpreter's final clean-up. Its work is done and closed by now (the
        # loader's workers stopped, metrics, trackers and checkpoints closed, the process group left), but the
        # clean-up still destroys the process group's C++ objects in whatever order the last references go, and
        # with gloo that can end in std::terminate ("terminate called without an active exception", SIGABRT),
        # which torchrun reports as a failed job after a run that succeeded (seen on a rank leaving a resumed run).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    main()
