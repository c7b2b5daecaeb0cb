"""Issue 14 §4: the [gpu] extra installs. Checked on pyproject.toml's metadata, without touching the installed faiss.

Every faiss wheel (faiss-cpu, faiss-gpu, faiss-gpu-cu12, ...) installs the same `faiss/` package, so the layout
must never put two of them in one environment: faiss is no core dependency, and [cpu] and [gpu] bring one each.
"""

import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

if sys.version_info < (3, 11):
    pytest.skip("tomllib is Python 3.11+", allow_module_level=True)
import tomllib

PROJECT = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]


def faiss_wheels(requirements: list[str]) -> list[str]:
    return [r.name for r in map(Requirement, requirements) if r.name.startswith("faiss")]


def test_faiss_is_not_a_core_dependency():
    assert faiss_wheels(PROJECT["dependencies"]) == []


def test_cpu_and_gpu_extras_each_bring_exactly_one_faiss_build():
    extras = PROJECT["optional-dependencies"]
    assert faiss_wheels(extras["cpu"]) == ["faiss-cpu"]
    # the CUDA 12 build that declares its CUDA runtime as pip dependencies (pyproject.toml says why)
    assert faiss_wheels(extras["gpu"]) == ["faiss-gpu-cu12"]
    for name, reqs in extras.items():  # no other extra drags a second faiss in
        if name not in ("cpu", "gpu"):
            assert faiss_wheels(reqs) == [], name


def test_a_missing_faiss_is_a_one_line_error(monkeypatch):
    from vlprep import VlprepError
    from vlprep import knn

    monkeypatch.setitem(sys.modules, "faiss", None)  # what `import faiss` sees without either extra
    with pytest.raises(VlprepError, match=r"faiss is not installed .*\[cpu\].*\[gpu\]"):
        knn._faiss()
