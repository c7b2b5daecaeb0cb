"""What every benchmark script shares: the machine's load average, interleaved timing of the sides of a comparison
(optionally each timed run in a fresh Python process, `--isolate`), and the ratio rows of the closing table.

A benchmark builds its sides as `{name: fn(out: Path) -> None}` after its set-up (input data in a folder it owns),
then calls `time_sides`. Each timed call gets a fresh empty `out` folder, created before and removed after the
clock. Rounds alternate the order of the sides (forward, reversed, forward, ...), so neither side always runs
first after the other has warmed the caches.

With `--isolate`, each timed call is instead one run of the same script in a new process:
`python SCRIPT <same options> --side NAME --side-dir DIR`, where DIR is the set-up folder. The script calls
`run_child(args, sides)` right after building its sides; in the child it times the one call and prints a JSON
line, so no imports, allocator pools or page-cache-warm Python objects leak from one side into the other. The
child's clock starts after its own imports and set-up, like the parent's.
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

Side = Callable[[Path], None]


def load_line(when: str) -> str:
    """'load average at start: 0.52 0.61 0.70 (1, 5, 15 min; 2 cores)'."""
    one, five, fifteen = os.getloadavg()
    return f"load average at {when}: {one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min; {os.cpu_count()} cores)"


def add_options(ap: argparse.ArgumentParser) -> None:
    """--isolate, and the two hidden options the parent passes to a child run."""
    ap.add_argument("--isolate", action="store_true",
                    help="run every timed call of every side in its own fresh Python process")
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--side-dir", type=Path, default=None, help=argparse.SUPPRESS)


def cpu_now() -> float:
    """User + system CPU seconds of this process and of its waited-for children (worker processes)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # microseconds; os.times() counts 10 ms ticks
    return time.process_time() + children.ru_utime + children.ru_stime


def _timed(fn: Side, scratch: Path) -> tuple[float, float]:
    d = _timed_figures(fn, scratch, figures=False)
    return d["wall"], d["cpu"]


def run_child(args: argparse.Namespace, sides: dict[str, Side]) -> None:
    """In a child started by `time_sides(isolate=True)`: time one call of `args.side`, print it, exit. Otherwise
    return at once."""
    run_child_figures(args, sides, figures=False)


def _child(name: str, data_dir: Path) -> tuple[float, float]:
    d = _child_figures(name, data_dir)
    return d["wall"], d["cpu"]


def time_sides(sides: dict[str, Side], repeats: int, scratch: Path, isolate: bool = False, warmup: int = 1,
               label: str = "") -> dict[str, dict[str, list[float]]]:
    """{side: {"wall": [s, ...], "cpu": [s, ...]}} over `repeats` rounds of alternating order.

    In-process, `warmup` untimed rounds come first (lazy imports, first-call caches). Isolated, every timed call
    is a fresh process started on `scratch` (which must hold what the script's set-up needs), and there is no
    warm-up: paying the first call is what isolation measures.
    """
    names = list(sides)
    times = {n: {"wall": [], "cpu": []} for n in names}
    if not isolate:
        for _ in range(warmup):
            for n in names:
                _timed(sides[n], scratch)
    for r in range(repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            wall, cpu = _child(n, scratch) if isolate else _timed(sides[n], scratch)
            times[n]["wall"].append(wall)
            times[n]["cpu"].append(cpu)
        print(f"  {label}round {r + 1}/{repeats}: "
              + ", ".join(f"{n} {times[n]['wall'][-1]:.3f} s" for n in names), flush=True)
    return times


def cpu_ms_per_call(sides: dict, items: list, rounds: int) -> dict[str, list[float]]:
    """{side: [CPU ms per call, one per round]} of `fn(item, index)` over every item, for each side of `sides`
    ({name: fn}) in this process; the sides' order reverses every round so neither always goes first. CPU time
    (time.process_time), not wall time: steadier than the wall clock on a shared machine."""
    names = list(sides)
    cpu = {n: [] for n in names}
    for r in range(rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            t = time.process_time()
            for i, x in enumerate(items):
                sides[n](x, i)
            cpu[n].append((time.process_time() - t) / len(items) * 1e3)
    return cpu


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def ratio_row(name: str, base: dict[str, list[float]], cand: dict[str, list[float]], target: float | None,
              higher_is_worse: bool = True, note: str = "") -> dict:
    """One closing-table row: medians of wall and CPU time of each side and their ratio against the target
    (`target` None: informational, no verdict)."""
    r = {"name": name, "base": median(base["wall"]), "cand": median(cand["wall"]), "target": target, "note": note,
         "base_cpu": median(base["cpu"]), "cand_cpu": median(cand["cpu"])}
    r["ratio"] = r["cand"] / r["base"]
    r["cpu_ratio"] = r["cand_cpu"] / r["base_cpu"] if r["base_cpu"] > 0 else float("nan")
    if target is None:
        r["result"] = "info"
    else:
        ok = r["ratio"] <= target if higher_is_worse else r["ratio"] >= target
        r["result"] = "PASS" if ok else "FAIL"
    print(f"  {name}: median baseline {r['base']:.3f} s, candidate {r['cand']:.3f} s, ratio {r['ratio']:.2f}x "
          f"(CPU time ratio {r['cpu_ratio']:.2f}x)"
          + (f", target <= {target}x" if target is not None else ", informational"), flush=True)
    return r


def value_row(name: str, value: float, target: float | None, unit: str = "", higher_is_better: bool = True,
              note: str = "") -> dict:
    """A closing-table row for a measure that is not a time ratio (a rate, a peak size): its value against the
    target (`target` None: informational)."""
    if target is None:
        result = "info"
    else:
        result = "PASS" if (value >= target if higher_is_better else value <= target) else "FAIL"
    return {"name": name, "value": value, "target": target, "unit": unit, "result": result, "note": note,
            "higher_is_better": higher_is_better}


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def print_table(rows: list[dict], candidate: str = "candidate") -> None:
    """The closing table: one line per row, PASS / FAIL against its target, 'info' for informational rows.

    Rows come from `ratio_row` (two timed sides) or `value_row` (one measured value, printed in the candidate
    column with its unit)."""
    print(f"\n{'measure':<28} {'baseline s':>10} {candidate + ' s':>12} {'ratio':>7} {'cpu ratio':>9} {'target':>10}"
          "  result")
    for r in rows:
        note = f"  ({r['note']})" if r["note"] else ""
        if "value" in r:
            sign = ">=" if r["higher_is_better"] else "<="
            target = f"{sign} {_num(r['target'])}" if r["target"] is not None else "-"
            value = _num(r["value"])
            print(f"{r['name']:<28} {'-':>10} {value:>12} {'-':>7} {'-':>9} {target:>10}  {r['result']}  "
                  f"[{r['unit']}]{note}")
            continue
        target = f"<= {r['target']}x" if r["target"] is not None else "-"
        print(f"{r['name']:<28} {r['base']:>10.3f} {r['cand']:>12.3f} {r['ratio']:>6.2f}x {r['cpu_ratio']:>8.2f}x "
              f"{target:>10}  {r['result']}{note}")


# --- sides that measure themselves --------------------------------------------------------------------------------
# Some comparisons are per training step, timed inside the call (the gaps between batch fetches), not the whole
# call: set-up such as building a model would otherwise dilute the ratio. Such a side returns {figure: value};
# these functions are time_sides / run_child with those figures carried along (in the child's JSON line too).

Measured = Callable[[Path], dict]


def _timed_figures(fn: Measured, scratch: Path, figures: bool = True) -> dict:
    """{"wall", "cpu"} of one call in a fresh output folder, plus the figures the call returned (`figures`; a
    plain Side's return value is ignored)."""
    out = Path(tempfile.mkdtemp(prefix="out-", dir=scratch))
    try:
        c0 = cpu_now()
        t0 = time.perf_counter()
        result = fn(out)
        return {"wall": time.perf_counter() - t0, "cpu": cpu_now() - c0, **(result if figures else {})}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run_child_figures(args: argparse.Namespace, sides: dict[str, Measured], figures: bool = True) -> None:
    """`run_child` for sides that return figures: the child's JSON line holds them beside wall and cpu."""
    if args.side is None:
        return
    if args.side not in sides:
        sys.exit(f"--side {args.side}: not one of {', '.join(sides)}")
    print(json.dumps({"side": args.side, **_timed_figures(sides[args.side], args.side_dir, figures)}), flush=True)
    sys.exit(0)


def _child_figures(name: str, data_dir: Path) -> dict:
    argv = [a for a in sys.argv[1:] if a != "--isolate"]
    r = subprocess.run([sys.executable, sys.argv[0], *argv, "--side", name, "--side-dir", str(data_dir)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"isolated run of side {name!r} failed:\n{r.stderr[-3000:]}")
    last = json.loads(r.stdout.strip().splitlines()[-1])
    last.pop("side")
    return last


def time_sides_figures(sides: dict[str, Measured], repeats: int, scratch: Path, isolate: bool = False,
                       warmup: int = 1, label: str = "", show: str = "wall",
                       scale: float = 1.0, unit: str = "s") -> dict[str, dict[str, list[float]]]:
    """`time_sides` for sides that return figures: {side: {"wall": [...], "cpu": [...], figure: [...], ...}}.

    Same alternating rounds, warm-up and isolation; each round's line shows figure `show` x `scale` in `unit`.
    """
    names = list(sides)
    times: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    if not isolate:
        for _ in range(warmup):
            for n in names:
                _timed_figures(sides[n], scratch)
    for r in range(repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            got = _child_figures(n, scratch) if isolate else _timed_figures(sides[n], scratch)
            for k, v in got.items():
                times[n].setdefault(k, []).append(v)
        print(f"  {label}round {r + 1}/{repeats}: "
              + ", ".join(f"{n} {times[n][show][-1] * scale:.3f} {unit}" for n in names), flush=True)
    return times


def print_table_ms(rows: list[dict], candidate: str = "candidate") -> None:
    """`print_table` for per-step (or per-sample) rows: baseline and candidate in milliseconds."""
    print(f"\n{'measure':<34} {'baseline ms':>11} {candidate + ' ms':>13} {'ratio':>7} {'cpu ratio':>9} "
          f"{'target':>8}  result")
    for r in rows:
        target = f"<= {r['target']}x" if r["target"] is not None else "-"
        print(f"{r['name']:<34} {r['base'] * 1e3:>11.2f} {r['cand'] * 1e3:>13.2f} {r['ratio']:>6.2f}x "
              f"{r['cpu_ratio']:>8.2f}x {target:>8}  {r['result']}{'  (' + r['note'] + ')' if r['note'] else ''}")


def peak_bytes(fn, device) -> int:
    """The most bytes torch holds at once during fn() above what it held when fn began: on CUDA the caching
    allocator's own count (max_memory_allocated less memory_allocated at the start); on a CPU the running sum, in
    time order, of every allocation (+bytes) and free (-bytes) torch.profiler records with profile_memory=True.
    Memory outside torch's allocator (Python objects, a tokenizer) is not counted on either device."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = 0
    peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak
