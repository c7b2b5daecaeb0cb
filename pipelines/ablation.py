"""Run the arms of an ablation recipe (YAML) with `vltrain` over seeds and print their held-out retrieval.

    .venv/bin/python pipelines/ablation.py pipelines/samplers.yaml [--steps N] [--seeds 0,1,2] [--data DIR]
                                                                  [--out DIR] [--arms a,b]

A recipe has `data` (shard folders, one or a list), `out`, `seeds` (default [0]), `common` (preset, steps,
batch_size, sampler and a `set` mapping of dotted config keys) and `arms` (name -> the same keys, overriding
`common`). Every arm trains once per seed into OUT/NAME/sSEED with the same held-out split; a run whose
result.json already reached its step count is reused, an interrupted one resumes. The table (R@1/5/10 both ways,
mean ± standard deviation over the seeds) is printed and written to OUT/results.json and OUT/results.md.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from vltrain.config import ConfigError, load_config
from vltrain import TrainError
from vltrain.train import Interrupted, train

console = Console(stderr=True, emoji=False)
COLS = ["i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "mean_recall"]
HEADERS = ["i→t R@1", "i→t R@5", "i→t R@10", "t→i R@1", "t→i R@5", "t→i R@10", "mean"]


def arm_config(recipe: dict, name: str, seed: int, args) -> tuple:
    common, arm = recipe.get("common", {}), recipe["arms"][name] or {}
    merged = {**common, **{k: v for k, v in arm.items() if k != "set"}}
    sets = {**common.get("set", {}), **arm.get("set", {})}
    data = args.data or recipe["data"]
    folders = [data] if isinstance(data, str) else list(data)
    for f in folders:
        if not Path(f, "index.json").is_file():
            raise ConfigError(f"{f}: not a shard dataset (run `make demo` first to build the demo data)")
    out = Path(args.out or recipe["out"]) / name / f"s{seed}"
    sets["seed"] = seed
    cfg = load_config(merged.get("preset"), None, [f"{k}={json.dumps(v)}" for k, v in sets.items()],
                      shards=folders, out=str(out), steps=args.steps or merged.get("steps"),
                      batch_size=merged.get("batch_size"), **{"sampler.kind": merged.get("sampler")})
    return cfg, out


def summarise(evals: list[dict]) -> dict:
    """Mean and sample standard deviation over seeds of each column; n_val and chance from the first run."""
    row = {"n_val": evals[0]["n_val"], "seeds": len(evals)}
    for c in COLS:
        vals = [e[c] for e in evals]
        row[c] = round(statistics.fmean(vals), 2)
        row[c + "_sd"] = round(statistics.stdev(vals), 2) if len(vals) > 1 else 0.0
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--steps", type=int, help="override every arm's steps")
    ap.add_argument("--seeds", help="comma-separated seeds, overriding the recipe's")
    ap.add_argument("--data", help="override the recipe's data folder")
    ap.add_argument("--out", help="override the recipe's output folder")
    ap.add_argument("--arms", help="comma-separated subset of the arms")
    args = ap.parse_args()
    try:
        recipe = yaml.safe_load(args.recipe.read_text())
        names = args.arms.split(",") if args.arms else list(recipe["arms"])
        unknown = [n for n in names if n not in recipe["arms"]]
        if unknown:
            raise ConfigError(f"unknown arm(s) {', '.join(unknown)}; the recipe has {', '.join(recipe['arms'])}")
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else list(recipe.get("seeds", [0]))
        results = {}
        for name in names:
            evals = []
            for seed in seeds:
                cfg, out = arm_config(recipe, name, seed, args)
                done = out / "result.json"
                if done.exists() and json.loads(done.read_text()).get("step") == cfg.steps:
                    console.print(f"[{name} seed {seed}] reusing {done}", highlight=False, markup=False)
                    res = json.loads(done.read_text())
                else:
                    console.print(f"[{name} seed {seed}] preset {cfg.preset}, sampler {cfg.sampler.kind}, "
                                  f"{cfg.steps} steps -> {out}", highlight=False, markup=False)
                    resume = (out / "last.pt").exists()
                    res = train(cfg, resume=resume, overwrite=not resume)
                    done.write_text(json.dumps(res, indent=2) + "\n")
                if res.get("eval") is None:
                    raise TrainError(f"{out}: no held-out evaluation (raise data.val_frac)")
                evals.append(res["eval"])
            results[name] = evals
    except Interrupted as e:
        console.print(f"{str(e).split(':')[0]}: the same ablation command resumes this run", highlight=False,
                      markup=False)
        return 130
    except (ConfigError, TrainError, OSError, yaml.YAMLError, KeyError, ValueError) as e:
        console.print(f"error: {e}", highlight=False, markup=False)
        return 2

    first = next(iter(results.values()))[0]
    rows = {name: summarise(evals) for name, evals in results.items()}
    rows["chance"] = {"n_val": first["n_val"], **first["chance"]}
    table = Table(title=f"held-out retrieval (%), {args.recipe.stem} ablation, mean ± sd over {len(seeds)} seed(s)",
                  caption="i→t: image→text; t→i: text→image")
    for c in ["arm", "n_val", *HEADERS]:
        table.add_column(c, justify="right")
    for name, r in rows.items():
        cells = [f"{r[c]:.1f} ± {r[c + '_sd']:.1f}" if c + "_sd" in r else (f"{r[c]:.1f}" if c in r else "-")
                 for c in COLS]
        table.add_row(name, str(r["n_val"]), *cells)
    Console(width=max(Console().width, 130)).print(table)
    out = Path(args.out or recipe["out"])
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    md = ["| arm | n_val | " + " | ".join(HEADERS) + " |", "|---" * (len(COLS) + 2) + "|"]
    md += [f"| {n} | {r['n_val']} | " + " | ".join(
        f"{r[c]:.1f} ± {r[c + '_sd']:.1f}" if c + "_sd" in r else (f"{r[c]:.1f}" if c in r else "") for c in COLS)
        + " |" for n, r in rows.items()]
    (out / "results.md").write_text("\n".join(md) + "\n")
    console.print(f"wrote {out}/results.json and results.md", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
