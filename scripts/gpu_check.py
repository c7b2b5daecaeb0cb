"""The pieces of scripts/gpu-check.sh that are easier in Python: the check's small dataset, the verdict on its
one-process DDP run, the end-to-end rows, and the report (gpu-check.json, gpu-check.md with scripts/gpu_faiss.py's
faiss row and the batch rows, and logs.tar.gz) built from what the steps left in the work folder. Standard library
only (the report runs even where the project's imports would not), and cheap (well under a second): the script
writes it before each step, so a call killed at its limit still leaves one.

    python scripts/gpu_check.py data OUT_DIR N          # N captioned 48 px images as a source folder
    python scripts/gpu_check.py ddp RUN_DIR STEPS LOG   # the DDP run trained STEPS steps through DDP, finite losses
    python scripts/gpu_check.py e2e RUN_DIR CHECK_DIR SIZE PRESET BATCH WARMUP
        # a `scripts/gpu_e2e.py run` from JPEG shards: one row into CHECK_DIR/e2e.jsonl (see `e2e_row`)
    python scripts/gpu_check.py report CHECK_DIR [OUT_DIR] [--quiet]
        # OUT_DIR (default CHECK_DIR): gpu-check.json, gpu-check.md (printed unless --quiet) and logs.tar.gz
"""

import io
import json
import math
import os
import random
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

WORDS = "red green blue cat dog bird tree car boat house sun moon star arrow icon shape".split()
# The benchmark's columns, in this order when a row has them (benchmarks/gpu.py writes the rows).
COLUMNS = ["size", "preset", "params_m", "batch", "precision", "compile", "ckpt", "patch_dropout", "samples_per_s",
           "step_ms", "sync_step_ms", "data_ms", "forward_ms", "backward_ms", "optimizer_ms", "peak_mem_gib",
           "gflop_per_sample", "tflops", "mfu", "mfu_measured", "status"]
# Headings that say what a column is measured against (benchmarks/gpu.py's docstring); the rest print their key.
HEADINGS = {"mfu": "mfu (vendor peak)", "mfu_measured": "mfu (measured peak)",
            "sync_step_ms": "sync_step_ms (parts)"}
# What logs.tar.gz takes from the work folder (the steps' logs and records; not their data), each file cut to its
# last LOG_TAIL bytes so the archive stays far under what a device call brings back (16 MB a file).
LOG_GLOBS = ["*.log", "*.jsonl", "*.txt", "*.xml", "*.json", "e2e-*/*.jsonl", "e2e-*/*.json", "ddp-run/*.jsonl",
             "ddp-run/*.json"]
LOG_TAIL = 2 ** 20
LOG_LIMIT = 15 * 10 ** 6  # logs.tar.gz at most (a device call brings back files of up to 16 MB)
BATCH_PRESETS = ("clip", "albef")  # the presets the batch rows (bench-batch) measure


def make_data(out: Path, n: int) -> None:
    """n small PNGs with same-named .txt captions (seeded), the source `vlprep shards` reads."""
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for i in range(n):
        colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        Image.new("RGB", (48, 48), colour).save(out / f"{i:05d}.png")
        words = " ".join(rng.choice(WORDS) for _ in range(8))
        (out / f"{i:05d}.txt").write_text(f"a picture of {words} number {i}")


def check_ddp(run: Path, steps: int, log: Path) -> list[str]:
    """What is wrong with the DDP run in `run` (empty when nothing is): it reached `steps`, every logged loss is
    finite, and its summary (in `log`) says it trained under DDP."""
    problems = []
    result = run / "result.json"
    if not result.is_file():
        return [f"{result} was not written"]
    got = json.loads(result.read_text()).get("step")
    if got != steps:
        problems.append(f"trained {got} steps, not {steps}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["total"] for r in rows if "total" in r]
    if len(losses) != steps:
        problems.append(f"{len(losses)} loss rows in metrics.jsonl, not {steps}")
    if not all(math.isfinite(x) for x in losses):
        problems.append("a non-finite loss in metrics.jsonl")
    if "x 1 process (DDP" not in log.read_text(errors="replace"):
        problems.append("the run's summary does not say DDP")
    return problems


def junit_counts(path: Path) -> dict:
    """{tests, failures, errors, skipped} of a pytest --junitxml file, with the names of the failed tests."""
    if not path.is_file():
        return {"status": "no report"}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}.{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {**counts, "failed": failed}


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file; none when it is missing, and a line that does not parse (a step killed
    while writing it) left out."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in rows if isinstance(r, dict)]


def cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def bench_table(rows: list[dict], against: str = "vendor") -> list[str]:
    """benchmarks/gpu.py's rows as a markdown table; `against`: what the header says `mfu` divides by (vendor, or
    measured where the card has no vendor figure)."""
    if not rows:
        return ["(no benchmark rows)"]
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    cols += sorted({k for r in rows for k in r} - set(cols) - {"kind"})
    heads = {**HEADINGS, **({} if against == "vendor" else {"mfu": "mfu (no vendor peak: measured)"})}
    lines = ["| " + " | ".join(heads.get(c, c) for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return lines


def pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def step_status(s: dict) -> str:
    """A steps.jsonl record in words: ok, FAILED (rc N), or not run: budget (what the step needed and what was
    left: a step is started only when its limit fits in the budget's rest)."""
    if s.get("skipped"):
        if s.get("needs"):
            return f"not run: {s['skipped']} ({s['needs']} did not run)"
        return (f"not run: {s['skipped']} (limit {s.get('limit')} s + {s.get('grace', 0)} s to stop it, "
                f"{s.get('left')} s left)")
    return "ok" if s.get("rc") == 0 else f"FAILED (rc {s.get('rc')})"


def missing(name: str, file: str, steps: list[dict], prefix: str) -> str:
    """The line a table shows when its file has no rows: the step that should have written them failed, was not run
    for the budget, or was not part of this check."""
    ran = [s for s in steps if s["step"].startswith(prefix)]
    if not ran:
        return f"({name}: not run in this check)"
    if all(s.get("skipped") for s in ran):
        return f"({name}: not run: {ran[0]['skipped']})"
    failed = [f"{s['step']} rc {s['rc']}" for s in ran if not s.get("skipped") and s["rc"] != 0]
    why = f"step {', '.join(failed)}, see its log" if failed else "the step wrote none"
    return f"(no {name} rows: {file} missing or empty; {why})"


def peer_table(rows: list[dict], steps: list[dict]) -> list[str]:
    """benchmarks/peer.py's pair rows: per (batch, compile) both sides' samples/s (or the status of a side that did
    not run), vltrain / open_clip, both MFUs."""
    pairs = [r for r in rows if r.get("kind") == "pair"]
    if not pairs:
        return [missing("peer", "peer.jsonl", steps, "peer")]
    lines = ["| batch | compile | open_clip samples/s | vltrain samples/s | vltrain / open_clip | open_clip MFU | "
             "vltrain MFU |", "|---|---|---|---|---|---|---|"]
    for p in pairs:
        side = {s: cell(p.get(f"{s}_samples_per_s")) if p.get(f"{s}_status") == "ok" else p.get(f"{s}_status")
                for s in ("open_clip", "vltrain")}
        ratio = "n/a" if p.get("ratio") is None else f"{p['ratio']:.2f}x"
        lines.append(f"| {p.get('batch')} | {p.get('compile')} | {side['open_clip']} | {side['vltrain']} | {ratio} | "
                     f"{pct(p.get('open_clip_mfu'))} | {pct(p.get('vltrain_mfu'))} |")
    return lines


E2E_PREFIX = "e2e-"  # the end-to-end steps are e2e-data, then e2e-PRESET for each preset


def e2e_table(rows: list[dict], steps: list[dict]) -> list[str]:
    """The end-to-end rows (`e2e_row`), and a line for each e2e-PRESET step that left no row."""
    runs = [s for s in steps if s["step"].startswith(E2E_PREFIX) and s["step"] != E2E_PREFIX + "data"]
    if not rows and not runs:
        return [missing("end-to-end", "e2e.jsonl", steps, E2E_PREFIX)]
    lines = ["| size | preset | batch | workers | samples/s from shards | synthetic samples/s | shards / synthetic | "
             "data wait | steps timed | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "n/a" if r.get("ratio") is None else f"{r['ratio']:.2f}x"
        lines.append(f"| {r.get('size')} | {r.get('preset')} | {r.get('batch')} | {cell(r.get('workers'))} | "
                     f"{cell(r.get('samples_per_s'))} | {cell(r.get('synthetic_samples_per_s'))} | {ratio} | "
                     f"{pct(r.get('data_wait_share'))} | {cell(r.get('steps_timed'))} | {r.get('status')} |")
    have = {r.get("preset") for r in rows}
    for s in runs:
        preset = s["step"][len(E2E_PREFIX):]
        if preset not in have and s.get("skipped"):
            lines.append(f"| | {preset} | | | | | | | | {step_status(s)} |")
        elif preset not in have:
            lines.append(f"| | {preset} | | | | | | | | no row: step {s['step']} "
                         f"{'rc ' + str(s['rc']) if s['rc'] else 'wrote none'}, see {s['step']}.log |")
    return lines


def batch_table(rows: list[dict], steps: list[dict]) -> list[str]:
    """Samples/s against the batch for clip and albef: per (size, preset), the eager rows (no compile, checkpointing
    or patch dropout) at every batch measured, when there are two or more (bench-eager's 128 and bench-batch's 256,
    512, 1024 on a GPU), the last row of each batch. Beside each: samples/s over the smallest batch's, and the peak
    memory each sample added since the batch before ((peak - peak before) / (batch - batch before)): the slope that
    says how far a card of another size can go; an out-of-memory row keeps its status."""
    groups: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        if (r.get("kind") == "row" and r.get("preset") in BATCH_PRESETS and r.get("compile") == "off"
                and r.get("ckpt") == "off" and not r.get("patch_dropout") and isinstance(r.get("batch"), int)):
            groups.setdefault((r.get("size"), r["preset"]), {})[r["batch"]] = r
    groups = {k: v for k, v in groups.items() if len(v) > 1}
    if not groups:
        return [missing("batch", "bench.jsonl", steps, "bench-batch")]
    lines = ["| size | preset | batch | samples/s | x smallest batch | peak GiB | GiB per added sample | status |",
             "|---|---|---|---|---|---|---|---|"]
    for (size, preset), by_batch in groups.items():
        first, prev = None, None
        for batch in sorted(by_batch):
            r = by_batch[batch]
            ok = r.get("status") == "ok"
            speed = slope = ""
            if ok and first is None:
                first = r
            if ok and first is not r and first.get("samples_per_s"):
                speed = f"{r['samples_per_s'] / first['samples_per_s']:.2f}x"
            if ok and prev is not None and r.get("peak_mem_gib") is not None:
                slope = f"{(r['peak_mem_gib'] - prev['peak_mem_gib']) / (batch - prev['batch']):.4f}"
            lines.append(f"| {size} | {preset} | {batch} | {cell(r.get('samples_per_s')) if ok else ''} | {speed} | "
                         f"{cell(r.get('peak_mem_gib')) if ok else ''} | {slope} | {r.get('status')} |")
            if ok and r.get("peak_mem_gib") is not None:
                prev = r
    return lines


def write_atomic(path: Path, data: bytes) -> None:
    """path's new content, or its old one: a call killed while writing cannot leave half a report."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def pack_logs(check: Path, tail: int = LOG_TAIL, limit: int = LOG_LIMIT) -> bytes:
    """logs.tar.gz's bytes: the files of LOG_GLOBS in `check` (relative names), each cut to its last `tail` bytes,
    and to an eighth of that again while the archive is over `limit` bytes."""
    paths = sorted({p for g in LOG_GLOBS for p in check.glob(g) if p.is_file()})
    while True:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for path in paths:
                data = path.read_bytes()[-tail:]
                info = tarfile.TarInfo(str(path.relative_to(check)))
                info.size, info.mtime = len(data), int(path.stat().st_mtime)
                tar.addfile(info, io.BytesIO(data))
        if len(buf.getvalue()) <= limit or tail < 1024:
            return buf.getvalue()
        tail //= 8


def faiss_table(rows: list[dict], steps: list[dict]) -> list[str]:
    """scripts/gpu_faiss.py's row: faiss and its GPUs, what ran (knn flat/IVF, pseudolabel flat/IVF, GPU against
    CPU), the neighbours compared (knn's and the stage's queries'), ties at the k-th place, mismatches, the output
    files that differ, the verdict and the time."""
    if not rows:
        return [missing("faiss", "faiss.jsonl", steps, "faiss")]
    lines = ["| faiss | GPUs | ran | neighbours compared | ties | mismatches | pseudolabel files differ | verdict | "
             "seconds |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        knn, pseudo = r.get("knn") or [], r.get("pseudolabel") or []
        ran = ", ".join([f"knn {k.get('index')}" for k in knn] + [f"pseudolabel {p.get('index')}" for p in pseudo])
        counts = ["", "", ""]
        if knn or pseudo:  # vlprep.knn's searches and the stage's own queries searched again
            counts = [str(sum(k.get(c, 0) for k in knn + pseudo)) for c in ("neighbours", "ties", "mismatches")]
        files = sum(p.get("files", 0) for p in pseudo)
        differ = f"{sum(len(p.get('files_differ', [])) for p in pseudo)} of {files}" if pseudo else ""
        lines.append(f"| {r.get('faiss') or 'not importable'} | {cell(r.get('gpus'))} | {ran or 'nothing'} | "
                     f"{' | '.join(counts)} | {differ} | {r.get('status')}: {r.get('note', '')} | "
                     f"{cell(r.get('seconds'))} |")
        if r.get("near_dup"):
            lines.append(f"| | | near-dup: {r['near_dup']} | | | | | | |")
    return lines


def e2e_row(run: Path, bench: list[dict], size: str, preset: str, batch: int, warmup: int) -> dict:
    """One end-to-end row from a `scripts/gpu_e2e.py run` in `run`, steps after `warmup` only (start-up, the loader's
    first batches, the allocator and cuDNN settling are left out):
    - samples_per_s: metrics.jsonl's rows after the warm-up (each row's samples_per_s covers the steps since the row
      before): their samples over their summed time, samples / samples_per_s per row;
    - data_wait_share: data_wait.jsonl's time in the main process's wait for batches warmup+1..last over the time
      from the end of batch warmup's wait to the end of the last one's (the same steps). This is host time: the card
      may still be running earlier steps while the host waits, so it bounds the card's idle share from above;
    - synthetic_samples_per_s: benchmarks/gpu.py's eager, un-checkpointed row of the same size, preset and batch in
      bench.jsonl, without patch dropout (the e2e runs keep every token); ratio = shards / synthetic.
    A missing file, or too few steps, gives a row whose status says so."""
    row = {"kind": "e2e", "size": size, "preset": preset, "batch": batch, "warmup": warmup}
    synthetic = [r for r in bench if r.get("kind") == "row" and r.get("size") == size and r.get("preset") == preset
                 and r.get("batch") == batch and r.get("compile") == "off" and r.get("ckpt") == "off"
                 and not r.get("patch_dropout") and r.get("status") == "ok"]
    row["synthetic_samples_per_s"] = synthetic[-1]["samples_per_s"] if synthetic else None
    metrics, waits = read_jsonl(run / "metrics.jsonl"), read_jsonl(run / "data_wait.jsonl")
    logged = [r for r in metrics if "samples_per_s" in r]
    if not logged:
        return {**row, "status": f"no training rows in {run.name}/metrics.jsonl (the run failed: see its log)"}
    prev, samples, seconds = 0, 0, 0.0
    for r in logged:
        if prev >= warmup and r["samples_per_s"] > 0:
            n = (r["step"] - prev) * batch
            samples, seconds = samples + n, seconds + n / r["samples_per_s"]
        prev = r["step"]
    if not samples:
        return {**row, "status": f"no logged step after the {warmup} warm-up steps (run more steps)"}
    row["samples_per_s"] = round(samples / seconds, 2)
    row["steps_timed"] = prev - warmup
    row["ratio"] = round(row["samples_per_s"] / row["synthetic_samples_per_s"], 3) if synthetic else None
    per_step = {w["step"]: w for w in waits if "step" in w}
    last = max(per_step, default=0)
    if (warmup in per_step or warmup == 0) and last > warmup:
        wall = per_step[last]["end_s"] - (per_step[warmup]["end_s"] if warmup else 0.0)
        wait = sum(per_step[k]["wait_s"] for k in range(warmup + 1, last + 1) if k in per_step)
        row["data_wait_share"] = round(wait / wall, 4) if wall > 0 else None
    else:
        row["data_wait_share"] = None
    row["workers"] = waits[0].get("workers") if waits and "step" not in waits[0] else None
    row["status"] = "ok" if row["data_wait_share"] is not None else f"no data_wait.jsonl in {run.name}"
    if row["status"] == "ok" and not synthetic:
        row["status"] = f"no synthetic row ({size} {preset} batch {batch}) in bench.jsonl"
    return row


def report(check: Path, out: Path | None = None, quiet: bool = False) -> int:
    """gpu-check.json, gpu-check.md and logs.tar.gz in `out` (default `check`) from the steps' records in `check`, the
    budget's use (budget.json) and the step running now (running.json, written by the script before it starts one);
    prints the markdown unless quiet; 1 when a step failed or none was recorded (a step not run for the budget is no
    failure)."""
    out = out or check
    out.mkdir(parents=True, exist_ok=True)
    steps = read_jsonl(check / "steps.jsonl")
    running = read_jsonl(check / "running.json")
    budget = (read_jsonl(check / "budget.json") or [{}])[0]
    if "start_epoch" in budget:
        budget["elapsed_s"] = round(time.time() - budget["start_epoch"])
    bench = read_jsonl(check / "bench.jsonl")
    header = [r for r in bench if r.get("kind") == "header"]
    rows = [r for r in bench if r.get("kind") != "header"]
    peer = read_jsonl(check / "peer.jsonl")
    e2e = read_jsonl(check / "e2e.jsonl")
    faiss = read_jsonl(check / "faiss.jsonl")
    env = (check / "env.txt").read_text(errors="replace") if (check / "env.txt").is_file() else ""
    tests = junit_counts(check / "cuda-tests.xml")
    result = {"steps": steps, "running": running[0] if running else None, "budget": budget, "environment": env,
              "cuda_tests": tests, "bench_header": header, "bench": rows, "peer": peer, "e2e": e2e, "faiss": faiss}
    write_atomic(out / "gpu-check.json", (json.dumps(result, indent=1) + "\n").encode())
    md = ["## GPU check", "", "```", env.strip(), "```", ""]
    if budget:
        md += [f"Budget: {budget.get('budget_s')} s ({budget.get('reserve_s')} s of it kept for the report), "
               f"{budget.get('elapsed_s')} s used when this report was written.", ""]
    md += ["| step | status | seconds |", "|---|---|---|"]
    md += [f"| {s['step']} | {step_status(s)} | {s['seconds']:.0f} |" for s in steps]
    md += [f"| {r['step']} | running when this report was written (started at {r.get('started_s')} s, limit "
           f"{r.get('limit')} s): a call killed then ends here | |" for r in running]
    if "tests" in tests:
        md += ["", f"CUDA tests: {tests['tests']} run, {tests['failures'] + tests['errors']} failed, "
                   f"{tests['skipped']} skipped" + (": " + ", ".join(tests["failed"]) if tests["failed"] else "")]
    for h in header:
        md += ["", "Benchmark: " + ", ".join(f"{k} {cell(v)}" for k, v in h.items() if k != "kind")]
    against = header[0].get("mfu_against", "vendor") if header else "vendor"
    md += [""] + (bench_table(rows, against) if rows else [missing("benchmark", "bench.jsonl", steps, "bench")])
    md += ["", "### Samples/s against the batch (bench-eager's and bench-batch's rows)", ""] + batch_table(rows, steps)
    md += ["", "### vltrain against open_clip (benchmarks/peer.py)", ""] + peer_table(peer, steps)
    md += ["", "### End to end: `vltrain run` from JPEG shards against the synthetic-batch row", ""]
    md += e2e_table(e2e, steps)
    md += ["", "### faiss on a GPU against the CPU (scripts/gpu_faiss.py)", ""] + faiss_table(faiss, steps)
    text = "\n".join(md) + "\n"
    write_atomic(out / "gpu-check.md", text.encode())
    write_atomic(out / "logs.tar.gz", pack_logs(check))
    if not quiet:
        print(text)
    return 0 if steps and all(s.get("skipped") or s["rc"] == 0 for s in steps) else 1


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "data":
        make_data(Path(argv[1]), int(argv[2]))
        return 0
    if len(argv) >= 4 and argv[0] == "ddp":
        problems = check_ddp(Path(argv[1]), int(argv[2]), Path(argv[3]))
        print("ddp: " + ("; ".join(problems) if problems else f"{argv[2]} steps through DDP, finite losses"))
        return 1 if problems else 0
    if len(argv) >= 7 and argv[0] == "e2e":
        check = Path(argv[2])
        row = e2e_row(Path(argv[1]), read_jsonl(check / "bench.jsonl"), argv[3], argv[4], int(argv[5]), int(argv[6]))
        with open(check / "e2e.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print("e2e: " + json.dumps(row))
        return 0 if row["status"] == "ok" else 1
    if len(argv) >= 2 and argv[0] == "report":
        paths = [a for a in argv[1:] if a != "--quiet"]
        return report(Path(paths[0]), Path(paths[1]) if len(paths) > 1 else None, quiet="--quiet" in argv)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
