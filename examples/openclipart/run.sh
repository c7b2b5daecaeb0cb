#!/usr/bin/env bash
# Debian's openclipart clip art -> captions.parquet -> shards -> stats -> bow -> vltrain; detect -> ontology;
# held-out images -> pseudolabel -> vltrain on bow + pseudo, both runs scored on the same held-out eval set, on a
# multi-caption split of it (Karpathy format, make_karpathy.py) and on a zero-shot image folder (zeroshot.py).
# Each step ends with one progress line: `== STEP: N s [K/TOTAL, M:SS elapsed, about M:SS left]`; the run ends with
# the disk OUT uses (du -sh). The comparison's checkpoints (cmp/, 264 MB a run) are deleted once scored: the tables
# read only their eval JSONs, and a re-run keeps a run whose scores are of the current data and eval sets.
# Env: PY, VLPREP (default: the repo's .venv), OUT (default: demo-out/openclipart in the repo),
#      LIMIT (default 2000 evenly spaced files; LIMIT=all for all 8,121 images, most of its time object detection
#      at ~8 images/s).
#      RMTOP (default 15): t of the bow stage's rmtop:t. MIN_SCORE (default 0.3): detection score threshold.
#      TRAIN_STEPS (default 120): steps of each vltrain run (clip preset, batch 32, on `vlprep features` tokens).
#      SEEDS (default "0 1 2"): seeds of the bow-only vs bow + pseudo comparison (mean and spread over them).
#      UNALIGNED (default LIMIT/4) and EVAL (default LIMIT/8): images held out from the LIMIT subset, to be
#      pseudo-captioned and to score retrieval on; CROPS (default 3): crops per unaligned image; PSEUDO=0 skips
#      that part (it trains 2 x SEEDS more short runs). ZEROSHOT_PER_CLASS (default 30): images of each of the
#      zero-shot folder's 10 classes.
#      UNTIL=STEP stops after the step of that name (a `== STEP:` line), e.g. UNTIL=ontology.
#      BATCH=1 (default 0) runs pseudolabel with the three `features` calls after it, and the comparison's
#      trainings and evals, in one Python process each (inprocess.py; steps pseudolabel+features and compare):
#      the same commands and outputs without a torch start-up per call, most of a call's time on a small subset.
# Re-runnable: every stage resumes; shards whose input changed are rebuilt.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
VLPREP="${VLPREP:-$ROOT/.venv/bin/vlprep}"
VLTRAIN="${VLTRAIN:-$ROOT/.venv/bin/vltrain}"
TRAIN_STEPS="${TRAIN_STEPS:-120}"
SEEDS="${SEEDS:-0 1 2}"
OUT="${OUT:-$ROOT/demo-out/openclipart}"
LIMIT="${LIMIT-2000}"
[ "$LIMIT" = all ] && LIMIT=""
MIN_SCORE="${MIN_SCORE:-0.3}"
BATCH="${BATCH:-0}"

if [ ! -d /usr/share/openclipart/png ] || [ ! -d /usr/share/openclipart/svg ]; then
    echo "openclipart not found in /usr/share/openclipart: sudo apt-get install openclipart-png openclipart-svg" >&2
    exit 1
fi
mkdir -p "$OUT"
T0=$(date +%s.%N)
trap '[ $? -eq 0 ] && echo "disk: $(du -sh "$OUT" | cut -f1) in $OUT (du -sh)"' EXIT

# The steps of this run, in order (the progress line's K/TOTAL): the same conditions as the steps below.
SEED_LIST=($SEEDS)
PLAN=(captions shards stats bow detect ontology features train)
if [ "${PSEUDO:-1}" != 0 ] && [ -n "$LIMIT" ]; then
    PLAN+=(captions-all heldout unaligned-shards eval-shards karpathy karpathy-shards zeroshot-folder)
    if [ "$BATCH" = 1 ]; then
        PLAN+=(pseudolabel+features)
    else
        PLAN+=(pseudolabel features-pseudo features-eval features-karpathy)
    fi
    for seed in "${SEED_LIST[@]}"; do
        for arm in bow pseudo; do
            [ "$BATCH" = 1 ] && continue
            { [ "$arm" = bow ] && [ "$seed" = 0 ]; } || PLAN+=("train-$arm-s$seed")
            PLAN+=("score-$arm-s$seed")
        done
    done
    [ "$BATCH" = 1 ] && PLAN+=(compare)
    PLAN+=(summary)
fi
# Each step's share of a default run's time (LIMIT=2000, BATCH=0, SEEDS="0 1 2"), in seconds of one run on 2 CPU
# cores shared with other work (load 6-9), so the shares, not the seconds, are what counts. Measured: captions to
# zeroshot-folder. Estimated, not yet measured (that run was stopped at pseudolabel): the later steps, from their
# sizes against the measured ones (train-ARM: train's 120 steps without its 6 held-out evals), the BATCH=1 steps
# as the sums of the steps they replace less a few seconds of start-up each; train-ARM and score-ARM are per seed.
# The estimate of what is left is the elapsed time times the shares to come over the shares done: a guide, not a
# promise.
declare -A SHARE=([captions]=6 [shards]=42 [stats]=4 [bow]=18 [detect]=971 [ontology]=114 [features]=323
    [train]=817 [captions-all]=32 [heldout]=3 [unaligned-shards]=67 [eval-shards]=5 [karpathy]=2
    [karpathy-shards]=12 [zeroshot-folder]=4 [pseudolabel]=300 [features-pseudo]=160 [features-eval]=60
    [features-karpathy]=60 [pseudolabel+features]=560 [train-bow]=700 [train-pseudo]=800 [score-bow]=150
    [score-pseudo]=150 [compare]=3900 [summary]=2)
DONE=0

progress() {  # progress NAME T_STEP: the step's time, its place in PLAN and the time elapsed and left
    local name="$1" dt="$2" done=0 left=0 i key
    DONE=$((DONE + 1))
    for i in "${!PLAN[@]}"; do
        key="${PLAN[$i]%-s[0-9]*}"
        if [ "$i" -lt "$DONE" ]; then done=$(awk -v a="$done" -v b="${SHARE[$key]:-1}" 'BEGIN { print a + b }')
        else left=$(awk -v a="$left" -v b="${SHARE[$key]:-1}" 'BEGIN { print a + b }'); fi
    done
    awk -v name="$name" -v dt="$dt" -v k="$DONE" -v n="${#PLAN[@]}" -v t="$(date +%s.%N)" -v t0="$T0" \
        -v done="$done" -v left="$left" 'function mmss(x) { return sprintf("%d:%02d", int(x / 60), int(x % 60)) }
        BEGIN { e = t - t0; printf "== %s: %.1f s [%d/%d, %s elapsed, about %s left]\n", name, dt, k, n, mmss(e),
                mmss(done > 0 ? e * left / done : 0) }'
}

quiet() {  # quiet LOG CMD...: run CMD with its output in LOG, shown only if CMD fails
    local log="$1"
    shift
    "$@" >"$log" 2>&1 || { cat "$log" >&2; return 1; }
}

step() {  # step NAME CMD...: run CMD and print its progress line
    local name="$1" t0
    shift
    t0=$(date +%s.%N)
    "$@"
    progress "$name" "$(awk -v t0="$t0" -v t1="$(date +%s.%N)" 'BEGIN { print t1 - t0 }')"
    if [ "$name" = "${UNTIL:-}" ]; then
        echo "== stopped after $name (UNTIL=$UNTIL)"
        exit 0
    fi
}

# --overwrite on the vlprep stages: the same options resume; changed ones (another RMTOP, a new version's
# stage options) redo that stage in its own folder instead of stopping with "written with other options".
V=(--overwrite)
step captions "$PY" "$HERE/make_captions.py" --out "$OUT/captions.parquet" ${LIMIT:+--limit "$LIMIT"}
# Same options into the same folder resume; shards whose records changed (other LIMIT, new rules) are rebuilt.
step shards "$VLPREP" shards "$OUT/captions.parquet" "$OUT/shards" --resize 256 -n 1000 "${V[@]}"
step stats "$VLPREP" stats "$OUT/shards"
# A Fistful of Words' default cascade. Clip-art captions are short (median 3 words), so rmtop uses a
# much smaller t than the paper's 1000: the 15 most frequent content words (examples/openclipart/README.md,
# "Bag of words").
step bow "$VLPREP" bow "$OUT/shards" "$OUT/bow" --ops "shuffle,rmstop,basevocab,rmtop:${RMTOP:-15},keep:4" "${V[@]}"
# TOnICS: COCO objects in each image (packaged SSD-MobileNet-v2), then the noun-object PMI ontology.
step detect "$VLPREP" detect "$OUT/shards" "$OUT/det" --min-score "$MIN_SCORE" "${V[@]}"
step ontology "$VLPREP" ontology "$OUT/det" "$OUT/onto" --min-score "$MIN_SCORE" "${V[@]}"
# The image tower is frozen and cached once (`vlprep features`: EfficientNet-Lite0 tokens, 7x7x1280 float16), so
# vltrain trains the text tower and the projections at ~100 samples/s on a CPU instead of a few (docs/FEATURES.md).
step features "$VLPREP" features "$OUT/bow" "$OUT/bow-feat" "${V[@]}"
# vltrain: CLIP-style ITC on the bow captions against the cached image tokens; retrieval on the held-out split
# every 20 steps draws OUT/run/learning_curve.png. The whole model is retrained in each run: no weights are reused.
TRAIN=(--preset clip --steps "$TRAIN_STEPS" --batch-size 32 --set optim.warmup_steps=20 --set eval_every=20
       --set ckpt_every="$TRAIN_STEPS")
# again RUN DATA...: --resume when RUN has a checkpoint of training on DATA's current contents (a finished run
# resumes to its last step at once, a cut one continues), else --overwrite: a rebuilt input (other captions,
# other held-out images) trains again. vltrain itself refuses to resume on changed data.
again() {
    local run="$1"
    shift
    again=(--overwrite)
    if [ -f "$run/last.pt" ] && { [ ! -f "$run/result.json" ] || "$PY" -c 'import json, sys
from vltrain.data.shards import data_signature
sys.exit(json.load(open(sys.argv[1])).get("data") != data_signature(sys.argv[2:]))' "$run/result.json" "$@"; }; then
        again=(--resume)
    fi
}
# scored RESULT RUN DATA...: RUN's two evals are of the current eval sets and RESULT (its training's result.json)
# is a TRAIN_STEPS-step training on DATA's current contents: a re-run keeps the run without its checkpoint.
scored() {
    local result="$1" run="$2"
    shift 2
    [ -f "$result" ] && [ -f "$run/eval-heldout.json" ] && [ -f "$run/eval-karpathy.json" ] || return 1
    "$PY" -c 'import json, sys
from vltrain.data.shards import data_signature
result, run, steps, ev, kar, *data = sys.argv[1:]
sig = lambda p: json.load(open(p)).get("data")
sys.exit(not (sig(result) == data_signature(data) and json.load(open(result)).get("step") == int(steps)
              and sig(run + "/eval-heldout.json") == data_signature([ev])
              and sig(run + "/eval-karpathy.json") == data_signature([kar])))' \
        "$result" "$run" "$TRAIN_STEPS" "$OUT/eval-feat" "$OUT/karpathy-feat" "$@"
}
again "$OUT/run" "$OUT/bow-feat"
step train "$VLTRAIN" run "$OUT/bow-feat" "${TRAIN[@]}" --out "$OUT/run" "${again[@]}"
cp "$OUT/run/learning_curve.png" "$OUT/learning_curve.png"

# A Fistful of Words, sec. 2.3: pseudo bag-of-words captions for images without one. Images outside the LIMIT
# subset are held out: UNALIGNED of them lose their captions to `vlprep pseudolabel` (kNN over the bow run's
# caption embeddings), EVAL others with distinct captions score both arms with `vltrain eval`.
if [ "${PSEUDO:-1}" = 0 ]; then
    echo "== pseudolabel: skipped (PSEUDO=0)"
    exit 0
fi
if [ -z "$LIMIT" ]; then
    echo "== pseudolabel: skipped (LIMIT=all leaves no image outside the aligned set to hold out)"
    exit 0
fi
UNALIGNED="${UNALIGNED:-$((LIMIT / 4))}"
EVAL="${EVAL:-$((LIMIT / 8))}"
step captions-all "$PY" "$HERE/make_captions.py" --out "$OUT/captions-all.parquet"
step heldout "$PY" "$HERE/heldout.py" --all "$OUT/captions-all.parquet" --aligned "$OUT/captions.parquet" \
    --unaligned "$UNALIGNED" --eval "$EVAL" --out-unaligned "$OUT/unaligned.parquet" --out-eval "$OUT/eval.parquet"
step unaligned-shards "$VLPREP" shards "$OUT/unaligned.parquet" "$OUT/unaligned" --resize 256 -n 1000 --prefix unaligned "${V[@]}"
step eval-shards "$VLPREP" shards "$OUT/eval.parquet" "$OUT/eval" --resize 256 -n 1000 --prefix eval "${V[@]}"
# Two more benchmarks on images no run trains on. Multi-caption retrieval as on COCO/Flickr30k (Karpathy's split
# format): the eval images' name, description and keywords as 2-3 captions each. Zero-shot classification: 30
# images of each of 10 category folders, none in the tables above, as ROOT/FOLDER/*.png + classnames.txt.
KARPATHY="$OUT/karpathy/dataset_openclipart.json"
step karpathy "$PY" "$HERE/make_karpathy.py" --eval "$OUT/eval.parquet" --out "$KARPATHY"
step karpathy-shards "$VLPREP" shards "$KARPATHY" "$OUT/karpathy-shards" --image-root /usr/share/openclipart/png \
    --split test --resize 256 -n 1000 --prefix karpathy "${V[@]}"
step zeroshot-folder "$PY" "$HERE/zeroshot.py" --all "$OUT/captions-all.parquet" --exclude "$OUT/captions.parquet" \
    "$OUT/unaligned.parquet" "$OUT/eval.parquet" "$KARPATHY" --per-class "${ZEROSHOT_PER_CLASS:-30}" \
    --folder "$OUT/zeroshot-folder"
# The features-trained checkpoint reads the unaligned images' pixels through the same frozen encoder.
PSEUDOLABEL=(pseudolabel "$OUT/bow" "$OUT/unaligned" "$OUT/pseudo" --checkpoint "$OUT/run/last.pt" --strategy weighted
             --crops "${CROPS:-3}" --k 10 --words 4 --batch-size 24 "${V[@]}")
# `features` keeps each sample's json member, so all captions of an image survive; the evals read cached tokens.
if [ "$BATCH" = 1 ]; then  # the same four calls in one process
    step pseudolabel+features "$PY" "$HERE/inprocess.py" vlprep "${PSEUDOLABEL[@]}" \
        ";" vlprep features "$OUT/pseudo" "$OUT/pseudo-feat" "${V[@]}" \
        ";" vlprep features "$OUT/eval" "$OUT/eval-feat" "${V[@]}" \
        ";" vlprep features "$OUT/karpathy-shards" "$OUT/karpathy-feat" "${V[@]}"
else
    step pseudolabel "$VLPREP" "${PSEUDOLABEL[@]}"
    step features-pseudo "$VLPREP" features "$OUT/pseudo" "$OUT/pseudo-feat" "${V[@]}"
    step features-eval "$VLPREP" features "$OUT/eval" "$OUT/eval-feat" "${V[@]}"
    step features-karpathy "$VLPREP" features "$OUT/karpathy-shards" "$OUT/karpathy-feat" "${V[@]}"
fi
# Two arms, the same runs but for the data: bow only, and bow + pseudo; each over SEEDS, scored on the eval set,
# then on the multi-caption split and the zero-shot folder (summary.py's second and third tables).
score() {  # score RUN: its held-out and multi-caption + zero-shot evals (heldout and karpathy, set in the loop)
    quiet "$1.eval.log" "$VLTRAIN" "${heldout[@]}"
    quiet "$1.eval-karpathy.log" "$VLTRAIN" "${karpathy[@]}"
}
batch=()  # BATCH=1: the same trainings and evals, in this order, in one process after the loop
for seed in $SEEDS; do
    for arm in bow pseudo; do
        run="$OUT/cmp/$arm-s$seed"
        data=("$OUT/bow-feat")
        [ "$arm" = pseudo ] && data+=("$OUT/pseudo-feat")
        first=0 result="$run/result.json"
        if [ "$arm" = bow ] && [ "$seed" = 0 ]; then
            first=1 result="$OUT/run/result.json"  # the run above is this arm's seed 0
        fi
        if scored "$result" "$run" "${data[@]}"; then
            if [ "$BATCH" != 1 ]; then
                [ "$first" = 1 ] || progress "train-$arm-s$seed" 0
                progress "score-$arm-s$seed" 0
            fi
            echo "   $arm-s$seed: scored before on the current data, kept"
            continue
        fi
        if [ "$first" = 1 ]; then
            mkdir -p "$run" && cp "$OUT/run/last.pt" "$run/last.pt"
        else
            again "$run" "${data[@]}"  # a re-run of the demo keeps finished runs (same options, same data)
            mkdir -p "$OUT/cmp"
            train=(run "${data[@]}" "${TRAIN[@]}" --set eval_every=100000 --set seed="$seed" --out "$run" "${again[@]}")
            if [ "$BATCH" = 1 ]; then
                batch+=(vltrain "${train[@]}" ";")
            else
                step "train-$arm-s$seed" quiet "$run.log" "$VLTRAIN" "${train[@]}"
            fi
        fi
        heldout=(eval "$run/last.pt" "$OUT/eval-feat" --out "$run/eval-heldout.json")
        karpathy=(eval "$run/last.pt" "$OUT/karpathy-feat" --zeroshot-folder "$OUT/zeroshot-folder"
                  --out "$run/eval-karpathy.json")
        if [ "$BATCH" = 1 ]; then
            batch+=(vltrain "${heldout[@]}" ";" vltrain "${karpathy[@]}" ";")
        else
            step "score-$arm-s$seed" score "$run"
        fi
    done
done
if [ ${#batch[@]} -gt 0 ]; then
    step compare quiet "$OUT/cmp/batch.log" "$PY" "$HERE/inprocess.py" "${batch[@]}"
elif [ "$BATCH" = 1 ]; then
    progress compare 0
fi
# Scored: the tables read only the eval JSONs, so the checkpoints go (the training's result.json and log stay).
rm -f "$OUT"/cmp/*/last.pt "$OUT"/cmp/*/best.pt
step summary "$PY" "$HERE/summary.py" "$OUT"
