#!/usr/bin/env bash
# The GPU check: everything this project can only prove on a CUDA device, in ONE call that fits a short offline GPU
# slot. The device tool allows one command of at most 600 s (and 15 minutes of device time per session, the
# machine's start included), so the steps share a total budget (--budget, default 540 s, from the script's start,
# the wheels' install included): a step is started only when its limit, plus the 5 s its kill may take, fits in
# what is left of the budget less 15 s kept for the report; one that does not fit is recorded in steps.jsonl as
# skipped for budget ("not run: budget" in the report: not a failure) and the next, smaller one may still fit.
# Steps in priority order (what only a GPU can prove and what open work needs first), each limit sized from the
# three recorded H200 calls of 2026-11-27 (benchmarks/README.md) or, where not yet run, from an estimate:
#   step            limit  recorded on an H200 (or estimated)
#   env               30   15-18 s                 the device, driver, Python, torch; vltrain and vlprep import
#   cuda-tests        80   47-52 s (12 tests)      the tests marked `cuda` (VLTRAIN_REQUIRE_CUDA=1: a skip fails)
#   bench-eager      160   est. 115 s              benchmarks/gpu.py, base clip, albef, grit, softmask, batch 128,
#                                                  bf16, 3 runs of 30 unsynchronised steps (96 steps a row at 124-286
#                                                  ms, about 5 s to build each row): the synthetic rows e2e compares
#   e2e-data          40   est. 10-20 s            2,000 photograph-like JPEGs, each written 4 times into shards by
#                                                  vlprep's shard writer (scripts/gpu_e2e.py shards)
#   e2e-clip          75   est. 40-60 s            `vltrain run` from those shards, bench-eager's base towers, bf16,
#   e2e-albef         90   est. 45-70 s            batch 128, 40 steps, data.workers auto: samples/s over steps
#                                                  11-40 against bench-eager's row, and the data-wait share
#   peer             150   est. 90 s               benchmarks/peer.py: vltrain against open_clip's own step on the
#                                                  same ViT-B-16 towers, batch 256, eager (each side's process at
#                                                  most 60 s; the compiled pair and the full grid: a call of their own)
#   bench-compile    110   71 s (cold cache)       base clip, batch 128, train.compile=step
#   bench-batch      120   est. 85 s               base clip and albef at batch 256, 512, 1024 (128 is bench-eager's
#                                                  row; an out-of-memory row says so): 2 runs of 4 steps a row
#   bench-patchdrop   50   est. 25 s               base clip, batch 128, model.patch_dropout=0.5 (FLIP)
#   faiss             50   est. 15-20 s            faiss on the GPU against the CPU (scripts/gpu_faiss.py; skipped,
#                                                  not failed, where the node's faiss has no GPU support)
#   ddp               50   29-34 s                 a one-process torchrun run on NCCL for 20 steps
#   memory-accum      50   29-34 s                 peak memory of a base step at train.accum_steps 1, 2, 4
#   bench-small      110   est. 80 s               the small towers' rows (clip, albef, grit, softmask, batch 128)
#   bench-max-batch  130   71-117 s                base albef batch 64 and the largest batch, checkpointing off/on
# Why this order: the environment and the CUDA tests are the check's proof; bench-eager's base rows are what the
# end-to-end rows (the loader's targets) divide by; then the open_clip ratio, compile, the batch rows; patch dropout,
# faiss, DDP and accumulation memory are small and fill what is left; the small towers and the max-batch search have
# been measured three times. Of the 525 s the steps may use, the limits (with each kill's 5 s) guarantee env through
# e2e-albef (505 s, so with a wheels' install under 20 s); with the recorded and estimated times (env 17, cuda-tests
# 52, bench-eager about 115, e2e about 125: about 315 s with the install) peer (155 s with its kill's 5) and
# bench-compile (115) should follow, about 480 s, and what is left (about 45 s) fits none of the later steps unless
# the earlier ones ran faster: bench-batch, faiss, ddp, memory-accum, bench-small and bench-max-batch then need a
# call of their own, --only bench-batch,bench-patchdrop,faiss,ddp,memory-accum,... (about 300 s by their estimates).
# e2e-clip and e2e-albef need e2e-data, and bench-eager's rows to compare with.
#
# What comes back: OUT_DIR holds three files only, gpu-check.md, gpu-check.json and logs.tar.gz (every step's log and
# record, each cut to its last MiB), rewritten before each step (with the step about to run marked as running), so a
# call killed at its limit still leaves a report of every step before; the steps' data (shards, runs) lives in
# WORK_DIR (default: a temporary folder, removed at the end). With the device tool, one call with timeout_s 600:
#
#   bash scripts/gpu-check.sh --out $OUT/check        (then --budget 540, the default)
#   bash scripts/gpu-check.sh [--dry-run] [--budget SECONDS] [--only STEP,...] [--out OUT_DIR] [--work WORK_DIR]
#       (default OUT_DIR: gpu-check-out)
#
# The node needs a Python with torch, torchvision, transformers, timm, typer, pandas, pyarrow, safetensors, rich,
# matplotlib, tensorboard and pytest; the rest comes from .gpu/ (`bash scripts/gpu-wheels.sh` on a machine with
# PyPI), installed here with pip --no-index into .gpu/site.
# --dry-run runs the same steps on this machine's CPU at tiny sizes with the project's .venv (no wheels, the CUDA
# tests skip; the GPU-only steps are left out), in under 3 minutes: it is how the script is tested without a GPU.
# Exit status: 0 when no step failed (a step not run for the budget is no failure), 1 when one failed (the others
# still ran), 2 for a usage error.
set -uo pipefail
SECONDS=0  # the budget counts from here, the wheels' install included
cd "$(dirname "$0")/.."
ROOT=$PWD
USAGE="usage: scripts/gpu-check.sh [--dry-run] [--budget SECONDS] [--only STEP,...] [--out OUT_DIR] [--work WORK_DIR]"
# every step, in the order they run (--only picks from these)
ALL_STEPS="env cuda-tests bench-eager e2e-data e2e-clip e2e-albef peer bench-compile bench-batch bench-patchdrop faiss
ddp memory-accum bench-small bench-max-batch"
DRY=0
OUT=gpu-check-out
WORK=
BUDGET=540
ONLY=
RESERVE=15  # seconds of the budget kept for the last report (it takes about 1 s)
GRACE=5     # what a step may run past its limit before it is killed
die() { echo "error: $1" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --out) OUT=${2:?--out needs a folder}; shift 2 ;;
    --work) WORK=${2:?--work needs a folder}; shift 2 ;;
    --budget) [[ ${2:-} =~ ^[0-9]+$ ]] || die "--budget needs whole seconds, not '${2:-}' ($USAGE)"
              BUDGET=$2; shift 2 ;;
    --only) ONLY=${2:?--only needs a comma-separated list of steps}; shift 2
            for s in ${ONLY//,/ }; do
              [[ " $(echo $ALL_STEPS) " == *" $s "* ]] || die "unknown step $s (steps: $(echo $ALL_STEPS))"
            done ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) die "unknown argument $1 ($USAGE)" ;;
  esac
done
rm -rf "$OUT"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ -z "$WORK" ]; then
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT  # shards and runs nobody reads: what is worth keeping is in OUT_DIR's logs.tar.gz
else
  rm -rf "$WORK"
  mkdir -p "$WORK"
fi
CHECK=$(cd "$WORK" && pwd)
echo "{\"budget_s\": $BUDGET, \"reserve_s\": $RESERVE, \"grace_s\": $GRACE, \"dry_run\": $DRY, \"only\": \"$ONLY\"," \
  "\"start_epoch\": $(date +%s)}" > "$CHECK/budget.json"
export PYTHONUNBUFFERED=1
# The files holding `cuda` tests; collecting only these keeps the check off the imports of the rest of the suite
# (moto, Ray, spaCy, faiss), which such a node lacks.
CUDA_TESTS="tests/vltrain/test_cuda.py tests/vltrain/test_samplers.py"

if [ "$DRY" = 1 ]; then
  PY=${PY:-.venv/bin/python}
  export PYTHONPATH=$ROOT
  DEVICE=cpu
  STEPS=3
  BENCH_EAGER=(--device cpu --size tiny --presets clip,albef --batches 4 --steps 1 --timed-steps 2 --runs 1 --warmup 1)
  # the batch rows at the dry run's tiny size: two batches above bench-eager's
  BENCH_BATCH=(--device cpu --size tiny --presets clip,albef --batches 8,16 --steps 1 --timed-steps 2 --runs 1
               --warmup 1)
  BENCH_SMALL=()
  BENCH_COMPILE=()
  BENCH_PATCHDROP=()  # its CPU dry run (a tiny timm ViT) is in tests/vltrain/test_patch_dropout.py
  BENCH_MAX=()
  MEMORY=()
  PEER=()  # its CPU dry run is a test of its own (tests/vltrain/test_peer_benchmark.py)
  FAISS=()  # its CPU dry run (the CPU against itself) is in tests/test_gpu_faiss.py
  DDP_ARGS="--device cpu --batch-size 4 --set model.image_model=tiny --set model.text_model=tiny"
  # the end-to-end rows at the bench rows' tiny size: 40 small photographs, 6 steps of 4, the first 2 untimed
  E2E_DATA="40 --small"
  E2E_SIZE=tiny E2E_BATCH=4 E2E_WARMUP=2
  E2E_RUN="--steps 6 --log-every 2 --device cpu --precision fp32"
else
  PY=${PY:-python3}
  if ! ls .gpu/wheels/*.whl >/dev/null 2>&1; then
    echo "error: no wheels in .gpu/wheels: run bash scripts/gpu-wheels.sh on a machine with PyPI first" >&2
    exit 2
  fi
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check --target .gpu/site \
    .gpu/wheels/*.whl || { echo "error: installing .gpu/wheels failed" >&2; exit 1; }
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check --target .gpu/site \
    --find-links .gpu/wheels-bin simplejpeg \
    || { echo "error: installing simplejpeg from .gpu/wheels-bin failed (run bash scripts/gpu-wheels.sh again)" >&2; exit 1; }
  export PYTHONPATH=$ROOT:$ROOT/.gpu/site
  export VLTRAIN_REQUIRE_CUDA=1
  DEVICE=cuda
  STEPS=20
  # Sized from three calls on H200s (2026-11-27, benchmarks/README.md): the rows' per-step times (base at batch 128:
  # clip 124 ms, albef 237, grit 194, softmask 286; small 55-157), about 5 s to build a row, and a compiled base row
  # in 71 s with a cold inductor cache. The headline rows time 3 runs of 30 unsynchronised steps (96 steps a row with
  # the warm-up, the parts and the FLOP count: not yet run on a GPU).
  BENCH_EAGER=(--size base --presets clip,albef,grit,softmask --batches 128 --steps 3 --timed-steps 30 --runs 3
               --warmup 2)
  BENCH_SMALL=(--size small --presets clip,albef,grit,softmask --batches 128 --steps 3 --timed-steps 30 --runs 3
               --warmup 2)
  BENCH_COMPILE=(--size base --presets clip --batches 128 --compile step --steps 3 --timed-steps 30 --runs 3
                 --warmup 2)
  # Samples/s against the batch (docs/TRAINING.md, "Which batch size"): about 11 steps a row (1,792 samples a
  # preset over the three batches at about 1,000-1,300 samples/s) and 6 builds; albef at 1,024 took 122 GiB before
  BENCH_BATCH=(--size base --presets clip,albef --batches 256,512,1024 --steps 1 --timed-steps 4 --runs 2 --warmup 2)
  # the base clip row again with half its image tokens dropped (not yet run on a GPU; one eager row, about 10 s)
  BENCH_PATCHDROP=(--size base --presets clip --batches 128 --patch-dropout 0.5 --steps 3 --timed-steps 30 --runs 3
                   --warmup 2)
  BENCH_MAX=(--size base --presets albef --batches 64 --ckpt off,on --max-batch --max-batch-seconds 40 --steps 3
             --warmup 1)
  # vltrain against open_clip on the same ViT-B-16 towers (benchmarks/peer.py): the eager pair at one batch, each side
  # a process of at most 60 s (start-up, towers, about 95 steps at batch 256); the compiled pair (a cold inductor
  # cache: about 70 s a side) and the full grid are a call of their own
  PEER=(--size base --batches 256 --compile off --worker-seconds 60)
  # faiss on the GPU against the CPU: 3,000 vectors and two small pseudolabel runs per side, about 15 s on a CPU
  # (not yet run on a GPU)
  FAISS=(--device cuda)
  MEMORY=(--device cuda --presets clip,albef --batch 128 --text random:bert-base --image timm:vit_base_patch16_224
          --image-size 224)
  DDP_ARGS="--device cuda --batch-size 32 --set model.image_model=tiny --set model.text_model=random:minilm"
  # End to end (not yet run on a GPU; estimated): 2,000 photos at about 50 ms each on 16 processes and 8,000 samples
  # (640 MB) through the shard writer, 10-20 s; a run starts in about 20-30 s (imports, towers, 15 loader workers
  # forked), steps 40 x 0.1 s (clip) or 0.25 s (albef), then writes last.pt (2.5 / 3.5 GB): 40-70 s each.
  # 4 copies of each photo: 62 batches of 128 in an epoch, so the 40 steps never wait on an epoch's start.
  E2E_DATA="2000 --copies 4"
  E2E_SIZE=base E2E_BATCH=128 E2E_WARMUP=10
  E2E_RUN="--steps 40 --log-every 5 --device cuda --precision bf16"
fi

# report [--quiet]: OUT/gpu-check.json, gpu-check.md and logs.tar.gz from what the steps left in CHECK
report() { "$PY" scripts/gpu_check.py report "$CHECK" "$OUT" "$@"; }

# record NAME JSON-FIELDS: one line of CHECK/steps.jsonl
record() { echo "{\"step\": \"$1\", $2}" >> "$CHECK/steps.jsonl"; }

# step NAME SECONDS CMD...: when NAME was asked for (--only) and SECONDS (+ GRACE) fit in what is left of the budget
# less RESERVE, write the report with NAME marked as running, then run CMD under that time limit, its output into
# CHECK/NAME.log and on the terminal, and record {step, rc, seconds, limit} (rc 124: it ran out of time); when it
# does not fit, record it as skipped for budget {step, rc null, skipped, limit, left}.
step() {
  local name=$1 limit=$2
  shift 2
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then
    return 0
  fi
  local left=$((BUDGET - RESERVE - SECONDS))
  if [ $((limit + GRACE)) -gt "$left" ]; then
    local why="\"skipped\": \"budget\", \"limit\": $limit, \"grace\": $GRACE, \"left\": $left"
    record "$name" "\"rc\": null, \"seconds\": 0, $why"
    echo "== $name: not run: budget (limit ${limit}s + ${GRACE}s, ${left}s left)"
    return 0
  fi
  echo "{\"step\": \"$name\", \"started_s\": $SECONDS, \"limit\": $limit}" > "$CHECK/running.json"
  report --quiet >/dev/null 2>&1
  echo "== $name (at most ${limit}s, ${left}s of the budget left)"
  local t0=$SECONDS
  # bash -c: a step may be one of the functions below (exported), which `timeout` alone cannot run
  timeout --kill-after="$GRACE" "$limit" bash -c '"$@"' _ "$@" 2>&1 | tee "$CHECK/$name.log"
  local rc=${PIPESTATUS[0]}
  rm -f "$CHECK/running.json"
  record "$name" "\"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"limit\": $limit"
  echo "== $name: rc $rc in $((SECONDS - t0))s"
}

# needs NAME DEPENDENCY: 0 when DEPENDENCY ran (whatever its result); otherwise NAME is recorded as skipped, for the
# budget when that is why DEPENDENCY did not run (a step whose input was not made for the budget is no failure
# either), else (--only left it out) for want of input
needs() {
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$1,"* ]]; then
    return 1
  fi
  if grep -q "\"step\": \"$2\", \"rc\": [0-9]" "$CHECK/steps.jsonl" 2>/dev/null; then
    return 0
  fi
  local why="no input"
  grep -q "\"step\": \"$2\", \"rc\": null" "$CHECK/steps.jsonl" 2>/dev/null && why=budget
  record "$1" "\"rc\": null, \"seconds\": 0, \"skipped\": \"$why\", \"needs\": \"$2\""
  echo "== $1: not run: $why ($2 did not run)"
  return 1
}

env_report() {
  { nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
    "$PY" - <<'PY'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
import transformers, timm, webdataset, wids
print(f"transformers {transformers.__version__}, timm {timm.__version__}, webdataset {webdataset.__version__}")
import vlprep.features, vlprep.shards, vltrain.train  # noqa: F401  the check's imports, before anything is timed
PY
  } > "$CHECK/env.txt" 2>&1
  local rc=$?
  cat "$CHECK/env.txt"
  return $rc
}

ddp_run() {
  set -o pipefail
  "$PY" scripts/gpu_check.py data "$CHECK/ddp-src" 256 &&
  "$PY" -m vlprep.cli shards "$CHECK/ddp-src" "$CHECK/ddp-shards" --samples-per-shard 64 --workers 1 &&
  "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 -m vltrain run "$CHECK/ddp-shards" \
    --out "$CHECK/ddp-run" --preset albef --steps "$STEPS" --set model.fusion_layers=1 --set data.val_frac=0.1 \
    --set eval_every=1000 --set log_every=1 --set model.queue_size=64 $DDP_ARGS 2>&1 | tee "$CHECK/ddp-train.log" &&
  "$PY" scripts/gpu_check.py ddp "$CHECK/ddp-run" "$STEPS" "$CHECK/ddp-train.log"
}

# e2e_run PRESET: `vltrain run` from the e2e-data shards, then its row into CHECK/e2e.jsonl (written when the run
# failed too, saying so); the checkpoints it wrote are deleted (gigabytes nobody reads)
e2e_run() {
  local preset=$1 rc
  "$PY" scripts/gpu_e2e.py run "$CHECK/e2e-data/shards" "$CHECK/e2e-$preset" --size "$E2E_SIZE" --preset "$preset" \
    --batch "$E2E_BATCH" $E2E_RUN
  rc=$?
  rm -f "$CHECK/e2e-$preset"/*.pt
  "$PY" scripts/gpu_check.py e2e "$CHECK/e2e-$preset" "$CHECK" "$E2E_SIZE" "$preset" "$E2E_BATCH" "$E2E_WARMUP" &&
  return $rc
}

export -f env_report ddp_run e2e_run
export PY CHECK STEPS DDP_ARGS E2E_SIZE E2E_BATCH E2E_WARMUP E2E_RUN
# one data folder for the benchmark's calls: the shards it times its setup with are made once
BENCH=(--json "$CHECK/bench.jsonl" --data-dir "$CHECK/bench-data")
step env 30 env_report
step cuda-tests 80 "$PY" -m pytest -q -p no:cacheprovider -m cuda --junitxml="$CHECK/cuda-tests.xml" $CUDA_TESTS
step bench-eager 160 "$PY" benchmarks/gpu.py "${BENCH_EAGER[@]}" "${BENCH[@]}"
step e2e-data 40 "$PY" scripts/gpu_e2e.py shards "$CHECK/e2e-data" $E2E_DATA
needs e2e-clip e2e-data && step e2e-clip 75 e2e_run clip
needs e2e-albef e2e-data && step e2e-albef 90 e2e_run albef
rm -rf "$CHECK/e2e-data"  # 640 MB of shards on the GPU node
[ ${#PEER[@]} -gt 0 ] && step peer 150 "$PY" benchmarks/peer.py "${PEER[@]}" --json "$CHECK/peer.jsonl"
[ ${#BENCH_COMPILE[@]} -gt 0 ] && step bench-compile 110 "$PY" benchmarks/gpu.py "${BENCH_COMPILE[@]}" "${BENCH[@]}"
step bench-batch 120 "$PY" benchmarks/gpu.py "${BENCH_BATCH[@]}" "${BENCH[@]}"
[ ${#BENCH_PATCHDROP[@]} -gt 0 ] &&
  step bench-patchdrop 50 "$PY" benchmarks/gpu.py "${BENCH_PATCHDROP[@]}" "${BENCH[@]}"
[ ${#FAISS[@]} -gt 0 ] && step faiss 50 "$PY" scripts/gpu_faiss.py "$CHECK" "${FAISS[@]}"
step ddp 50 ddp_run
[ ${#MEMORY[@]} -gt 0 ] && step memory-accum 50 "$PY" benchmarks/accum_memory.py "${MEMORY[@]}"
[ ${#BENCH_SMALL[@]} -gt 0 ] && step bench-small 110 "$PY" benchmarks/gpu.py "${BENCH_SMALL[@]}" "${BENCH[@]}"
[ ${#BENCH_MAX[@]} -gt 0 ] && step bench-max-batch 130 "$PY" benchmarks/gpu.py "${BENCH_MAX[@]}" "${BENCH[@]}"
echo "== report ($SECONDS s of the ${BUDGET}s budget used)"
report
