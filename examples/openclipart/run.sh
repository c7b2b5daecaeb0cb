#!/usr/bin/env bash
# Debian's openclipart clip art -> captions.parquet -> shards -> stats -> bow -> vltrain; detect -> ontology;
# held-out images -> pseudolabel -> vltrain on bow + pseudo, both runs scored on the same held-out eval set, on a
# multi-caption split of it (Karpathy format, make_karpathy.py) and on a zero-shot image folder (zeroshot.py).
# Env: PY, VLPREP (default: the repo's .venv), OUT (default: demo-out/openclipart in the repo),
#      LIMIT (default 2000 evenly spaced files, about 6 minutes in all; LIMIT=all for all 8,121 images,
#      about 20 minutes, most of it object detection at ~8 images/s).
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

quiet() {  # quiet LOG CMD...: run CMD with its output in LOG, shown only if CMD fails
    local log="$1"
    shift
    "$@" >"$log" 2>&1 || { cat "$log" >&2; return 1; }
}

step() {  # step NAME CMD...: run CMD and print its wall time
    local name="$1" t0
    shift
    t0=$(date +%s.%N)
    "$@"
    awk -v name="$name" -v t0="$t0" -v t1="$(date +%s.%N)" 'BEGIN { printf "== %s: %.1f s\n", name, t1 - t0 }'
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
batch=()  # BATCH=1: the same trainings and evals, in this order, in one process after the loop
for seed in $SEEDS; do
    for arm in bow pseudo; do
        run="$OUT/cmp/$arm-s$seed"
        data=("$OUT/bow-feat")
        [ "$arm" = pseudo ] && data+=("$OUT/pseudo-feat")
        if [ "$arm" = bow ] && [ "$seed" = 0 ]; then
            mkdir -p "$run" && cp "$OUT/run/last.pt" "$run/last.pt"  # the run above is this arm's seed 0
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
            quiet "$run.eval.log" "$VLTRAIN" "${heldout[@]}"
            quiet "$run.eval-karpathy.log" "$VLTRAIN" "${karpathy[@]}"
        fi
    done
done
if [ ${#batch[@]} -gt 0 ]; then
    step compare quiet "$OUT/cmp/batch.log" "$PY" "$HERE/inprocess.py" "${batch[@]}"
fi
"$PY" "$HERE/summary.py" "$OUT"
