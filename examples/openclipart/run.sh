#!/usr/bin/env bash
# Debian's openclipart clip art -> captions.parquet -> shards -> stats -> bow -> vltrain; detect -> ontology;
# held-out images -> pseudolabel -> vltrain on bow + pseudo, both runs scored on the same held-out eval set.
# Env: PY, VLPREP (default: the repo's .venv), OUT (default: demo-out/openclipart in the repo),
#      LIMIT (default 2000 evenly spaced files, about 6 minutes in all; LIMIT=all for all 8,121 images,
#      about 20 minutes, most of it object detection at ~8 images/s).
#      RMTOP (default 20): t of the bow stage's rmtop:t. MIN_SCORE (default 0.3): detection score threshold.
#      TRAIN_STEPS (default 40): steps of the short vltrain run on the bow shards.
#      UNALIGNED (default LIMIT/4) and EVAL (default LIMIT/8): images held out from the LIMIT subset, to be
#      pseudo-captioned and to score retrieval on; CROPS (default 3): crops per unaligned image; PSEUDO=0 skips
#      that part (it trains a second model, so it costs about as much again as `train`).
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

# A Fistful of Words, sec. 2.3: pseudo bag-of-words captions for images without one. Images outside the LIMIT
# subset are held out: UNALIGNED of them lose their captions to `vlprep pseudolabel` (kNN over the bow run's
# caption embeddings), EVAL others with distinct captions score both runs with `vltrain eval`.
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
step unaligned-shards "$VLPREP" shards "$OUT/unaligned.parquet" "$OUT/unaligned" --resize 256 -n 1000 --prefix unaligned
step eval-shards "$VLPREP" shards "$OUT/eval.parquet" "$OUT/eval" --resize 256 -n 1000 --prefix eval
step pseudolabel "$VLPREP" pseudolabel "$OUT/bow" "$OUT/unaligned" "$OUT/pseudo" --checkpoint "$OUT/run/last.pt" \
    --strategy weighted --crops "${CROPS:-3}" --k 10 --words 4 --batch-size 24
# The same run as `train` on bow + pseudo; then both checkpoints on the held-out eval set.
step train-pseudo "$VLTRAIN" run "$OUT/bow" "$OUT/pseudo" --preset albef --steps "$TRAIN_STEPS" --batch-size 16 \
    --out "$OUT/run-pseudo" --set model.queue_size=256 --set eval_every="$TRAIN_STEPS" \
    --set ckpt_every="$TRAIN_STEPS" --set optim.warmup_steps=5
step eval-bow "$VLTRAIN" eval "$OUT/run/last.pt" "$OUT/eval" --out "$OUT/run/eval-heldout.json"
step eval-pseudo "$VLTRAIN" eval "$OUT/run-pseudo/last.pt" "$OUT/eval" --out "$OUT/run-pseudo/eval-heldout.json"
"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {"bow only": out / "run/eval-heldout.json", "bow + pseudo": out / "run-pseudo/eval-heldout.json"}
res = {name: json.loads(p.read_text()) for name, p in runs.items()}
n = next(iter(res.values()))["n_samples"]
cols = ["i2t_r1", "t2i_r1", "i2t_r5", "t2i_r5", "i2t_r10", "t2i_r10", "mean_recall"]
rows = {name: r["retrieval"] for name, r in res.items()}
rows["chance"] = next(iter(res.values()))["chance"]
print(f"held-out retrieval on {n} eval pairs (vltrain eval, same set for both runs)")
print(f"{'':14}" + "".join(f"{c:>12}" for c in cols))
for name, r in rows.items():
    print(f"{name:14}" + "".join(f"{r[c]:>12.2f}" if c in r else f"{'':>12}" for c in cols))
PYEOF
