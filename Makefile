# labkit: two commands do all set-up on a fresh clone.
#   make lab   — create .venv, install labkit + notebook extras, register the kernel, open JupyterLab on notebooks/
#   make workshop — the same, opened at the repository root (notebooks/ and workshops/exercises/ side by side)
#   make handout — a participants' copy of the repository in handout/, without the exercises' solutions
#   make test  — create .venv, install labkit + test extras, run every test (notebooks included)
#   make test-fast — the tests that start no process and run no notebook (under 2 minutes)
#   make hub   — JupyterHub on this machine, a seat per participant (LABKIT_HUB_USERS, LABKIT_HUB_PASSWORD: README)
#
# torch (TORCH_VERSION): labkit/torch_build.py picks the build for this machine (README, "Supported platforms"): the
# CPU build on Linux x86_64 without an NVIDIA GPU (a local +cpu wheel pip is configured with, else PyTorch's CPU
# index), PyPI's default elsewhere. A TORCH_SPEC given by the user always wins, e.g.
#   make lab TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"

SHELL      := /bin/bash
.SHELLFLAGS := -o pipefail -c

PYTHON     ?= python3
VENV       ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_SPEC ?=
LAB_ARGS   ?=
LAB_DIR    ?= notebooks
HANDOUT    ?= handout
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip --disable-pip-version-check -q
ROOT_FLAG  := $(if $(filter 0,$(shell id -u)),--allow-root,)
SUDO       := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: lab workshop handout test test-fast lint venv clean benchmark browser hub

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip 2>&1 | { grep -v "is ignored" || true; }

# torch first, pinned to the chosen build, so that the range in pyproject.toml is already satisfied and nothing
# pulls a different (multi-GB CUDA) build. The stamp re-runs on changes.
$(VENV)/.installed-%: pyproject.toml | $(PY)
	spec="$(TORCH_SPEC)"; [ -n "$$spec" ] || spec="$$($(PY) labkit/torch_build.py $(TORCH_VERSION))" || exit 1; \
	echo "pip install $$spec"; $(PIP) install $$spec 2>&1 | { grep -v "is ignored" || true; }
	$(PIP) install -e ".[$*]" 2>&1 | { grep -v "is ignored" || true; }
	$(PY) -c "import labkit, torch; print('labkit', labkit.__version__, 'with torch', torch.__version__)"
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(VENV)/.installed-notebook,test

# JupyterLab's own settings for a room: no news pop-up over the corner of every screen, no update checks.
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings/overrides.json
$(LAB_SETTINGS): configs/jupyterlab/overrides.json | $(PY)
	mkdir -p $(dir $@) && cp $< $@

lab: $(VENV)/.installed-notebook,test $(LAB_SETTINGS)
	$(PY) -m ipykernel install --sys-prefix --name labkit --display-name "Python (labkit)" >/dev/null
	$(VENV)/bin/jupyter lab --notebook-dir=$(LAB_DIR) --ServerApp.ip=127.0.0.1 $(ROOT_FLAG) $(LAB_ARGS)

workshop:
	$(MAKE) lab LAB_DIR=.

# One machine serves the room: JupyterHub (configs/hub/jupyterhub_config.py, labkit/hub.py) on HUB_IP:HUB_PORT, a
# seat per name in LABKIT_HUB_USERS, all logging in with LABKIT_HUB_PASSWORD; LABKIT_HUB_CPUS cores per seat,
# LABKIT_HUB_MEMORY of data per process. Its proxy (configurable-http-proxy, pinned) goes into .hub/, not globally.
HUB_IP    ?= 127.0.0.1
HUB_PORT  ?= 8000
CHP_SPEC  ?= configurable-http-proxy@5.3.0
HUB_PROXY := .hub/node_modules/.bin/configurable-http-proxy
$(HUB_PROXY):
	npm install --prefix .hub --no-audit --no-fund $(CHP_SPEC)

# jupyterhub (the hub extra) beside the notebook and test extras, in a stamp of its own: `make lab` keeps it
$(VENV)/.hub-installed: pyproject.toml $(VENV)/.installed-notebook,test
	$(PIP) install -e ".[notebook,test,hub]" 2>&1 | { grep -v "is ignored" || true; }
	touch $@

hub: $(VENV)/.hub-installed $(LAB_SETTINGS) $(HUB_PROXY)
	$(PY) -m ipykernel install --sys-prefix --name labkit --display-name "Python (labkit)" >/dev/null
	$(PY) -m labkit.hub  # the settings checked, and said, before anything starts
	$(PY) -m jupyterhub -f configs/hub/jupyterhub_config.py --ip=$(HUB_IP) --port=$(HUB_PORT)

# A participants' copy in $(HANDOUT)/: every tracked file but the solutions, the instructor's notes and the tests
# (labkit/workshop/handout.py); it fails if the copy would hold a solution line.
handout: $(VENV)/.installed-notebook,test
	$(PY) -m labkit workshop handout $(HANDOUT)

# Debian's chromium for the browser tests (tests/browser): Playwright drives it; its own browser download is not used.
browser:
	@command -v chromium >/dev/null || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium; }

test: $(VENV)/.installed-notebook,test $(VENV)/.hub-installed $(HUB_PROXY) $(LAB_SETTINGS) browser lint
	LABKIT_QUICK=1 $(PY) -m pytest --nbval-lax -p no:cacheprovider --durations=25 tests notebooks

# pyflakes and pycodestyle over the code, as pyproject.toml's [tool.ruff] configures them (lines of 120)
lint: $(VENV)/.installed-notebook,test
	$(VENV)/bin/ruff check labkit benchmarks tests

# No worker processes, no notebooks: the library's logic, in under two minutes. tests/conftest.py refuses a
# Python process to any test not marked multiproc, so nothing slow slips in unmarked.
test-fast: $(VENV)/.installed-notebook,test lint
	$(PY) -m pytest -p no:cacheprovider -m "not multiproc and not notebook" --durations=10 tests

# Every CPU benchmark, each appending its result tables to benchmarks/results/NAME.jsonl. Attention stops at
# 4096 tokens (its target's length); compression trains three compressors for 600 steps each here (its
# verdict's 4,800-step runs on several seeds take much longer: see its docstring). Left out: the GPU-only
# ones (gpu_attention.py, gpu_comm_check.py, gpu_check.sh: run them on a GPU node), browser_times.py
# (JupyterLab in chromium, every notebook in quick and full mode: `make browser`, then run it by hand) and
# hub_sizing.py (memory and CPU per seat of `make hub` during a lab: by hand, on a quiet machine).
# dashboard_cost.py --browser launches its runs from a notebook in JupyterLab in chromium (24 rounds of 3 runs: ~30 min).
benchmark: $(VENV)/.installed-notebook,test $(LAB_SETTINGS) browser
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/attention.py --seqs 512 1024 2048 4096
	$(PY) benchmarks/data_parallel.py
	$(PY) benchmarks/model_parallel.py
	$(PY) benchmarks/context_parallel.py
	$(PY) benchmarks/memory_cap.py
	$(PY) benchmarks/checkpoint.py
	$(PY) benchmarks/cap.py
	$(PY) benchmarks/compression.py --steps 600 --compressors none powersgd topk
	$(PY) benchmarks/dashboard_cost.py --browser
	$(PY) benchmarks/sim_calibration.py
	$(PY) benchmarks/moe.py
	$(PY) benchmarks/async_save.py
	$(PY) benchmarks/chaos_soak.py
	$(PY) benchmarks/capstone.py
	$(PY) benchmarks/heal.py

clean:
	rm -rf $(VENV) notebooks/runs runs
