#!/usr/bin/env bash
# Debian's openclipart clip art -> captions.parquet -> shards -> stats -> bow -> vltrain; detect -> ontology.
# Env: PY, VLPREP (default: the repo's .venv), OUT (default: demo-out/openclipart in the repo),
#      LIMIT (default 2000 evenly spaced files, about 6 minutes in all; LIMIT=all for all 8,121 images,
#      about 20 minutes, most of it object detection at ~8 images/s).
#      RMTOP (default 20): t of the bow stage's rmtop:t. MIN_SCORE (default 0.3): detection score threshold.
#      TRAIN_STEPS (default 40): steps of the short vltrain run on the bow shards.
# Re-runnable: every stage resumes; shards whose input changed are rebuilt.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
VLPREP="${VLPREP:-$ROOT/.venv/bin/vlprep}"
VLTRAIN="${VLTRAIN:-$ROOT/.venv/bin/vltrain}"
TRAIN_STEPS="${TRAIN_STEPS:-40}"
OUT="${OUT:-$ROOT/demo-out/openclipart}"
LIMIT="${LIMIT-2000}"
[ "$LIMIT" = all ] && LIMIT=""
MIN_SCORE="${MIN_SCORE:-0.3}"

if [ ! -d /usr/share/openclipart/png ] || [ ! -d /usr/share/openclipart/svg ]; then
    echo "openclipart not found in /usr/share/openclipart: sudo apt-get install openclipart-png openclipart-svg" >&2
    exit 1
fi
mkdir -p "$OUT"

step() {  # step NAME CMD...: run CMD and print its wall time
    local name="$1" t0
    shift
    t0=$(date +%s.%N)
    "$@"
    awk -v name="$name" -v t0="$t0" -v t1="$(date +%s.%N)" 'BEGIN { printf "== %s: %.1f s\n", name, t1 - t0 }'
}

step captions "$PY" "$HERE/make_captions.py" --out "$OUT/captions.parquet" ${LIMIT:+--limit "$LIMIT"}
# Same options into the same folder resume; shards whose records changed (other LIMIT, new rules) are rebuilt.
step shards "$VLPREP" shards "$OUT/captions.parquet" "$OUT/shards" --resize 256 -n 1000
step stats "$VLPREP" stats "$OUT/shards"
# A Fistful of Words' default cascade. Clip-art captions are short (median 3 words), so rmtop uses a
# much smaller t than the paper's 1000 (examples/openclipart/README.md, "Bag of words").
step bow "$VLPREP" bow "$OUT/shards" "$OUT/bow" --ops "shuffle,rmstop,basevocab,rmtop:${RMTOP:-20},keep:4"
# TOnICS: COCO objects in each image (packaged SSD-MobileNet-v2), then the noun-object PMI ontology.
step detect "$VLPREP" detect "$OUT/shards" "$OUT/det" --min-score "$MIN_SCORE"
step ontology "$VLPREP" ontology "$OUT/det" "$OUT/onto" --min-score "$MIN_SCORE"
# vltrain: a short ALBEF run (packaged MiniLM + EfficientNet-Lite0) on the bag-of-words shards; the held-out
# retrieval table is printed beside the chance level. A real run needs far more steps than a demo can afford.
step train "$VLTRAIN" run "$OUT/bow" --preset albef --steps "$TRAIN_STEPS" --batch-size 16 --out "$OUT/run" \
    --set model.queue_size=256 --set eval_every="$TRAIN_STEPS" --set ckpt_every="$TRAIN_STEPS" --set optim.warmup_steps=5
