# The commands of the README: `make demo`, `make test` (everything, as CI runs it) and `make test-fast` (the unit
# tier: tests/vlprep and tests/vltrain less the tests marked `slow`, which load packaged models or real data or spend
# seconds in subprocesses; every test in tests/integration is `slow`, see tests/integration/conftest.py). Every
# target installs the exact versions of requirements.lock into .venv: `make demo` only the core and the [cpu] extra
# (all the demo imports), the others everything (the [cpu,test,ray,cloud] extras).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
LOCK := requirements.lock
PYTEST_ARGS ?=
# `make test` and `make test-fast` run the tests in JOBS processes (pytest-xdist), a test file per process at a time
# (so a module's fixtures are built once), each process with its share of the cores; JOBS=1 runs them in this one.
JOBS ?= $(shell nproc 2>/dev/null || echo 1)
XDIST = $(if $(filter 1,$(JOBS)),,-n $(JOBS) --dist loadfile)

.PHONY: install install-demo apt lock test test-fast test-kernels demo ablation learns gpu-wheels gpu-check clean

# Reinstalls when pyproject.toml or the lock changes; pip moves a venv left at other versions to the locked ones.
# The full install holds the demo's too, so it stamps both.
$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c $(LOCK) -e '.[cpu,test,ray,cloud]'
	touch $(STAMP) $(DEMO_STAMP)

# The demo's install: the core and [cpu] from the same lock, without the test, ray and cloud extras.
$(DEMO_STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c $(LOCK) -e '.[cpu]'
	touch $(DEMO_STAMP)

install: $(STAMP)

install-demo: $(DEMO_STAMP)

apt:
	bash scripts/apt-deps.sh

# Re-resolve requirements.lock from pyproject.toml's ranges (newest releases), then run `make test` on it.
lock:
	PYTHON=$(PYTHON) LOCK=$(LOCK) bash scripts/lock.sh

test: apt install
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)
	PY=$(PY) bash scripts/test-kernels.sh $(XDIST)

# The numeric tests again with an older CPU's kernels (SSE4.1 instead of AVX): a test that holds only on the CPU it
# was written on fails here too (about 1 minute; part of `make test`).
test-kernels: install
	PY=$(PY) bash scripts/test-kernels.sh $(XDIST)

# 2 min 20 s on 2 CPU cores (measured once installed, alone, as the README says).
test-fast: install
	$(PY) -m pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS)

# The demo needs the openclipart Debian packages only (no browser): scripts/apt-deps.sh --demo.
demo: install-demo
	bash scripts/apt-deps.sh --demo --required
	PY=$(PY) VLPREP=$(VENV)/bin/vlprep VLTRAIN=$(VENV)/bin/vltrain $(if $(LIMIT),LIMIT=$(LIMIT)) bash examples/openclipart/run.sh

# Does training still learn? 100 CLIP-style steps on the demo's cached bow tokens (run `make demo` first), evaluated
# on its held-out split; scripts/learns.py then prints PASS or FAIL and fails the target unless held-out R@1 reaches
# 10x its chance level both ways. Measured once: 5 min 12 s on 2 CPU cores shared with the demo and a test (load
# 6-8; not yet timed alone), PASS at R@1 29.5 / 31.1 against 1.6 chance. The warm-up is 10 of its 100 steps
# (optim.warmup_steps is a step count, 100 by default: the whole of this run).
learns: install-demo
	rm -rf demo-out/learns
	$(VENV)/bin/vltrain run demo-out/openclipart/bow-feat --preset $(or $(PRESET),clip) --steps 100 \
		--batch-size 32 --set optim.warmup_steps=10 --set eval_every=50 --out demo-out/learns
	$(PY) scripts/learns.py demo-out/learns

# The papers' headline ablations at small scale (pipelines/README.md): make ablation RECIPE=fistful [QUICK=1]
# [SEEDS=3] [STEPS=N]; `.venv/bin/python pipelines/ablation.py --list` lists the recipes. An input a recipe needs
# and lacks (the demo's outputs included) is built first.
ablation: install
	$(PY) pipelines/ablation.py $(or $(RECIPE),fistful) $(if $(QUICK),--quick) $(if $(STEPS),--steps $(STEPS)) \
		$(if $(SEEDS),--seeds $(SEEDS))

# The GPU check (scripts/gpu-check.sh): `make gpu-wheels` here (PyPI needed) fills .gpu/ with the few wheels an
# offline GPU node lacks; copy the tree with .gpu/ there and run `bash scripts/gpu-check.sh --out $OUT/check` as one
# device call with timeout_s 600: its steps share a 540 s budget (--budget; a step that does not fit is reported
# "not run: budget"), and OUT_DIR gets three files (gpu-check.md, gpu-check.json, logs.tar.gz), rewritten before
# each step; `make gpu-check` runs its CPU dry run here (part of `make test` too).
gpu-wheels: install
	PY=$(PY) bash scripts/gpu-wheels.sh

gpu-check: install
	PY=$(PY) bash scripts/gpu-check.sh --dry-run

clean:
	rm -rf $(VENV) demo-out
