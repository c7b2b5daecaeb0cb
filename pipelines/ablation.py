"""Run an ablation recipe: its arms over seeds with `vltrain`, scored on fixed held-out sets, each finding tested as a
paired difference over seeds against the paper's own effect.

    .venv/bin/python pipelines/ablation.py pipelines/NAME.yaml [--quick] [--seeds 3 | 0,1,2] [--steps N]
                                           [--demo DIR] [--out DIR] [--arms a,b] [--inputs FILE]
    .venv/bin/python pipelines/ablation.py --rescore RESULTS.json [--update-findings]
    .venv/bin/python pipelines/ablation.py --list

A recipe (pipelines/*.yaml) has `about` (the --list line), `paper`, `common` (preset, steps, batch_size, sampler
and a `set` mapping of dotted config keys), `arms` (name -> its `data`, a list of input names or shard folders,
and the same keys as `common`, overriding them), `eval` (`retrieval`: an input whose pairs score R@1/5/10, or
`heldout` for each run's own held-out split; `zeroshot`: an input labelled by class name, or absent), `findings`
(each: the paper's claim, the arm that should be `better` `than` another, on which `metric`, and `paper_effect`,
the paper's better-minus-other difference in the metric's points, or null for a finding of our own; optionally
`paper_than`, the paper's level of the `than` arm, and `tie_margin`, which makes the claim a tie within ±margin
points), `seeds` (a count or a list: declared before the run) and `quick` (steps, seeds and arms of the smoke
version). `init_from` (in `common` or an arm) starts every run of the arm from the same weights: `clip:NAME` for a
pretrained CLIP or SigLIP folder or a checkpoint path, NAME an input (built first) or a path. `step_time: true`
adds each run's median step time (`step_ms`, from its metrics.jsonl; the recipe sets log_every=1) and 100 ln of it
(`log_step`, a metric whose paired differences are log ratios, shown as ratios), and runs the arms of a seed one
after the other so the machine's drifting load falls on both runs of a pair. Input names refer to pipelines/inputs.yaml (or --inputs FILE, the same format: smaller held-out sets
for a smoke test, say); a missing input is built first with the stage that makes it (the demo itself when that is
missing).

The seeds are recorded in OUT/plan.json before the first arm runs; a later invocation in the same OUT with more
seeds is a run extended after a look at its table, and its table says so. Every arm trains once per seed into
OUT/ARM/sSEED with the seed setting its initial weights, data order and held-out
draw, the same across arms; a finished run (result.json at its step count, trained on data with the same keys and
captions: `vltrain.data.shards.data_signature`) is reused, one whose inputs were rebuilt since trains again, and an
interrupted one resumes, so the same command continues a cut run. OUT gets results.json (`rows`, one per arm and
seed with every metric; `arms`, each arm's mean and sd; `eval`, the eval sizes and their sampling sd; `findings`),
table.md and chart.png. Each finding gets `diff` (the mean over seeds of better minus other on the same seed),
`ci_low`/`ci_high` (its 95% paired t interval), Holm-adjusted p-values, a `verdict`, `shares` (the paper's effect
and ours as a percentage of their baseline arm), `seeds_needed` and `seeds_range` (pipelines/verdicts.py states the
rule), `near_chance` (both arms under 3 times the metric's chance: a verdict on the floor speaks of the run's
length) and `far_below` (the arms under 3 times chance or a fifth of the paper's level). `--rescore` recomputes all
of that from a results file's rows and findings alone, with no training, and writes it back; with
`--update-findings` it takes the findings from the recipe's YAML as it is now.
"""

import argparse
import glob
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from vlprep import VlprepError, cut
from vlprep.cliargs import check_local
from vlprep.userfile import read_user_file
from vltrain.errors import TrainError
from vltrain.config import ConfigError
from vltrain.config_load import load_config
from vltrain.data.shards import data_signature
from vltrain.resume import Interrupted
from vltrain.train import train

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module pipelines/verdicts.py
import verdicts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "pipelines"
DEFAULT_DEMO = ROOT / "demo-out" / "openclipart"
console = Console(stderr=True, emoji=False)

RETRIEVAL = ["i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "mean_recall"]
# A run's speed (recipes with `step_time: true`): the median of its steps' wall times in ms, from metrics.jsonl, and
# 100 ln of it, on which a finding is a paired difference like any other: 100 (ln a - ln b) per seed, whose mean and
# interval are the log of the ratio of the two arms' step times (the table shows them as that ratio, RATIO_METRICS).
TIMING = ["step_ms", "log_step"]
RATIO_METRICS = {"log_step"}
# Columns computed from a row's others (rows are scored once; a derived column is recomputed on --rescore).
DERIVED = {"r1_mean": lambda r: (r["i2t_r1"] + r["t2i_r1"]) / 2 if "i2t_r1" in r and "t2i_r1" in r else None,
           "log_step": lambda r: 100 * math.log(r["step_ms"]) if r.get("step_ms") else None}
COLUMNS = RETRIEVAL + ["r1_mean", "zeroshot"] + TIMING
TABLE_HIDDEN = {"log_step"}  # judged, not shown among the arms' columns (ms/step is)
HEADERS = {"i2t_r1": "TR@1", "i2t_r5": "TR@5", "i2t_r10": "TR@10", "t2i_r1": "IR@1", "t2i_r5": "IR@5",
           "t2i_r10": "IR@10", "mean_recall": "mean R", "r1_mean": "mean R@1", "zeroshot": "zero-shot top-1",
           "step_ms": "ms/step", "log_step": "step time"}
QUICK = {"steps": 6, "seeds": 1}
MAX_SEEDS = 1000  # --seeds: at most this many seeds, each a numpy seed (0 .. 2**32 - 1)
MAX_SEED = 2**32 - 1
# A metric's chance level in units of the row's chance R@1 (R@k of a random ranking is about k times R@1's; mean R is
# the mean of R@1, 5, 10 both ways); zero-shot has its own chance column.
CHANCE_UNITS = {"i2t_r1": 1, "t2i_r1": 1, "r1_mean": 1, "i2t_r5": 5, "t2i_r5": 5, "i2t_r10": 10, "t2i_r10": 10,
                "mean_recall": 16 / 3}
NEAR_CHANCE = 3.0  # a finding whose two arms both score under this many times chance is flagged "near chance"
FAR_BELOW = 0.2  # an arm under this fraction of the paper's level (or NEAR_CHANCE x chance) is far below the paper's


class RecipeError(Exception):
    """A recipe or an input that cannot be used; its text is the one line the user sees."""


# --- recipes and inputs ---------------------------------------------------------------------------------------------


def recipe_paths() -> list[Path]:
    return sorted(p for p in HERE.glob("*.yaml") if p.name != "inputs.yaml")


def load_recipe(path: Path) -> dict:
    """The parsed recipe, with every arm, finding and quick arm checked against each other."""
    if not path.is_file():
        raise RecipeError(f"recipe not found: {path} (pipelines/ablation.py --list shows them)")
    recipe = yaml.safe_load(path.read_text()) or {}
    for key in ("about", "arms", "eval"):
        if key not in recipe:
            raise RecipeError(f"{path}: no `{key}` section")
    arms = recipe["arms"]
    for f in recipe.get("findings", []):
        for side in ("better", "than"):
            if f.get(side) not in arms:
                raise RecipeError(f"{path}: finding {f.get('paper')!r} names arm {f.get(side)!r}, not one of "
                                  f"{', '.join(arms)}")
        if f.get("metric") not in COLUMNS:
            raise RecipeError(f"{path}: finding {f.get('paper')!r}: metric must be one of {', '.join(COLUMNS)}")
        check_finding(f, f"{path}: finding {cut(repr(f.get('paper')), 40)}")
    for name in recipe.get("quick", {}).get("arms", []):
        if name not in arms:
            raise RecipeError(f"{path}: quick arm {name!r} is not one of {', '.join(arms)}")
    return recipe


def load_inputs(path: Path = HERE / "inputs.yaml") -> dict:
    """The named inputs of pipelines/inputs.yaml, or of another file in its format."""
    if not path.is_file():
        raise RecipeError(f"--inputs {path}: no such file")
    inputs = yaml.safe_load(path.read_text())
    if not isinstance(inputs, dict) or not all(isinstance(v, dict) and "path" in v for v in inputs.values()):
        raise RecipeError(f"--inputs {path}: not an inputs file (NAME: {{path: ..., build: [...]}} entries, as "
                          "pipelines/inputs.yaml)")
    return inputs


def fill(text: str, demo: Path, path: str = "") -> str:
    bindir = Path(sys.executable).parent
    return text.format(demo=demo, root=ROOT, py=sys.executable, vlprep=bindir / "vlprep", path=path)


def input_path(name: str, inputs: dict, demo: Path) -> Path:
    """An input's folder or file: a name from inputs.yaml, or a path as it is."""
    return Path(fill(inputs[name]["path"], demo)) if name in inputs else Path(name)


def _present(path: Path) -> bool:
    """A dataset folder once its sizes.json is written, a model folder (a `clip:` start) once its config.json is, a
    file once it exists."""
    if path.suffix == "":
        return (path / "sizes.json").is_file() or (path / "config.json").is_file()
    return path.is_file()


def _reads_digest(spec: dict, demo: Path, path: Path) -> str | None:
    """A hash of the input's build command and of the files it reads (its `reads` globs), or None when the spec
    lists none."""
    if not spec.get("reads"):
        return None
    h = hashlib.sha256(json.dumps(spec.get("build")).encode())
    for pattern in spec["reads"]:
        for f in sorted(glob.glob(fill(pattern, demo, str(path)))):
            h.update(f.encode() + b"\0" + Path(f).read_bytes())
    return h.hexdigest()[:16]


def ensure(name: str, inputs: dict, demo: Path, logs: Path, done: set | None = None) -> Path:
    """The input's path, after building what it needs and then itself when missing, or when its build command or
    the files it reads changed since it was built (`reads` in inputs.yaml; the digest is kept in LOGS/NAME.reads).
    Each build's output goes to LOGS/NAME.log, shown when it fails."""
    done = set() if done is None else done
    if name not in inputs:
        path = Path(name)
        if not _present(path):
            raise RecipeError(f"{path}: not a shard dataset, and not an input name of pipelines/inputs.yaml")
        return path
    spec = inputs[name]
    path = input_path(name, inputs, demo)
    if name in done:
        return path
    for need in spec.get("needs", []):
        ensure(need, inputs, demo, logs, done)
    stamp = logs / f"{name}.reads"
    digest = _reads_digest(spec, demo, path)
    stale = digest is not None and stamp.is_file() and stamp.read_text().strip() != digest
    if _present(path) and not stale:
        if digest is not None and not stamp.is_file():  # built before stamps existed: its reads as they are now
            logs.mkdir(parents=True, exist_ok=True)
            stamp.write_text(digest + "\n")
        done.add(name)
        return path
    if "build" not in spec:
        raise RecipeError(f"{path} is missing and nothing in pipelines/inputs.yaml builds it")
    cmd = [fill(str(a), demo, str(path)) for a in spec["build"]]
    env = {**os.environ, **{k: fill(str(v), demo, str(path)) for k, v in spec.get("env", {}).items()}}
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    why = "its inputs changed since it was built" if stale else "missing"
    console.print(f"building {name} -> {path} ({why}; log: {log})", highlight=False, markup=False, soft_wrap=True)
    t0 = time.monotonic()
    with log.open("w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0 or not _present(path):
        tail = log.read_text().strip().splitlines()[-15:]
        raise RecipeError(f"building {name} failed ({' '.join(cmd)[:200]}); the end of {log}:\n" + "\n".join(tail))
    if digest is not None:
        stamp.write_text(digest + "\n")
    console.print(f"built {name} in {time.monotonic() - t0:.0f} s", highlight=False, markup=False, soft_wrap=True)
    done.add(name)
    return path


# --- running and scoring one arm ------------------------------------------------------------------------------------


def arm_config(recipe: dict, name: str, seed: int, folders: list[str], out: Path, steps: int | None, demo: Path):
    common = recipe.get("common", {})
    arm = recipe["arms"][name] or {}
    merged = {**common, **{k: v for k, v in arm.items() if k not in ("set", "data")}}
    sets = {**common.get("set", {}), **arm.get("set", {}), "seed": seed}
    sets = {k: fill(v, demo) if isinstance(v, str) else v for k, v in sets.items()}
    return load_config(merged.get("preset"), None, [f"{k}={json.dumps(v)}" for k, v in sets.items()],
                       shards=folders, out=str(out), steps=steps or merged.get("steps"),
                       batch_size=merged.get("batch_size"), **{"sampler.kind": merged.get("sampler")})


# A Fistful of Words' zero-shot prompt (sec. 3: one template, no ensemble), which the recipes' tables were made with.
PROMPT = ["a photo of a {}"]


def score(run: Path, ckpt_step: int, res: dict, retrieval: Path | None, zeroshot: tuple | None) -> dict:
    """One per-seed row: retrieval on the recipe's set (or the run's own held-out split) and zero-shot top-1;
    cached in RUN/scores.json for the checkpoint's step and the eval sets' contents (their `data_signature`)."""
    from vltrain.evaluate import evaluate_checkpoint

    cache = run / "scores.json"
    sets = {str(p): data_signature([p]) for p in (retrieval, zeroshot and zeroshot[0]) if p}
    if cache.is_file():
        row = json.loads(cache.read_text())
        if row.get("step") == ckpt_step and row.get("eval_sets") == sets:  # a rebuilt eval set is scored again
            return row
    row = {"step": ckpt_step, "eval_sets": sets}
    if retrieval is None:  # the run's own held-out split, evaluated by the trainer at its last step
        if res.get("eval") is None:
            raise RecipeError(f"{run}: no held-out evaluation (raise data.val_frac)")
        row.update({k: res["eval"][k] for k in RETRIEVAL}, n_eval=res["eval"]["n_val"],
                   chance_r1=res["eval"]["chance"]["i2t_r1"])
    else:
        r = evaluate_checkpoint(run / "last.pt", [retrieval])
        row.update(r["retrieval"], n_eval=r["n_samples"], chance_r1=r["chance"]["i2t_r1"])
    if zeroshot is not None:
        z = evaluate_checkpoint(run / "last.pt", [zeroshot[0]], zeroshot=zeroshot[1], templates=PROMPT)["zeroshot"]
        row.update(zeroshot=z.get("top1"), zeroshot_n=z["samples"], zeroshot_chance=round(100 / z["classes"], 2))
    cache.write_text(json.dumps(row, indent=2) + "\n")
    return row


def arm_init(recipe: dict, name: str, inputs: dict, demo: Path, logs: Path) -> str | None:
    """The arm's start (`init_from`, the arm's or `common`'s): `clip:NAME` for a pretrained CLIP or SigLIP folder, or
    a checkpoint path; NAME an input of inputs.yaml (built first when missing) or a path ({demo} filled in). None
    for a run from scratch. Every arm with the same `init_from` starts from the same weights, whatever its seed
    (the seed still sets the data order, the held-out draw and any tensor the start lacks)."""
    arm = recipe["arms"][name] or {}
    spec = arm.get("init_from", recipe.get("common", {}).get("init_from"))
    if spec is None:
        return None
    if not isinstance(spec, str) or not spec.strip():
        raise RecipeError(f"arm {name}: init_from must be clip:NAME or a checkpoint path, not {_kind(spec)}")
    prefix = "clip:" if spec.startswith("clip:") else ""
    ref = spec[len(prefix):]
    path = ensure(ref, inputs, demo, logs) if ref in inputs else Path(fill(ref, demo))
    if not path.exists():
        raise RecipeError(f"arm {name}: init_from {spec}: {path} does not exist (an input name of "
                          "pipelines/inputs.yaml builds one)")
    return prefix + str(path)


def step_ms(run: Path, batch_size: int) -> float | None:
    """The median wall time of the run's steps in ms, from RUN/metrics.jsonl: each training row's samples_per_s is
    the rate over the steps since the row before it (vltrain.runlog), so batch_size / samples_per_s is a step's time
    when the recipe logs every step (log_every=1; otherwise the mean of a window's steps). Each run's first row is
    left out, as its window holds the loader's start. A median, as a step that met a checkpoint write or a busy
    machine's stall is an outlier, not the step's cost. None without two training rows."""
    rows = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by a kill (the trainer redoes it on resume)
            continue
        if isinstance(row, dict) and row.get("samples_per_s"):
            rows.append(row)
    times = [1000 * batch_size / r["samples_per_s"] for r in rows[1:]]
    return round(statistics.median(times), 3) if times else None


def run_order(arms: list[str], seeds: list[int], paired_in_time: bool) -> list[tuple[str, int]]:
    """The (arm, seed) runs in the order they train: arm by arm, or, for a recipe that times its steps, seed by seed
    with every arm of a seed in turn, so that the load of a shared machine, which drifts over minutes, weighs on
    both runs of a pair alike rather than on one arm's runs."""
    if paired_in_time:
        return [(arm, seed) for seed in seeds for arm in arms]
    return [(arm, seed) for arm in arms for seed in seeds]


def run_arm(recipe: dict, name: str, seed: int, folders: list[str], out: Path, steps: int | None, demo: Path,
            init_from: str | None = None) -> dict:
    cfg = arm_config(recipe, name, seed, folders, out, steps, demo)
    done = out / "result.json"
    resume = (out / "last.pt").exists()
    if done.exists() and resume:
        res = json.loads(done.read_text())
        # A finished run is reused when its data is still the same (runs from before the signature carry none).
        same_data = res.get("data") in (None, data_signature(folders))
        if res.get("step") == cfg.steps and same_data:
            console.print(f"[{name} seed {seed}] reusing {done}", highlight=False, markup=False, soft_wrap=True)
            return res
        resume = same_data  # rebuilt inputs: train again from the start
    console.print(f"[{name} seed {seed}] preset {cfg.preset}, sampler {cfg.sampler.kind}, {cfg.steps} steps of "
                  f"{cfg.batch_size} -> {out}", highlight=False, markup=False, soft_wrap=True)
    (out / "scores.json").unlink(missing_ok=True)  # scores of the checkpoint this run replaces
    res = train(cfg, resume=resume, overwrite=not resume, init_from=init_from)
    slim(out)
    done.write_text(json.dumps(res, indent=2) + "\n")
    return res


def slim(run: Path) -> None:
    """A finished run keeps only what scoring reads: last.pt without the optimiser state, and no best.pt (the
    recipes evaluate at the last step only). With MiniLM a full last.pt + best.pt pair is about 500 MB, so a
    recipe's 20 runs would hold 10 GB; slimmed, about a third of one checkpoint each."""
    from vltrain import checkpoint as ckpt_io

    (run / "best.pt").unlink(missing_ok=True)
    ckpt = ckpt_io.load(run / "last.pt")
    if "optimizer" in ckpt:
        ckpt.pop("format", None)
        ckpt.pop("optimizer")
        ckpt_io.save(ckpt, run / "last.pt")


# --- summary, verdicts, table, chart --------------------------------------------------------------------------------


def derive(row: dict) -> dict:
    """The row with its DERIVED columns (re)computed from the scored ones."""
    for name, f in DERIVED.items():
        value = f(row)
        if value is not None:
            row[name] = round(value, 4)
    return row


def summarise(rows: list[dict]) -> dict:
    """Mean and sample standard deviation over the seeds of every column a row has."""
    out = {"seeds": len(rows)}
    for c in COLUMNS:
        vals = [r[c] for r in rows if r.get(c) is not None]
        if vals:
            out[c] = round(statistics.fmean(vals), 2)
            out[c + "_sd"] = round(statistics.stdev(vals), 2) if len(vals) > 1 else 0.0
    return out


def eval_sizes(rows: list[dict]) -> dict:
    """The eval sets' sizes and the sampling sd (in points) of each R@1 and zero-shot top-1 at its mean over all rows:
    sqrt(p (1 - p) / n) for n queries, the spread a metric would have over other draws of as many eval items."""
    first = rows[0]
    out = {"retrieval_images": first["n_eval"], "retrieval_captions": first.get("n_captions", first["n_eval"]),
           "chance_r1": first["chance_r1"]}
    queries = {"i2t_r1": out["retrieval_images"], "t2i_r1": out["retrieval_captions"]}
    if first.get("zeroshot_n"):
        out.update(zeroshot_images=first["zeroshot_n"], zeroshot_chance=first["zeroshot_chance"])
        queries["zeroshot"] = first["zeroshot_n"]
    for metric, n in queries.items():
        vals = [r[metric] for r in rows if r.get(metric) is not None]
        if vals and n:
            p = statistics.fmean(vals) / 100
            out[f"{metric}_sampling_sd"] = round(100 * math.sqrt(p * (1 - p) / n), 2)
    return out


def cell(s: dict, c: str) -> str:
    return f"{s[c]:.1f} ± {s[c + '_sd']:.1f}" if c in s else "-"


def _num(x, signed: bool = True) -> str:
    return "-" if x is None else (f"{x:+.2f}" if signed else f"{x:.2f}")


def _ratio(x) -> str:
    """A difference of 100 ln(a) - 100 ln(b) as the ratio a / b."""
    return "-" if x is None else f"{math.exp(x / 100):.2f}x"


def _share(x) -> str:
    return "" if x is None else f" ({x:+.0f}%)" if abs(x) >= 10 else f" ({x:+.1f}%)"


def _seeds_cell(f: dict) -> str:
    """Seeds per arm for 80% power at both ends of the sd's 80% interval (inconclusive findings only)."""
    if f["verdict"] != "inconclusive" or f.get("seeds_needed") is None:
        return "-"
    show = [f"{verdicts.MAX_SEEDS}+" if n > verdicts.MAX_SEEDS else str(n)
            for n in f.get("seeds_range") or [f["seeds_needed"]] * 2]
    return show[0] if show[0] == show[1] else f"{show[0]}–{show[1]}"


def finding_cells(f: dict) -> list[str]:
    """A finding's cells: the paper's effect (and its share of the paper's baseline), ours with its interval (and its
    share of ours), the Holm p-values, the verdict with its flags, the seeds for 80% power."""
    sh = f.get("shares") or {}
    ours = (f"{_num(f['diff'])} [{_num(f['ci_low'])}, {_num(f['ci_high'])}]{_share(sh.get('ours'))}"
            if f["diff"] is not None else "-")
    if f["metric"] in RATIO_METRICS and f["diff"] is not None:  # 100 ln(a / b): shown as the ratio a / b
        ours = (f"{_ratio(f['diff'])} [{_ratio(f['ci_low'])}, {_ratio(f['ci_high'])}] (100 ln: {_num(f['diff'])} "
                f"[{_num(f['ci_low'])}, {_num(f['ci_high'])}])")
    if f["missing_seeds"]:
        ours += f" ({f['n_seeds']} seeds; seed(s) {', '.join(map(str, f['missing_seeds']))} missing in one arm)"
    if "p_equiv" in f:
        p = f"equiv. {_num(f['p_equiv'], False)} / apart {_num(f['p_apart'], False)}"
    else:
        p = _num(f.get("p_zero"), False) + (f" / {_num(f['p_paper'], False)}" if "p_paper" in f else "")
    paper = "ours" if f.get("paper_effect") is None else _num(f["paper_effect"]) + _share(sh.get("paper"))
    if f.get("tie_margin") is not None:
        paper = f"tie within ±{f['tie_margin']:g} (paper {_num(f['paper_effect'])})"
    verdict = f["verdict"]
    if f.get("near_chance"):
        verdict += f" (both arms under {NEAR_CHANCE:g}x chance)"
    elif f.get("far_below"):
        verdict += f" (far below the paper's operating point: {', '.join(f['far_below'])})"
    return [paper, ours, p, verdict, _seeds_cell(f)]


def seeds_text(seeds: list[int], plan: dict | None) -> str:
    """The table's seeds, with how they relate to the seeds declared before the run."""
    text = "seeds " + ", ".join(map(str, seeds))
    if plan is None:
        return text + " (this file predates recorded seed plans)"
    status = seed_status(plan["seeds"], seeds)
    if status == "as declared":
        return text + f", declared before the run ({plan['declared_on'][:10]})"
    return text + f": {status} (declared {', '.join(map(str, plan['seeds']))} on {plan['declared_on'][:10]})"


def table_md(results: dict) -> str:
    meta, rows, summary, findings, sizes = (results[k] for k in ("meta", "rows", "arms", "findings", "eval"))
    cols = [c for c in COLUMNS if c not in TABLE_HIDDEN and any(c in s for s in summary.values())]
    seeds = sorted({r["seed"] for r in rows})
    text = (f"retrieval on {sizes['retrieval_images']:,} images and {sizes['retrieval_captions']:,} captions (chance "
            f"R@1 {sizes['chance_r1']:.2f}")
    sd = [f"{HEADERS[m]} ± {sizes[m + '_sampling_sd']:.1f}" for m in ("i2t_r1", "t2i_r1")
          if m + "_sampling_sd" in sizes]
    text += (f"; sampling sd {', '.join(sd)})" if sd else ")")
    if "zeroshot_images" in sizes:
        text += (f", zero-shot on {sizes['zeroshot_images']:,} images (chance {sizes['zeroshot_chance']:.1f}%"
                 + (f"; sampling sd ± {sizes['zeroshot_sampling_sd']:.1f}" if "zeroshot_sampling_sd" in sizes else "")
                 + ")")
    md = [f"`{meta['command']}` ({meta['date']}; {seeds_text(seeds, meta.get('seed_plan'))}; {meta['steps']}). "
          f"Arms: mean ± sd over seeds. Eval: {text}.", "",
          "| arm | " + " | ".join(HEADERS[c] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    md += [f"| {arm} | " + " | ".join(cell(s, c) for c in cols) + " |" for arm, s in summary.items()]
    if findings:
        md += ["", "Findings: the per-seed paired difference better − other, its mean and 95% t interval over seeds, "
               "and in brackets its share of our `other` arm (the paper's effect: of the paper's `other` arm). "
               f"p-values, Holm-adjusted over this recipe's {verdicts.family_size(findings)} tests (family-wise 5%): "
               "the paired t tests against 0 and against the paper's effect, or for a tie claim the TOST (equiv.) and "
               "the test against the nearer margin (apart). Seeds per arm for 80% power at both ends of the 80% "
               "interval of the differences' sd (inconclusive findings). "
               f"\"Both arms under {NEAR_CHANCE:g}x chance\": a verdict on the metric's floor, about this run's "
               "length, not the method; \"far below the paper's operating point\": an arm under "
               f"{NEAR_CHANCE:g}x chance or under {FAR_BELOW:.0%} of the paper's level.", "",
               "| paper's finding | better − other (metric) | paper's effect | ours [95% CI] | p vs 0 / vs paper "
               "| verdict | seeds for 80% power |", "|---|---|---|---|---|---|---|"]
        md += [f"| {f['paper']} | {f['better']} − {f['than']} ({HEADERS[f['metric']]}) | "
               + " | ".join(finding_cells(f)) + " |" for f in findings]
    return "\n".join(md) + "\n"


RESULTS_BYTES = 64 << 20  # a results file is a few KB: --rescore reads at most this much
NUMBERS = [c for c in COLUMNS if c not in TIMING] + ["chance_r1", "zeroshot_chance"]  # percentages (or null)
COUNTS = ["n_eval", "n_captions", "n_images", "zeroshot_n", "step"]  # a row's integer fields (or null)


def _kind(value) -> str:
    """A JSON value's type in words, for an error line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    names = {dict: "an object", list: "an array", str: "a string", int: "an integer", float: "a number"}
    return "null" if value is None else f"{names.get(type(value), type(value).__name__)} {cut(repr(value), 30)}"


def check_results(results) -> None:
    """A RecipeError naming the field when a results file is not shaped as write_outputs writes it: rows of a string
    arm, an integer seed and percentages in [0, 100]; findings of string arms, a known metric and a numeric effect."""
    def need(ok: bool, where: str, want: str, value) -> None:
        if not ok:
            raise RecipeError(f"{where}: expected {want}, not {_kind(value)}")

    need(isinstance(results, dict), "the file", "a JSON object with rows and findings", results)
    rows = results.get("rows")
    findings = results.get("findings", [])
    need(isinstance(rows, list), "rows", "an array", rows)
    need(isinstance(findings, list), "findings", "an array", findings)
    need(isinstance(results.get("meta", {}), dict), "meta", "an object", results.get("meta"))
    for i, r in enumerate(rows):
        need(isinstance(r, dict), f"rows[{i}]", "an object", r)
        need(isinstance(r.get("arm"), str), f"rows[{i}].arm", "a string", r.get("arm"))
        seed = r.get("seed")
        need(type(seed) is int and 0 <= seed <= MAX_SEED, f"rows[{i}].seed", f"an integer in [0, {MAX_SEED}]", seed)
        for c in NUMBERS:
            v = r.get(c)
            need(v is None or type(v) in (int, float) and 0 <= v <= 100, f"rows[{i}].{c}", "a percentage in [0, 100]",
                 v)
        for c in COUNTS:
            v = r.get(c)
            need(v is None or type(v) is int and v >= 0, f"rows[{i}].{c}", "a count (an integer >= 0)", v)
        v = r.get("step_ms")  # log_step is derived from it again
        need(v is None or type(v) in (int, float) and math.isfinite(v) and v > 0, f"rows[{i}].step_ms",
             "a positive number of milliseconds", v)
    for j, f in enumerate(findings):
        need(isinstance(f, dict), f"findings[{j}]", "an object", f)
        for key in ("paper", "better", "than"):
            need(isinstance(f.get(key), str), f"findings[{j}].{key}", "a string", f.get(key))
        need(f.get("metric") in COLUMNS, f"findings[{j}].metric", f"one of {', '.join(COLUMNS)}", f.get("metric"))
        v = f.get("paper_effect")
        need(v is None or type(v) in (int, float) and math.isfinite(v), f"findings[{j}].paper_effect",
             "a finite number or null", v)
        check_finding(f, f"findings[{j}]")
    plan = results.get("meta", {}).get("seed_plan")
    if plan is not None:
        need(isinstance(plan, dict) and isinstance(plan.get("seeds"), list)
             and all(type(x) is int for x in plan["seeds"]) and isinstance(plan.get("declared_on"), str),
             "meta.seed_plan", "an object with the declared seeds (integers) and declared_on", plan)


FINDING_KEYS = ("paper", "better", "than", "metric", "paper_effect")
OPTIONAL_KEYS = ("tie_margin", "paper_than")  # a tie claim's margin; the paper's level of the `than` arm


def definition(f: dict) -> dict:
    """A finding's definition as judged: its keys, and the optional ones it has."""
    return {**{k: f.get(k) for k in FINDING_KEYS}, **{k: f[k] for k in OPTIONAL_KEYS if f.get(k) is not None}}


def check_finding(f: dict, where: str) -> None:
    """A RecipeError naming the key when a finding's optional numbers are not positive, or a tie claim has no paper
    effect to set against its margin."""
    for key in OPTIONAL_KEYS:
        v = f.get(key)
        if v is not None and not (type(v) in (int, float) and math.isfinite(v) and v > 0):
            raise RecipeError(f"{where}.{key}: expected a positive number (points of the metric), not {_kind(v)}")
    if f.get("tie_margin") is not None and f.get("paper_effect") is None:
        raise RecipeError(f"{where}: a tie claim (tie_margin) needs the paper's own difference as paper_effect")


def rescore(results: dict) -> dict:
    """The summary, eval sizes and findings recomputed from `rows` and the findings' definitions alone."""
    check_results(results)
    try:  # two rows of one arm and seed would be paired once and averaged twice
        verdicts.check_rows(results["rows"])
    except ValueError as e:
        raise RecipeError(str(e)) from None
    rows = [derive(dict(r)) for r in results["rows"]]
    if not rows:
        raise RecipeError("the results hold no rows to score")
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    defs = [definition(f) for f in results.get("findings", [])]
    for f in defs:
        for side in ("better", "than"):
            if f[side] not in arms:
                raise RecipeError(f"finding {f['paper']!r} names arm {f[side]!r}, which has no rows")
        if f["metric"] not in COLUMNS:
            raise RecipeError(f"finding {f['paper']!r}: metric must be one of {', '.join(COLUMNS)}")
    if "meta" not in results:  # written before the verdict rule: its command, date and steps sat at the top level
        results = {"meta": {k: results.get(k, "") for k in ("command", "date", "steps", "paper")},
                   **{k: v for k, v in results.items() if k not in ("command", "date", "steps", "paper", "seeds")}}
    findings = verdicts.judge(defs, rows)
    for f in findings:
        mine = [r for r in rows if r["arm"] in (f["better"], f["than"])]
        f["near_chance"] = near_chance(f["metric"], mine)
        f["far_below"] = far_below(f, mine)
    return {**results, "rows": rows, "arms": {a: summarise([r for r in rows if r["arm"] == a]) for a in arms},
            "eval": eval_sizes(rows), "findings": findings}


def near_chance(metric: str, rows: list[dict]) -> bool:
    """Whether both arms of a finding score under NEAR_CHANCE times the metric's chance level (their mean over
    seeds). Such a finding is on the metric's floor: an interval that excludes the paper's effect there says the run
    was too short to show any effect, not that the method has none. The verdict itself stays the test's."""
    def chance(r: dict) -> float | None:
        if metric == "zeroshot":
            return r.get("zeroshot_chance")
        if r.get("chance_r1") is None or metric not in CHANCE_UNITS:  # a step time has no chance level
            return None
        return r["chance_r1"] * CHANCE_UNITS[metric]

    def scored(r: dict) -> bool:  # a NaN score (a metric that failed) says nothing about the floor
        return r.get(metric) is not None and math.isfinite(r[metric]) and chance(r) is not None

    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm and scored(r)]
        if not mine or statistics.mean(r[metric] for r in mine) >= NEAR_CHANCE * statistics.mean(map(chance, mine)):
            return False
    return True


def far_below(f: dict, rows: list[dict]) -> list[str]:
    """The arms of a finding far below the paper's operating point: those whose mean over seeds is under
    NEAR_CHANCE times the metric's chance, or under FAR_BELOW of the paper's level of the `than` arm (`paper_than`).
    A verdict there is about a model that has learned a fraction of what the paper's had."""
    out = []
    for arm in (f["better"], f["than"]):
        mine = [r for r in rows if r["arm"] == arm and r.get(f["metric"]) is not None and math.isfinite(r[f["metric"]])]
        if not mine:
            continue
        level = statistics.mean(r[f["metric"]] for r in mine)
        floor = near_chance(f["metric"], mine)
        if floor or (f.get("paper_than") and level < FAR_BELOW * f["paper_than"]):
            out.append(arm)
    return out


def write_outputs(results_path: Path, results: dict) -> tuple[Path, Path]:
    """results.json, and beside it the table and chart: table.md and chart.png for OUT/results.json, NAME.md and
    NAME.png for any other NAME.json (pipelines/results/RECIPE.json)."""
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    if results_path.name == "results.json":
        table = results_path.parent / "table.md"
        png = results_path.parent / "chart.png"
    else:
        table = results_path.with_suffix(".md")
        png = results_path.with_suffix(".png")
    table.write_text(table_md(results))
    chart(png, results)
    return table, png


def chart(path: Path, results: dict) -> None:
    """Left: each arm's mean ± sd of R@1 both ways and zero-shot; right: each finding's paired difference with its
    95% interval (ours, black) and the paper's effect (red diamond)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["arms"]
    findings = results["findings"]
    sizes = results["eval"]
    metrics = [c for c in ("i2t_r1", "t2i_r1", "zeroshot") if any(c in s for s in summary.values())]
    arms = list(summary)
    fig, (ax, fx) = plt.subplots(1, 2, figsize=(15, max(4.5, 0.55 * len(findings) + 2)),
                                 gridspec_kw={"width_ratios": [1, 1.2]})
    width = 0.8 / max(len(metrics), 1)
    for i, m in enumerate(metrics):
        xs = [j + (i - (len(metrics) - 1) / 2) * width for j in range(len(arms))]
        ax.bar(xs, [summary[a].get(m, 0) for a in arms], width, yerr=[summary[a].get(m + "_sd", 0) for a in arms],
               capsize=3, label=HEADERS[m])
    chance = (("R@1 chance", sizes.get("chance_r1"), ":"), ("zero-shot chance", sizes.get("zeroshot_chance"), "--"))
    for label, y, style in chance:
        if y is not None:
            ax.axhline(y, color="grey", linestyle=style, linewidth=1, label=label)
    ax.set_xticks(range(len(arms)), arms, rotation=20, ha="right")
    ax.set_ylabel("%")
    ax.set_title(f"{results['recipe']}: arms, mean ± sd over seeds")
    ax.legend(fontsize=8)
    labelled = False
    for k, f in enumerate(reversed(findings)):
        if f.get("tie_margin") is not None:  # a tie claim: its margin as a band behind our interval
            m = f["tie_margin"]
            fx.plot([-m, m], [k, k], color="tab:green", linewidth=8, alpha=0.3, solid_capstyle="butt",
                    label=f"tie margin ±{m:g}")
        if f["diff"] is not None:
            lo = f["ci_low"] if f["ci_low"] is not None else f["diff"]
            hi = f["ci_high"] if f["ci_high"] is not None else f["diff"]
            fx.errorbar(f["diff"], k, xerr=[[f["diff"] - lo], [hi - f["diff"]]], fmt="o", color="black", capsize=3)
        if f.get("paper_effect") is not None:
            fx.plot(f["paper_effect"], k, "D", color="tab:red", label=None if labelled else "paper's effect")
            labelled = True
    fx.axvline(0, color="grey", linewidth=1)
    fx.set_yticks(range(len(findings)), [f"{f['better']} − {f['than']} ({HEADERS[f['metric']]}): {f['verdict']}"
                                          + (" (near chance)" if f.get("near_chance") else "")
                                         for f in reversed(findings)], fontsize=8)
    fx.set_xlabel("difference, points (ours: mean and 95% interval over seeds)")
    fx.set_title("findings")
    if labelled or any(f.get("tie_margin") is not None for f in findings):
        fx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(results: dict) -> None:
    summary = results["arms"]
    findings = results["findings"]
    cols = [c for c in COLUMNS if c not in TABLE_HIDDEN and any(c in s for s in summary.values())]
    table = Table(title=f"{results['recipe']}: mean ± sd over seeds",
                  caption="TR: text retrieval (image→text); IR: image retrieval (text→image)")
    for c in ["arm"] + [HEADERS[c] for c in cols]:
        table.add_column(c, justify="right")
    for arm, s in summary.items():
        table.add_row(arm, *[cell(s, c) for c in cols])
    wide = Console(width=max(Console().width, 140))
    wide.print(table)
    for f in findings:
        paper, ours, _, verdict, need = finding_cells(f)
        wide.print(f"{verdict:>28}: {f['paper']} ({f['better']} − {f['than']}, {HEADERS[f['metric']]}: ours {ours}, "
                   f"paper {paper}" + (f"; {need} seeds for 80% power" if need != "-" else "") + ")",
                   highlight=False, markup=False, soft_wrap=True)


# --- main -----------------------------------------------------------------------------------------------------------


def parse_seeds(text: str | None, default) -> list[int]:
    if text is None:
        return list(range(default)) if isinstance(default, int) else list(default)
    shown = cut(repr(text))
    try:
        if "," in text or not text.isdigit():
            seeds = [int(x) for x in text.split(",") if x.strip()]
        else:
            count = int(text) if len(text.lstrip("0")) <= 9 else MAX_SEEDS + 1  # a count: seeds 0 .. N-1
            if count > MAX_SEEDS:
                raise RecipeError(f"--seeds {shown}: at most {MAX_SEEDS} seeds")
            seeds = list(range(count))
    except ValueError:
        seeds = []
    if any(seed < 0 for seed in seeds):
        raise RecipeError(f"--seeds {shown}: seeds are at least 0")
    if any(seed > MAX_SEED for seed in seeds):
        raise RecipeError(f"--seeds {shown}: seeds are at most {MAX_SEED} (2**32 - 1, numpy's largest seed)")
    if len(seeds) > MAX_SEEDS:
        raise RecipeError(f"--seeds {shown}: at most {MAX_SEEDS} seeds")
    twice = next((seed for i, seed in enumerate(seeds) if seed in seeds[:i]), None)
    if twice is not None:  # its rows would be one arm's seed twice: summarised twice, paired once
        raise RecipeError(f"--seeds {shown}: seed {twice} is given twice")
    if not seeds:  # "0" is a count of none; one seed 0 is "1" (or "0," as a list)
        raise RecipeError(f"--seeds {shown}: give a count of at least 1 (3: seeds 0, 1, 2) or a comma-separated "
                          "list (0,1,2; seed 0 alone: 1)")
    return seeds


def declare_seeds(path: Path, seeds: list[int]) -> dict:
    """The seed plan of a recipe's OUT: the seeds of its first invocation, written to `path` (OUT/plan.json) before
    the first arm runs, against the seeds scored now. A later invocation in the same OUT with more seeds is a run
    extended after a look at its first table, and its table says so (`seed_plan.status`); one with other seeds is
    not the declared run either. The pipelines' README explains why seeds are declared before the run."""
    if path.is_file():
        try:
            declared = json.loads(path.read_text())
            ok = isinstance(declared.get("seeds"), list) and all(type(s) is int for s in declared["seeds"])
        except (ValueError, AttributeError):
            ok = False
        if not ok:
            raise RecipeError(f"{path}: not a seed plan this script wrote (remove it to declare the seeds anew)")
    else:
        declared = {"seeds": seeds, "declared_on": time.strftime("%Y-%m-%d %H:%M:%S")}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")  # a script: vlprep.output is not its public API (docs/API.md)
        tmp.write_text(json.dumps(declared) + "\n")
        os.replace(tmp, path)
    return {**declared, "scored": seeds, "status": seed_status(declared["seeds"], seeds)}


def seed_status(declared: list[int], scored: list[int]) -> str:
    """How the seeds scored relate to those declared before the run: as declared, extended after a look (a superset:
    seeds added once a table had been seen), or other than declared."""
    if set(scored) == set(declared):
        return "as declared"
    if set(scored) > set(declared):
        return "extended after a look"
    return "other than declared"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # paths are read as text and checked before they become Paths: Path("s3://b/x") is the local folder s3:/b/x
    ap.add_argument("recipe", nargs="?", help="pipelines/NAME.yaml (or just NAME)")
    ap.add_argument("--list", action="store_true", help="list the recipes, one line each")
    ap.add_argument("--quick", action="store_true", help="the smoke version: the recipe's quick steps, seeds, arms")
    ap.add_argument("--seeds", help="a count (3: seeds 0, 1, 2) or a list (0,1,2), overriding the recipe's")
    ap.add_argument("--steps", type=int, help="override every arm's steps")
    ap.add_argument("--demo", default=str(DEFAULT_DEMO), help=f"the demo's folder (default {DEFAULT_DEMO})")
    ap.add_argument("--out", help="results folder (default DEMO/ablation/NAME, DEMO/ablation/NAME-quick)")
    ap.add_argument("--arms", help="comma-separated subset of the arms")
    ap.add_argument("--inputs", default=str(HERE / "inputs.yaml"),
                    help="the named inputs and how to build them (default pipelines/inputs.yaml)")
    ap.add_argument("--rescore", metavar="RESULTS.json",
                    help="recompute the summary, findings, table and chart from a results file's rows (no training) "
                    "and write them back beside it")
    ap.add_argument("--update-findings", action="store_true",
                    help="with --rescore: judge the rows against the recipe's current findings (pipelines/NAME.yaml: "
                    "its claims, paper effects, tie margins and the paper's baselines) instead of the file's own")
    args = ap.parse_args(argv)
    try:  # refused in one line before anything is read or built
        if args.steps is not None and args.steps < 1:
            raise RecipeError(f"--steps {args.steps}: give at least 1 (or leave it out for the recipe's steps)")
        if args.seeds is not None:
            parse_seeds(args.seeds, 1)
        for flag in ("recipe", "demo", "out", "rescore", "inputs"):
            value = getattr(args, flag)
            if value is not None:
                setattr(args, flag, Path(check_local(value, "RECIPE" if flag == "recipe" else "--" + flag)))
    except (RecipeError, VlprepError) as e:
        console.print(f"error: {e}", highlight=False, markup=False, soft_wrap=True)
        return 2
    if args.update_findings and args.rescore is None:
        console.print("error: --update-findings goes with --rescore RESULTS.json", highlight=False, markup=False)
        return 2
    if args.rescore is not None:
        return rescore_file(args.rescore, args.update_findings)
    if args.list:
        for p in recipe_paths():
            print(f"{p.stem:<16} {(yaml.safe_load(p.read_text()) or {}).get('about', '')}")
        return 0
    if args.recipe is None:
        ap.error("give a recipe (pipelines/NAME.yaml), or --list")
    path = args.recipe if args.recipe.suffix else HERE / f"{args.recipe}.yaml"
    name = path.stem
    try:
        recipe = load_recipe(path)
        quick = {**QUICK, **recipe.get("quick", {})} if args.quick else {}
        names = (args.arms.split(",") if args.arms else quick.get("arms") or list(recipe["arms"]))
        unknown = [n for n in names if n not in recipe["arms"]]
        if unknown:
            raise RecipeError(f"unknown arm(s) {', '.join(unknown)}; {name} has {', '.join(recipe['arms'])}")
        if len(set(names)) < len(names):
            raise RecipeError(f"--arms {args.arms}: an arm is named twice")
        seeds = parse_seeds(args.seeds, quick.get("seeds", recipe.get("seeds", 3)))
        steps = args.steps or quick.get("steps")
        demo = args.demo.resolve()
        out = args.out or demo / "ablation" / (name + ("-quick" if args.quick else ""))
        inputs = load_inputs(args.inputs)
        logs = demo / "recipes" / "logs"
        ev = recipe["eval"]
        retrieval = None if ev.get("retrieval", "heldout") == "heldout" else ensure(ev["retrieval"], inputs, demo,
                                                                                    logs)
        zeroshot = None
        if ev.get("zeroshot"):
            zeroshot = (ensure(ev["zeroshot"], inputs, demo, logs), Path(fill(ev["classes"], demo)))
        plan = declare_seeds(out / "plan.json", seeds)
        folders, init = {}, {}
        for arm in names:
            folders[arm] = [str(ensure(d, inputs, demo, logs)) for d in recipe["arms"][arm].get("data", [])]
            if not folders[arm]:
                raise RecipeError(f"{name}: arm {arm} names no data")
            init[arm] = arm_init(recipe, arm, inputs, demo, logs)
        rows = []
        for arm, seed in run_order(names, seeds, bool(recipe.get("step_time"))):
            run = out / arm / f"s{seed}"
            res = run_arm(recipe, arm, seed, folders[arm], run, steps, demo, init[arm])
            row = {"arm": arm, "seed": seed, **score(run, res["step"], res, retrieval, zeroshot)}
            if recipe.get("step_time"):  # the run's speed beside its scores (TIMING)
                batch = arm_config(recipe, arm, seed, folders[arm], run, steps, demo).batch_size
                row["step_ms"] = step_ms(run, batch)
            rows.append(derive(row))
        rows.sort(key=lambda r: names.index(r["arm"]))  # arm by arm, each arm's seeds in order (a stable sort)
    except Interrupted as e:
        console.print(f"{str(e).split(':')[0]}: the same command resumes this run", highlight=False, markup=False,
                      soft_wrap=True)
        return 130
    except (RecipeError, ConfigError, TrainError, OSError, yaml.YAMLError, KeyError, ValueError) as e:
        console.print(f"error: {e}", highlight=False, markup=False, soft_wrap=True)
        return 2

    defs = [definition(f) for f in recipe.get("findings", []) if f["better"] in names and f["than"] in names]
    command = "make ablation RECIPE=" + name + (" QUICK=1" if args.quick else "")
    meta = {"command": command, "date": time.strftime("%Y-%m-%d"), "steps": f"{rows[0]['step']} steps",
            "paper": recipe.get("paper", ""), "seed_plan": plan}
    out.mkdir(parents=True, exist_ok=True)
    results = rescore({"recipe": name, "meta": meta, "rows": rows, "findings": defs})
    table, png = write_outputs(out / "results.json", results)
    print_table(results)
    console.print(f"wrote {out}/results.json, {table.name} and {png.name}", highlight=False, markup=False,
                  soft_wrap=True)
    return 0


def recipe_findings(results: dict) -> dict:
    """The results with the finding definitions of its recipe's YAML (those whose arms have rows), in its order."""
    name = results.get("recipe") if isinstance(results, dict) else None
    if not isinstance(name, str) or not (HERE / f"{name}.yaml").is_file():
        raise RecipeError(f"--update-findings: the file's recipe {_kind(name)} is not one of pipelines/*.yaml")
    arms = {r.get("arm") for r in results.get("rows", []) if isinstance(r, dict)}
    recipe = load_recipe(HERE / f"{name}.yaml")
    return {**results, "findings": [definition(f) for f in recipe.get("findings", [])
                                    if f["better"] in arms and f["than"] in arms]}


def rescore_file(path: Path, update_findings: bool = False) -> int:
    """--rescore: the summary, findings, table and chart of a results.json again, from its rows alone (and with
    `update_findings` the findings of the recipe the file names, as pipelines/NAME.yaml defines them now)."""
    try:
        data = read_user_file(path, RESULTS_BYTES, "the results file")  # never a FIFO or /dev/zero
        try:
            results = json.loads(data)
        except UnicodeDecodeError as e:
            raise RecipeError(f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start:,})") from None
        except RecursionError:
            raise RecipeError("malformed JSON: nested too deeply") from None
        except json.JSONDecodeError:
            raise
        except ValueError as e:  # an integer of more than 4,300 digits
            raise RecipeError(f"malformed JSON: {str(e).split(';')[0]}") from None
        if update_findings:
            results = recipe_findings(results)
        results = rescore(results)
        table, png = write_outputs(path, results)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, RecipeError, VlprepError) as e:
        what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        console.print(f"error: {path}: cannot rescore ({what})", highlight=False, markup=False, soft_wrap=True)
        return 2
    print_table(results)
    console.print(f"rescored {path}; wrote {table} and {png}", highlight=False, markup=False, soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
