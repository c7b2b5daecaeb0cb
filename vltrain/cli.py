"""`vltrain` command line: `run` trains, `eval` scores a checkpoint; the work lives in vltrain.train."""

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from vlprep import VlprepError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train and evaluate vision-language alignment models on vlprep shards.")
console = Console(stderr=True, emoji=False)
out_console = Console(emoji=False)


@contextmanager
def user_errors():
    """A user mistake becomes one 'error:' line and exit status 2, inside the command so CliRunner sees it too."""
    from vltrain.config import ConfigError
    from vltrain.train import TrainError

    try:
        yield
    except (VlprepError, ConfigError, TrainError, ValueError, FileNotFoundError) as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _recall_table(title: str, rows: dict[str, dict]) -> Table:
    """One column per R@K key, one row per result dict (e.g. ITC, ITM re-rank, chance)."""
    keys = [k for k in next(iter(rows.values())) if k != "k"]
    table = Table(title=title)
    table.add_column("")
    for k in keys:
        table.add_column(k, justify="right")
    for name, r in rows.items():
        table.add_row(name, *(f"{r[k]:.2f}" if k in r else "" for k in keys))
    return table


@app.callback()
def _main() -> None:
    pass


@app.command()
def run(
    shards: list[Path] = typer.Argument(..., help="One or more shard dataset folders (mixed)."),
    preset: Optional[str] = typer.Option(None, help="clip, albef, albef-base, tonics, tonics-ir or grit "
                                         "\\[default: albef]; docs/TRAINING.md and docs/SAMPLERS.md."),
    config: Optional[Path] = typer.Option(None, "--config", help="YAML file of config keys."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="Dotted override key=value (repeatable), "
                                             "e.g. --set model.queue_size=1024."),
    out: Optional[str] = typer.Option(None, help="Run folder: metrics.jsonl, tb/, last.pt, best.pt."),
    steps: Optional[int] = typer.Option(None, help="Optimiser steps."),
    epochs: Optional[float] = typer.Option(None, help="Epochs over the training split (instead of --steps)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Pairs per step."),
    device: Optional[str] = typer.Option(None, help="auto (CUDA when present), cpu or cuda."),
    sampler: Optional[str] = typer.Option(None, help="random, tonics (needs `vlprep ontology` output as the first "
                                          "folder) or grit \\[default: the preset's]."),
    refresh_every: Optional[int] = typer.Option(None, "--refresh-every", help="TOnICS: steps between held-out "
                                                "checks that may refresh the curriculum \\[default: 500]."),
    resume: bool = typer.Option(False, "--resume", help="Continue exactly from OUT/last.pt."),
) -> None:
    """Train on the shards (ITC / ITM / MLM or the TOnICS aligner; random, TOnICS or GRIT batches), evaluating
    retrieval on the held-out split as it goes."""
    from vltrain.config import ConfigError, load_config
    from vltrain.train import train

    with user_errors():
        if steps is not None and epochs is not None:
            raise ConfigError("give --steps or --epochs, not both")
        cfg = load_config(preset, config, set_ or [], shards=[str(s) for s in shards], out=out, steps=steps,
                          epochs=epochs, batch_size=batch_size, device=device,
                          **{"sampler.kind": sampler, "sampler.refresh_every": refresh_every})
        result = train(cfg, resume=resume)
    ev = result["eval"]
    if ev is not None:
        out_console.print(_recall_table(f"held-out retrieval at step {result['step']} ({ev['n_val']} pairs)",
                                        {"model": {k: v for k, v in ev.items() if k in ev["chance"]},
                                         "chance": ev["chance"]}))
    else:
        console.print("no held-out samples: retrieval not evaluated (raise data.val_frac)")
    Path(result["out"], "result.json").write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {result['out']}/ (last.pt, metrics.jsonl, tb/, result.json)", highlight=False)


@app.command("eval")
def eval_(
    checkpoint: Path = typer.Argument(..., help="A checkpoint from `vltrain run` (last.pt or best.pt)."),
    shards: list[Path] = typer.Argument(..., help="Shard folders; every sample in them is evaluated."),
    zeroshot: Optional[Path] = typer.Option(None, help="classes.txt, one class name per line; a sample's label is "
                                            "the class named in its caption, samples naming none are skipped."),
    itm_rerank_k: int = typer.Option(0, "--itm-rerank-k", help="Re-rank each query's ITC top-k by ITM (0: off)."),
    out: Optional[Path] = typer.Option(None, help="Result JSON \\[default: CHECKPOINT's folder/eval.json]."),
    device: str = typer.Option("auto", help="auto (CUDA when present), cpu or cuda."),
) -> None:
    """Retrieval R@1/5/10 (optionally ITM re-ranked) and zero-shot accuracy of a checkpoint; a TOnICS aligner
    checkpoint is scored on noun-to-image retrieval over the triplets of the first folder (vlprep ontology output)."""
    from vltrain.train import evaluate_checkpoint

    with user_errors():
        result = evaluate_checkpoint(checkpoint, shards, zeroshot=zeroshot, itm_rerank_k=itm_rerank_k,
                                     device=device)
    rows = {"aligner" if "task" in result else "ITC": result["retrieval"]}
    if "itm_rerank" in result:
        rows[f"ITM re-rank top-{result['itm_rerank']['k']}"] = result["itm_rerank"]
    rows["chance"] = result["chance"]
    out_console.print(_recall_table(f"retrieval on {result['n_samples']} pairs", rows))
    if "zeroshot" in result:
        zs = result["zeroshot"]
        if "top1" in zs:
            out_console.print(f"zero-shot on {zs['samples']} samples ({zs['classes']} classes, {zs['skipped']} "
                              f"skipped): top-1 {zs['top1']:.2f}%, top-5 {zs['top5']:.2f}%", highlight=False)
        else:
            console.print(f"zero-shot: no caption names one of the {zs['classes']} classes; nothing to score")
    out = out or checkpoint.parent / "eval.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {out}", highlight=False)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted: OUT/last.pt holds the last checkpoint; add --resume to continue")
        sys.exit(130)


if __name__ == "__main__":
    main()
