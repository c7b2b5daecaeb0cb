"""Run the arms of an ablation recipe (YAML) with `vltrain` and print their held-out retrieval side by side.

    .venv/bin/python pipelines/ablation.py pipelines/samplers.yaml [--steps N] [--data DIR] [--out DIR] [--arms a,b]

A recipe has `data` (shard folders, one or a list), `out`, `common` (preset, steps, batch_size, sampler and a `set`
mapping of dotted config keys) and `arms` (name -> the same keys, overriding `common`). Every arm trains into
OUT/NAME with the same held-out split; an arm whose OUT/NAME/result.json already reached its step count is
reused, an interrupted one resumes. The table (R@1/5/10 both ways) is printed and written to OUT/results.json
and OUT/results.md.
"""

import argparse
import json
import sys
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from vltrain.config import ConfigError, load_config
from vltrain.train import TrainError, train

console = Console(stderr=True, emoji=False)
COLS = ["i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "mean_recall"]


def arm_config(recipe: dict, name: str, args) -> tuple:
    common, arm = recipe.get("common", {}), recipe["arms"][name] or {}
    merged = {**common, **{k: v for k, v in arm.items() if k != "set"}}
    sets = {**common.get("set", {}), **arm.get("set", {})}
    data = args.data or recipe["data"]
    folders = [data] if isinstance(data, str) else list(data)
    for f in folders:
        if not Path(f, "index.json").is_file():
            raise ConfigError(f"{f}: not a shard dataset (run `make demo` first to build the demo data)")
    out = Path(args.out or recipe["out"]) / name
    cfg = load_config(merged.get("preset"), None, [f"{k}={json.dumps(v)}" for k, v in sets.items()],
                      shards=folders, out=str(out), steps=args.steps or merged.get("steps"),
                      batch_size=merged.get("batch_size"), **{"sampler.kind": merged.get("sampler")})
    return cfg, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--steps", type=int, help="override every arm's steps")
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
        results = {}
        for name in names:
            cfg, out = arm_config(recipe, name, args)
            done = out / "result.json"
            if done.exists() and json.loads(done.read_text()).get("step") == cfg.steps:
                console.print(f"[{name}] reusing {done}", highlight=False, markup=False)
                results[name] = json.loads(done.read_text())
                continue
            console.print(f"[{name}] preset {cfg.preset}, sampler {cfg.sampler.kind}, {cfg.steps} steps -> {out}",
                          highlight=False, markup=False)
            res = train(cfg, resume=(out / "last.pt").exists())
            done.write_text(json.dumps(res, indent=2) + "\n")
            results[name] = res
    except (ConfigError, TrainError, OSError, yaml.YAMLError, KeyError) as e:
        console.print(f"error: {e}", highlight=False, markup=False)
        return 2

    table = Table(title=f"held-out retrieval (%), {args.recipe.stem} ablation")
    for c in ["arm", "n_val", *COLS]:
        table.add_column(c, justify="right")
    rows = {}
    for name, res in results.items():
        ev = res.get("eval") or {}
        rows[name] = {"n_val": ev.get("n_val"), **{c: ev.get(c) for c in COLS}}
        table.add_row(name, str(ev.get("n_val")), *(f"{ev[c]:.2f}" if c in ev else "-" for c in COLS))
    first = next(iter(results.values()), {}).get("eval") or {}
    if "chance" in first:
        ch = first["chance"]
        table.add_row("chance", str(first["n_val"]), *(f"{ch[c]:.2f}" if c in ch else "-" for c in COLS))
        rows["chance"] = {"n_val": first["n_val"], **ch}
    Console(width=max(Console().width, 110)).print(table)
    out = Path(args.out or recipe["out"])
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    md = ["| arm | n_val | " + " | ".join(COLS) + " |", "|---" * (len(COLS) + 2) + "|"]
    md += [f"| {n} | {r.get('n_val', '')} | " + " | ".join(str(r.get(c, "")) for c in COLS) + " |"
           for n, r in rows.items()]
    (out / "results.md").write_text("\n".join(md) + "\n")
    console.print(f"wrote {out}/results.json and results.md", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
