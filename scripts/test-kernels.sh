#!/usr/bin/env bash
# The numeric tests again, with the CPU kernels an older x86-64 CPU gets (no AVX: SSE4.1 in oneDNN, SSE4.2 in MKL,
# ATen's default non-vectorised path). Other kernels sum in other orders and round differently, which is how a
# test that only held on the CPU it was written on shows up here before it fails on a stranger's machine.
set -euo pipefail
PY=${PY:-.venv/bin/python}
echo "numeric tests with other CPU kernels (ATEN_CPU_CAPABILITY=default DNNL_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2)"
ATEN_CPU_CAPABILITY=default DNNL_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2 \
  "$PY" -m pytest -q -p no:cacheprovider "$@" \
  tests/vltrain/test_losses.py tests/vltrain/test_fidelity.py tests/vltrain/test_softmask.py \
  tests/vlprep/test_features.py tests/vltrain/test_model.py tests/vltrain/test_presets_pinned.py \
  "tests/integration/test_ddp.py::test_two_gloo_ranks_equal_one_process_on_the_global_batch"
