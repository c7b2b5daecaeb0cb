"""What installs: the [cpu]/[gpu] extras (checked on pyproject.toml's metadata, without touching the installed
faiss), the lock (requirements.lock) against the environment, and the versions outputs record.

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

PROJECT = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]


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


# --- the lock (requirements.lock): the environment the tests run in is the one it pins ---------------------------

LOCK = Path(__file__).parents[2] / "requirements.lock"


def read_lock(text: str) -> dict[str, str]:
    """requirements.lock -> {canonical name: version}; every line that is not a comment is `name==version`."""
    from packaging.utils import canonicalize_name

    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and name and version, f"requirements.lock: {line!r} is not name==version"
            pins[canonicalize_name(name)] = version
    return pins


def lock_disagreements(pins: dict[str, str], installed) -> list[str]:
    """One line per locked package that is missing or at another version (pip's == ignores a local label)."""
    from packaging.specifiers import SpecifierSet

    out = []
    for name, version in sorted(pins.items()):
        have = installed(name)
        if have is None:
            out.append(f"{name} is not installed; the lock has {version}")
        elif not SpecifierSet(f"=={version}").contains(have, prereleases=True):
            out.append(f"{name} {have} is installed; the lock has {version}")
    return out


def _installed(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def test_the_lock_pins_the_core_dependencies():
    pins = read_lock(LOCK.read_text())
    for name in ("torch", "torchvision", "transformers", "tokenizers", "numpy", "pillow", "pyarrow", "webdataset",
                 "wids", "spacy", "ray", "faiss-cpu", "opencv-python-headless", "pytest"):
        assert name in pins, name


def test_the_installed_environment_is_the_locked_one():
    bad = lock_disagreements(read_lock(LOCK.read_text()), _installed)
    assert not bad, "the environment is not requirements.lock's (run `make install`): " + "; ".join(bad)


def test_lock_disagreements_name_each_package_in_one_line():
    pins = read_lock("# a comment\ntorch==2.15.0\nNumPy==2.4.6  # why\nray==2.60.0\n")
    have = {"torch": "2.15.0+cpu", "numpy": "2.3.0"}
    assert lock_disagreements(pins, have.get) == ["numpy 2.3.0 is installed; the lock has 2.4.6",
                                                  "ray is not installed; the lock has 2.60.0"]


# --- what made an output ------------------------------------------------------------------------------------------


def test_version_flags_print_the_project_torch_and_transformers():
    from importlib.metadata import version

    from typer.testing import CliRunner

    from vlprep import __version__
    from vlprep.cli import app as vlprep_app
    from vltrain.cli import app as vltrain_app

    for prog, app in (("vlprep", vlprep_app), ("vltrain", vltrain_app)):
        r = CliRunner().invoke(app, ["--version"])
        assert r.exit_code == 0
        assert r.output.strip() == (f"{prog} {__version__} (torch {version('torch')}, "
                                    f"transformers {version('transformers')})")


def test_meta_json_records_the_versions(tmp_path):
    import json
    from importlib.metadata import version

    from vlprep.output import Out, finish_dataset

    finish_dataset(Out(tmp_path), {}, {"stage": "test"})
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["versions"] == {"vlprep-vltrain": meta["vlprep_version"], "torch": version("torch"),
                                "transformers": version("transformers")}
