"""The pieces of scripts/gpu-check.sh that are easier in Python: the check's small dataset, the verdict on its
one-process DDP run, and the report (gpu-check.json and gpu-check.md) built from what the steps left in the output
folder. Standard library only (the report runs even where the project's imports would not).

    python scripts/gpu_check.py data OUT_DIR N          # N captioned 48 px images as a source folder
    python scripts/gpu_check.py ddp RUN_DIR STEPS LOG   # the DDP run trained STEPS steps through DDP, finite losses
    python scripts/gpu_check.py report CHECK_DIR        # gpu-check.json + gpu-check.md, and print the table
"""

import json
import math
import random
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

WORDS = "red green blue cat dog bird tree car boat house sun moon star arrow icon shape".split()
# The benchmark's columns, in this order when a row has them (benchmarks/gpu.py writes the rows).
COLUMNS = ["size", "preset", "params_m", "batch", "precision", "compile", "ckpt", "samples_per_s", "step_ms", "data_ms",
           "forward_ms", "backward_ms", "optimizer_ms", "peak_mem_gib", "tflops", "mfu", "status"]


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
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def bench_table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(no benchmark rows)"]
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    cols += sorted({k for r in rows for k in r} - set(cols) - {"kind"})
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return lines


def report(check: Path) -> int:
    """gpu-check.json and gpu-check.md from the steps' records in `check`; prints the markdown; 1 when a step
    failed."""
    steps = read_jsonl(check / "steps.jsonl")
    bench = read_jsonl(check / "bench.jsonl")
    header = [r for r in bench if r.get("kind") == "header"]
    rows = [r for r in bench if r.get("kind") != "header"]
    env = (check / "env.txt").read_text(errors="replace") if (check / "env.txt").is_file() else ""
    tests = junit_counts(check / "cuda-tests.xml")
    out = {"steps": steps, "environment": env, "cuda_tests": tests, "bench_header": header, "bench": rows}
    (check / "gpu-check.json").write_text(json.dumps(out, indent=1) + "\n")
    md = ["## GPU check", "", "```", env.strip(), "```", "", "| step | status | seconds |", "|---|---|---|"]
    md += [f"| {s['step']} | {'ok' if s['rc'] == 0 else 'FAILED (rc ' + str(s['rc']) + ')'} | {s['seconds']:.0f} |"
           for s in steps]
    if "tests" in tests:
        md += ["", f"CUDA tests: {tests['tests']} run, {tests['failures'] + tests['errors']} failed, "
                   f"{tests['skipped']} skipped" + (": " + ", ".join(tests["failed"]) if tests["failed"] else "")]
    for h in header:
        md += ["", "Benchmark: " + ", ".join(f"{k} {cell(v)}" for k, v in h.items() if k != "kind")]
    md += [""] + bench_table(rows)
    text = "\n".join(md) + "\n"
    (check / "gpu-check.md").write_text(text)
    print(text)
    return 0 if steps and all(s["rc"] == 0 for s in steps) else 1


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "data":
        make_data(Path(argv[1]), int(argv[2]))
        return 0
    if len(argv) >= 4 and argv[0] == "ddp":
        problems = check_ddp(Path(argv[1]), int(argv[2]), Path(argv[3]))
        print("ddp: " + ("; ".join(problems) if problems else f"{argv[2]} steps through DDP, finite losses"))
        return 1 if problems else 0
    if len(argv) >= 2 and argv[0] == "report":
        return report(Path(argv[1]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
