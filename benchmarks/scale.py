"""Scale: every vlprep stage and the trainer's start-up at N = 10K, 100K and 1M samples, with PASS/FAIL against
flat memory and linear time, and an extrapolation to CC3M (3.3M) and CC12M (12M).

The data (seeded, deterministic, made once per N under --work): a Parquet table in 1,000-row groups of image bytes
and captions, and a detections JSONL file.
- Images: a pool of 1,000 distinct 32-64 px JPEG and PNG images of about 1 KB (random colour blocks), each sample
  taking one by its index; every stage still reads, checks and writes each sample's own bytes.
- Captions: 8-20 words, Zipf-distributed over a 20,000-word made-up vocabulary, with articles and about one COCO
  noun in four words (so the ontology has nouns to map).
- Detections: a Poisson(2.9) number of objects per sample, mostly the COCO classes the caption names, scores in
  [0.3, 1).

Each stage runs as a user runs it (`python -m vlprep.cli STAGE ... --workers W`, `python -m vltrain run ...`) in
its own process; this script measures from outside:
- wall seconds, and CPU seconds of the stage's process and every worker it waited for (os.wait4's rusage);
- peak RSS (VmHWM) of the driver and of the largest worker, read from /proc every 0.2 s over the process tree;
- bytes written (the output folder's files), and pages swapped out meanwhile (/proc/vmstat pswpout);
- for `vltrain run`: the seconds to the first optimiser step (when metrics.jsonl first holds step 1) and the whole
  2-step run, its final held-out evaluation included.

The closing table, per stage, compares the largest N with the one before it: CPU seconds per 1K samples within
1.3x, each process's peak within 1.5x, nothing swapped; for the trainer the 2-step run's CPU seconds within 1.6x
from 10K to 100K (CPU, not wall: wall time is inflated by whatever else runs on the cores; wall is shown beside
it) and the start-up of the streamed preset (clip) within 1.3x; the index samplers' (grit, tonics) memory may grow
and is shown without a verdict. `vlprep features` (EfficientNet-Lite0 at 224 px) runs at N <= 10K only. The extrapolation multiplies the largest N's CPU
seconds per sample by 3.3M and 12M and divides by the cores (2 here; 64 Ray workers, assuming the stage spreads as
evenly there, which is an assumption, not a measurement).

    .venv/bin/python benchmarks/scale.py [--sizes 10k,100k,1m] [--stages shards,bow,...] [--workers 2]
                                         [--work DIR] [--json FILE]
"""

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("shards", "bow", "detect", "ontology", "stats", "features", "pseudolabel", "train-clip", "train-grit",
          "train-tonics")
MAX_N = {"features": 10_000}  # EfficientNet-Lite0 at 224 px: about 34 CPU s per 1K samples, so 10K only
GROUP = 1000  # Parquet rows per group, and samples per shard
POOL = 1000  # distinct images
VOCAB = 20_000
TIME_TARGET = 1.3  # CPU s per 1K samples, largest N against the one before
MEMORY_TARGET = 1.5  # each process's peak, likewise
TRAIN_TARGET = 1.6  # a 2-step run with its final evaluation, 100K against 10K
TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.max_len=16", "log_every=1", "data.workers=1"]


def parse_size(s: str) -> int:
    s = s.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "km" else s) * scale)


def size_name(n: int) -> str:
    return f"{n // 1_000_000}m" if n % 1_000_000 == 0 else f"{n // 1000}k" if n % 1000 == 0 else str(n)


# --- the data ---------------------------------------------------------------------------------------------------


def image_pool(rng: np.random.Generator) -> list[bytes]:
    """POOL small images: random 4x4 colour blocks scaled to 32-64 px, alternately JPEG and PNG."""
    from PIL import Image

    out = []
    for i in range(POOL):
        w, h = (int(v) for v in rng.integers(32, 65, size=2))
        blocks = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
        img = Image.fromarray(blocks).resize((w, h), Image.NEAREST)
        buf = io.BytesIO()
        img.save(buf, "JPEG" if i % 2 == 0 else "PNG", **({"quality": 85} if i % 2 == 0 else {}))
        out.append(buf.getvalue())
    return out


def make_data(n: int, folder: Path, seed: int = 0) -> Path:
    """folder/source.parquet (image, caption) and folder/detections.jsonl for n samples, made once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlprep.detect import coco_categories

    done = folder / "done"
    if done.exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    pool = image_pool(rng)
    syll = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "be", "do", "fa", "gu", "pe", "so"]
    words = np.array(["".join(rng.choice(syll, size=int(rng.integers(2, 4)))) + str(i % 7) for i in range(VOCAB)])
    nouns = np.array([c for c in coco_categories() if c.isalpha()])  # one-word class names (no placeholders)
    schema = pa.schema([("image", pa.binary()), ("caption", pa.string())])
    with pq.ParquetWriter(folder / "source.parquet", schema) as table, open(folder / "detections.jsonl", "w") as dets:
        for start in range(0, n, GROUP):
            m = min(GROUP, n - start)
            caps = []
            lines = []
            for i in range(start, start + m):
                length = int(rng.integers(8, 21))
                ranks = np.minimum(rng.zipf(1.2, size=length), VOCAB) - 1
                toks = list(words[ranks])
                named = rng.choice(nouns, size=max(1, length // 4))
                for j, noun in zip(rng.choice(length, size=len(named), replace=False), named):
                    toks[j] = f"the {noun}"
                caps.append("a " + " ".join(toks))
                k = int(rng.poisson(2.9))
                labels = [str(named[j % len(named)]) if rng.random() < 0.7 else str(rng.choice(nouns))
                          for j in range(k)]
                objs = []
                for label in labels:
                    x0, y0 = (float(v) for v in rng.uniform(0, 0.5, size=2))
                    objs.append({"label": label, "score": round(float(rng.uniform(0.3, 1)), 3),
                                 "box": [round(x0, 3), round(y0, 3), round(x0 + 0.4, 3), round(y0 + 0.4, 3)]})
                lines.append(json.dumps({"key": f"shard_{i:09d}", "objects": objs}))
            table.write_table(pa.table({"image": [pool[i % POOL] for i in range(start, start + m)], "caption": caps},
                                       schema=schema), row_group_size=GROUP)
            dets.write("\n".join(lines) + "\n")
    done.touch()
    return folder


# --- measuring a process tree -----------------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    """{ppid: [pid, ...]} of every process now."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(name))
    return out


def _hwm(pid: int) -> int:
    """The process's peak resident set (VmHWM) in bytes, 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _swapped_out() -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("pswpout "):
            return int(line.split()[1])
    return 0


def measure(cmd: list[str], out: Path, log: Path, first_step: Path | None = None) -> dict:
    """Run cmd; its wall and CPU seconds, the driver's and the largest worker's peak RSS, pages swapped out, bytes
    in `out`, and (first_step: a metrics.jsonl) the seconds until it first holds step 1."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    swap0 = _swapped_out()
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    peaks: dict[int, int] = {}
    to_step = None
    status = None
    while status is None:
        kids = _children()
        tree = [proc.pid]
        for pid in tree:
            tree.extend(kids.get(pid, []))
        for pid in tree:
            peaks[pid] = max(peaks.get(pid, 0), _hwm(pid))
        if first_step is not None and to_step is None and first_step.exists() and '"step": 1,' in first_step.read_text():
            to_step = time.perf_counter() - t0
        got, wait_status, usage = os.wait4(proc.pid, os.WNOHANG)
        if got:
            status = os.waitstatus_to_exitcode(wait_status)
            break
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    workers = [v for pid, v in peaks.items() if pid != proc.pid]
    written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out.exists() else 0
    return {"rc": status, "wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "driver_peak": peaks[proc.pid],
            "worker_peak": max(workers, default=0), "swapped_pages": _swapped_out() - swap0, "written": written,
            "to_step1": to_step}


# --- the stages -------------------------------------------------------------------------------------------------


def vlprep(*args) -> list[str]:
    return [sys.executable, "-m", "vlprep.cli", *map(str, args)]


def vltrain_run(shards: Path, out: Path, preset: str) -> list[str]:
    sets = [x for s in TINY + (["model.fusion_layers=1", "model.queue_size=16"] if preset != "clip" else [])
            for x in ("--set", s)]
    return [sys.executable, "-m", "vltrain", "run", str(shards), "--out", str(out), "--preset", preset,
            "--steps", "2", "--batch-size", "32", "--device", "cpu", *sets]


def checkpoint(work: Path, shards: Path) -> Path:
    """A 1-step tiny clip checkpoint for pseudolabel's encoder, made once."""
    ckpt = work / "tiny-clip" / "last.pt"
    if not ckpt.exists():
        shutil.rmtree(ckpt.parent, ignore_errors=True)
        r = subprocess.run(vltrain_run(shards, ckpt.parent, "clip"), cwd=ROOT, capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if r.returncode != 0:
            raise SystemExit(f"error: the pseudolabel checkpoint's run failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return ckpt


def stage_command(stage: str, n_dir: Path, data: Path, work: Path, workers: int) -> tuple[list[str], Path]:
    """(command, output folder) of one stage at one size; the stages read each other's outputs in STAGES order."""
    out = n_dir / stage
    shards = n_dir / "shards"
    w = ["--workers", workers]
    if stage == "shards":
        return vlprep("shards", data / "source.parquet", out, "-n", GROUP, *w), out
    if stage == "bow":  # without rmtop: the default rmtop:1000 takes most of a Zipf caption's words, and emptied
        # 90% of these captions (dropped samples are not written, which would flatter the stage)
        return vlprep("bow", shards, out, "--ops", "shuffle,rmstop,basevocab,keep:4", *w), out
    if stage == "detect":
        return vlprep("detect", shards, out, "--from-file", data / "detections.jsonl", *w), out
    if stage == "ontology":
        return vlprep("ontology", n_dir / "detect", out, *w), out
    if stage == "stats":
        return vlprep("stats", shards, "--out", out), out
    if stage == "features":
        return vlprep("features", shards, out, "--device", "cpu", *w), out
    if stage == "pseudolabel":  # ALIGNED is the N-sample set; UNALIGNED 1,000 other samples, the same at every N
        unaligned = work / "unaligned"
        if not (unaligned / "meta.json").exists():
            src = make_data(GROUP, work / "unaligned-src", seed=1)
            r = subprocess.run(vlprep("shards", src / "source.parquet", unaligned, "--workers", 1, "--overwrite"),
                               cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            if r.returncode != 0:
                raise SystemExit(f"error: the unaligned set failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        return vlprep("pseudolabel", shards, unaligned, out, "--checkpoint", checkpoint(work, shards),
                      "--device", "cpu", *w), out
    preset = stage.split("-", 1)[1]
    src = n_dir / "ontology" if preset == "tonics" else shards
    return vltrain_run(src, out, preset), out


# --- the verdicts -----------------------------------------------------------------------------------------------


def exponent(sizes: list[int], values: list[float]) -> float:
    """The least-squares slope of log(value) on log(N): 1 is linear, 0 flat."""
    if len(sizes) < 2 or min(values) <= 0:
        return float("nan")
    return float(np.polyfit(np.log(sizes), np.log(values), 1)[0])


def verdicts(results: dict[str, dict[int, dict]]) -> list[dict]:
    """The closing table's rows: for each stage, the largest N against the one before it."""
    rows = []
    for stage, by_n in results.items():
        sizes = sorted(n for n, r in by_n.items() if r["rc"] == 0)
        failed = sorted(n for n, r in by_n.items() if r["rc"] != 0)
        for n in failed:
            rows.append(common.value_row(f"{stage} {size_name(n)} ran", 0, 1, "exit 0", note=f"rc {by_n[n]['rc']}"))
        if sizes:
            rows.append(common.value_row(f"{stage} swap", sum(by_n[n]["swapped_pages"] for n in sizes), 0,
                                         "pages out, all N", higher_is_better=False))
        if len(sizes) < 2:
            continue
        small, large = sizes[-2], sizes[-1]
        a, b = by_n[small], by_n[large]
        span = f"{size_name(large)} / {size_name(small)}"
        if stage.startswith("train-"):
            if 10_000 in by_n and 100_000 in by_n and by_n[10_000]["rc"] == by_n[100_000]["rc"] == 0:
                ten, hundred = by_n[10_000], by_n[100_000]
                rows.append(common.value_row(f"{stage} run CPU 100k / 10k", hundred["cpu"] / ten["cpu"], TRAIN_TARGET,
                                             "x", higher_is_better=False, note="2 steps + final evaluation"))
                rows.append(common.value_row(f"{stage} run wall 100k / 10k", hundred["wall"] / ten["wall"], None,
                                             "x", higher_is_better=False))
            rows.append(common.value_row(f"{stage} run CPU {span}", b["cpu"] / a["cpu"], None, "x",
                                         higher_is_better=False, note="2 steps + final evaluation"))
            if stage == "train-clip" and a["to_step1"] and b["to_step1"]:
                rows.append(common.value_row(f"{stage} start-up {span}", b["to_step1"] / a["to_step1"], TIME_TARGET,
                                             "x", higher_is_better=False, note="to the first step, wall"))
        else:
            rows.append(common.value_row(f"{stage} CPU/1K {span}", (b["cpu"] / large) / (a["cpu"] / small),
                                         TIME_TARGET, "x", higher_is_better=False))
        for part in ("driver_peak", "worker_peak"):
            if a[part] and b[part]:
                target = MEMORY_TARGET if not stage.startswith("train-") or stage == "train-clip" else None
                rows.append(common.value_row(f"{stage} {part.split('_')[0]} RSS {span}", b[part] / a[part], target,
                                             "x", higher_is_better=False))
    return rows


def print_sizes(results: dict[str, dict[int, dict]]) -> None:
    """Per stage and N: CPU and wall s per 1K samples, peaks, bytes written per sample, the growth exponents."""
    print(f"\n{'stage':<14} {'N':>5} {'wall s':>8} {'cpu s':>8} {'cpu s/1K':>9} {'driver MB':>10} {'worker MB':>10} "
          f"{'B/sample':>9} {'to step 1':>9}")
    for stage, by_n in results.items():
        for n in sorted(by_n):
            r = by_n[n]
            step = f"{r['to_step1']:.1f}" if r.get("to_step1") else "-"
            print(f"{stage:<14} {size_name(n):>5} {r['wall']:>8.1f} {r['cpu']:>8.1f} {1000 * r['cpu'] / n:>9.3f} "
                  f"{r['driver_peak'] / 2**20:>10.0f} {r['worker_peak'] / 2**20:>10.0f} "
                  f"{r['written'] / n:>9.0f} {step:>9}" + ("" if r["rc"] == 0 else f"  (exit {r['rc']})"))
        ok = sorted(n for n in by_n if by_n[n]["rc"] == 0)
        if len(ok) >= 2:
            print(f"{'':<14} growth exponent over N: CPU {exponent(ok, [by_n[n]['cpu'] for n in ok]):.2f}, driver "
                  f"RSS {exponent(ok, [by_n[n]['driver_peak'] for n in ok]):.2f}")


def print_extrapolation(results: dict[str, dict[int, dict]], workers: int) -> None:
    """Hours for 3.3M and 12M samples from the largest measured N's CPU seconds per sample (extrapolated)."""
    print("\nextrapolated from the largest N measured (CPU s per sample x N / workers; not measured):")
    print(f"{'stage':<14} {'from N':>7} {'3.3M, ' + str(workers) + ' cores':>16} {'12M, ' + str(workers) + ' cores':>15} "
          f"{'3.3M, 64 Ray':>13} {'12M, 64 Ray':>12}")
    for stage, by_n in results.items():
        ok = sorted(n for n in by_n if by_n[n]["rc"] == 0)
        if not ok or stage.startswith("train-"):
            continue
        per = by_n[ok[-1]]["cpu"] / ok[-1]
        cells = [per * total / cores / 3600 for cores in (workers, 64) for total in (3.3e6, 12e6)]
        print(f"{stage:<14} {size_name(ok[-1]):>7} {cells[0]:>14.2f} h {cells[1]:>13.2f} h {cells[2]:>11.2f} h "
              f"{cells[3]:>10.2f} h")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10k,100k,1m", help="comma-separated N (10k, 100k, 1m, ...)")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    ap.add_argument("--workers", type=int, default=2, help="--workers of every vlprep stage")
    ap.add_argument("--work", type=Path, default=Path("/tmp/vlprep-scale"),
                    help="where the data and the outputs go (the data, and a stage's complete output that is only "
                         "another stage's input, are kept and reused)")
    ap.add_argument("--json", type=Path, default=None, help="also write every measurement here")
    ap.add_argument("--report", type=Path, nargs="+", default=None, metavar="JSON",
                    help="run nothing: print the tables of earlier runs' --json files, merged (a later file's "
                         "measurement of a stage at a size replaces an earlier one's)")
    args = ap.parse_args()
    if args.report:
        results: dict[str, dict[int, dict]] = {}
        workers = args.workers
        for path in args.report:
            got = json.loads(path.read_text())
            workers = got["workers"]
            for stage, by_n in got["results"].items():
                results.setdefault(stage, {}).update({int(n): r for n, r in by_n.items()})
        results = {s: results[s] for s in STAGES if s in results}
        print_sizes(results)
        print_extrapolation(results, workers)
        common.print_table(verdicts(results), candidate="value")
        return
    sizes = sorted(parse_size(s) for s in args.sizes.split(","))
    stages = [s.strip() for s in args.stages.split(",")]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise SystemExit(f"error: unknown stage {unknown[0]} (choose from {', '.join(STAGES)})")
    print(common.load_line("start"))
    results: dict[str, dict[int, dict]] = {s: {} for s in stages}
    for n in sizes:
        t0 = time.perf_counter()
        data = make_data(n, args.work / "data" / size_name(n))
        print(f"\n== N = {n:,} (data ready in {time.perf_counter() - t0:.0f} s)", flush=True)
        n_dir = args.work / "runs" / size_name(n)
        n_dir.mkdir(parents=True, exist_ok=True)
        for stage in STAGES:
            needed = stage in stages or any(later in stages for later in needs(stage))
            if not needed or n > MAX_N.get(stage, n):
                continue
            cmd, out = stage_command(stage, n_dir, data, args.work, args.workers)
            if stage not in stages and (out / "report.json").exists():
                continue  # only another stage's input, and complete from an earlier run: reused
            shutil.rmtree(out, ignore_errors=True)
            r = measure(cmd, out, n_dir / f"{stage}.log", out / "metrics.jsonl" if stage.startswith("train") else None)
            if stage in stages:
                results[stage][n] = r
            print(f"  {stage}: exit {r['rc']}, {r['wall']:.1f} s wall, {r['cpu']:.1f} s CPU, driver "
                  f"{r['driver_peak'] / 2**20:.0f} MB, largest worker {r['worker_peak'] / 2**20:.0f} MB"
                  + ("" if r["rc"] == 0 else f" (log: {n_dir / (stage + '.log')})"), flush=True)
    print_sizes(results)
    print_extrapolation(results, args.workers)
    rows = verdicts(results)
    common.print_table(rows, candidate="value")
    print(common.load_line("end"))
    if args.json:
        args.json.write_text(json.dumps({"sizes": sizes, "workers": args.workers, "results": {
            s: {str(n): r for n, r in by_n.items()} for s, by_n in results.items()}, "rows": rows}, indent=1))


def needs(stage: str) -> tuple[str, ...]:
    """The stages whose input `stage` makes (so it runs when only they are asked for)."""
    return {"shards": STAGES[1:], "detect": ("ontology", "train-tonics"), "ontology": ("train-tonics",)}.get(stage, ())


if __name__ == "__main__":
    main()
