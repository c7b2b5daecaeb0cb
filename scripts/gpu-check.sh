#!/usr/bin/env bash
# The GPU check: everything this project can only prove on a CUDA device, in one call that fits a short offline GPU
# slot (about 10 minutes on an H200, each step under its own time limit, so one that hangs costs only its share):
#   env          the device, the driver, the Python and its torch, and that vltrain and vlprep import;
#   cuda-tests   the tests marked `cuda` (they must run: VLTRAIN_REQUIRE_CUDA=1 makes a skip a failure);
#   bench-*      benchmarks/gpu.py: sizes small and base, presets clip, albef, grit, softmask, batch 128,
#                bf16; then base clip with train.compile; then base clip with model.patch_dropout=0.5 (FLIP's
#                patch dropout, half the image tokens); then the largest batch that fits with and without
#                gradient checkpointing;
#   peer         benchmarks/peer.py: vltrain against open_clip's own step on the same ViT-B-16 towers, batch 256;
#   ddp          a one-process torchrun run on NCCL for 20 steps (the DDP path, one GPU);
#   e2e-data     2,000 photograph-like JPEGs (benchmarks/loader.py's generator, on all cores), each written 4 times
#                under its own key into shards by vlprep's shard writer (scripts/gpu_e2e.py shards);
#   e2e-clip, e2e-albef   `vltrain run` from those shards with bench-eager's base towers, bf16, batch 128, 40 steps,
#                data.workers auto: samples/s over steps 11-40 against the synthetic-batch row of bench-eager, and the
#                share of those steps' time the main process waited for data (scripts/gpu_e2e.py run, gpu_check.py e2e);
#   memory-accum peak memory of a base-size step at train.accum_steps 1, 2, 4 (benchmarks/accum_memory.py);
#   faiss        whether the node's faiss has GPU support, and if so vlprep.knn and `vlprep pseudolabel` with the
#                index on the GPU against the CPU (scripts/gpu_faiss.py; skipped, not failed, without one);
#   report       CHECK_DIR/gpu-check.json and gpu-check.md, the table printed at the end.
# The node needs a Python with torch, torchvision, transformers, timm, typer, pandas, pyarrow, safetensors, rich,
# matplotlib, tensorboard and pytest; the rest comes from .gpu/ (`bash scripts/gpu-wheels.sh` on a machine with
# PyPI), installed here with pip --no-index into .gpu/site.
#
#   bash scripts/gpu-check.sh [--dry-run] [--out CHECK_DIR]    (default CHECK_DIR: gpu-check-out)
#
# --dry-run runs the same steps on this machine's CPU at tiny sizes with the project's .venv (no wheels, the CUDA
# tests skip), in under 3 minutes: it is how the script is tested without a GPU. Exit status: 0 when every step
# passed, 1 when one failed (the others still ran), 2 for a usage error.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=0
CHECK=gpu-check-out
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --out) CHECK=${2:?--out needs a folder}; shift 2 ;;
    -h|--help) sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument $1 (usage: scripts/gpu-check.sh [--dry-run] [--out CHECK_DIR])" >&2; exit 2 ;;
  esac
done
rm -rf "$CHECK"
mkdir -p "$CHECK"
CHECK=$(cd "$CHECK" && pwd)
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
  export PYTHONPATH=$ROOT:$ROOT/.gpu/site
  export VLTRAIN_REQUIRE_CUDA=1
  DEVICE=cuda
  STEPS=20
  # Sized from two runs on an H200 (2026-11-27): a row of 7 steps took about 7 s; a compiled base row needs over
  # 70 s with a cold inductor cache (both runs were cut there; about 30 s warm); the two batch-size searches to 1024
  # and the rows before them over 110 s. The headline rows now time 3 runs of 30 unsynchronised steps (about 100
  # steps a row, 0.03-0.25 s each at batch 128): one batch per row, and more time (not yet run on a GPU).
  BENCH_EAGER=(--size small,base --presets clip,albef,grit,softmask --batches 128 --steps 3 --timed-steps 30
               --runs 3 --warmup 2)
  BENCH_COMPILE=(--size base --presets clip --batches 128 --compile on --steps 3 --timed-steps 30 --runs 3
                 --warmup 2)
  # the base clip row again with half its image tokens dropped (not yet run on a GPU; one eager row, about 10 s)
  BENCH_PATCHDROP=(--size base --presets clip --batches 128 --patch-dropout 0.5 --steps 3 --timed-steps 30 --runs 3
                   --warmup 2)
  BENCH_MAX=(--size base --presets albef --batches 64 --ckpt off,on --max-batch --max-batch-seconds 40 --steps 3
             --warmup 1)
  # vltrain against open_clip on the same ViT-B-16 towers (benchmarks/peer.py): one batch here, eager and compiled
  # (four processes; a compiled side needs about 70 s with a cold inductor cache); the full grid is a call of its own
  PEER=(--size base --batches 256 --compile off,on --worker-seconds 130)
  # faiss on the GPU against the CPU: 3,000 vectors and two small pseudolabel runs per side, about 15 s on a CPU
  # (not yet run on a GPU)
  FAISS=(--device cuda)
  MEMORY=(--device cuda --presets clip,albef --batch 128 --text random:bert-base --image timm:vit_base_patch16_224
          --image-size 224)
  DDP_ARGS="--device cuda --batch-size 32 --set model.image_model=tiny --set model.text_model=random:minilm"
  # End to end (not yet run on a GPU; estimated): 2,000 photos at about 50 ms each on 16 processes and 8,000 samples
  # (640 MB) through the shard writer, 10-20 s; a run starts in about 20-30 s (imports, towers, 15 loader workers
  # forked), steps 40 x 0.1 s (clip) or 0.25 s (albef), then writes last.pt (2.5 / 3.5 GB): 40-60 s each.
  # 4 copies of each photo: 62 batches of 128 in an epoch, so the 40 steps never wait on an epoch's start.
  E2E_DATA="2000 --copies 4"
  E2E_SIZE=base E2E_BATCH=128 E2E_WARMUP=10
  E2E_RUN="--steps 40 --log-every 5 --device cuda --precision bf16"
fi

# step NAME SECONDS CMD...: run CMD under a time limit, its output into CHECK/NAME.log and on the terminal; record
# {step, rc, seconds} in CHECK/steps.jsonl (rc 124: it ran out of time).
step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most ${limit}s)"
  local t0=$SECONDS
  # bash -c: a step may be one of the functions below (exported), which `timeout` alone cannot run
  timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@" 2>&1 | tee "$CHECK/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" >> "$CHECK/steps.jsonl"
  echo "== $name: rc $rc in $((SECONDS - t0))s"
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
step env 40 env_report
step cuda-tests 90 "$PY" -m pytest -q -p no:cacheprovider -m cuda --junitxml="$CHECK/cuda-tests.xml" $CUDA_TESTS
# one data folder for the three calls: the shards the benchmark times its setup with are made once
BENCH=(--json "$CHECK/bench.jsonl" --data-dir "$CHECK/bench-data")
step bench-eager 240 "$PY" benchmarks/gpu.py "${BENCH_EAGER[@]}" "${BENCH[@]}"
if [ ${#BENCH_COMPILE[@]} -gt 0 ]; then
  step bench-compile 130 "$PY" benchmarks/gpu.py "${BENCH_COMPILE[@]}" "${BENCH[@]}"
fi
if [ ${#BENCH_PATCHDROP[@]} -gt 0 ]; then
  step bench-patchdrop 90 "$PY" benchmarks/gpu.py "${BENCH_PATCHDROP[@]}" "${BENCH[@]}"
fi
if [ ${#BENCH_MAX[@]} -gt 0 ]; then
  step bench-max-batch 130 "$PY" benchmarks/gpu.py "${BENCH_MAX[@]}" "${BENCH[@]}"
fi
if [ ${#PEER[@]} -gt 0 ]; then
  step peer 300 "$PY" benchmarks/peer.py "${PEER[@]}" --json "$CHECK/peer.jsonl"
fi
step ddp 60 ddp_run
step e2e-data 60 "$PY" scripts/gpu_e2e.py shards "$CHECK/e2e-data" $E2E_DATA
step e2e-clip 90 e2e_run clip
step e2e-albef 100 e2e_run albef
rm -rf "$CHECK/e2e-data"  # 640 MB of shards on the GPU node
if [ ${#MEMORY[@]} -gt 0 ]; then
  step memory-accum 60 "$PY" benchmarks/accum_memory.py "${MEMORY[@]}"
fi
if [ ${#FAISS[@]} -gt 0 ]; then
  step faiss 60 "$PY" scripts/gpu_faiss.py "$CHECK" "${FAISS[@]}"
fi
echo "== report"
"$PY" scripts/gpu_check.py report "$CHECK"
