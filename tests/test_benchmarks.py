"""Every benchmark script still imports and parses its options: a benchmark that rots silently (a renamed
helper) is only found when someone needs its figure. The benchmarks themselves run outside the suite."""

import subprocess
import sys
from pathlib import Path

import pytest

# common.py is the helper module the scripts share, not a script
SCRIPTS = sorted(p for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py") if p.name != "common.py")


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_benchmark_script_imports_and_shows_help(script):
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout
