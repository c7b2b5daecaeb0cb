"""The `cuda` marker: a skip without a device, a failure when VLTRAIN_REQUIRE_CUDA=1 asks for the device."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
TEST = "tests/vltrain/test_cuda.py::test_grit_gives_the_same_batches_on_cuda_as_on_the_cpu"


def pytest_on_a_cuda_test(require: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VLTRAIN_REQUIRE_CUDA"}
    if require is not None:
        env["VLTRAIN_REQUIRE_CUDA"] = require
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", TEST], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_test_skips_without_a_device_unless_the_device_is_required():
    for require in (None, "0"):
        r = pytest_on_a_cuda_test(require)
        assert r.returncode == 0 and "1 skipped" in r.stdout and "needs a CUDA device" in r.stdout, r.stdout
    r = pytest_on_a_cuda_test("1")
    assert r.returncode == 1 and "1 error" in r.stdout, r.stdout  # a failed setup: the test body never ran
    assert "VLTRAIN_REQUIRE_CUDA=1 but torch sees no CUDA device" in r.stdout, r.stdout
