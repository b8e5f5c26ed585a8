# Two commands on a fresh machine (Python 3.11, no GPU, no conda):
#   make notebooks   # set up .venv, execute every notebook into build/
#   make test        # set up .venv, run the whole test suite (what CI runs)
#   make test-fast   # set up .venv, unit tests and one 2-rank smoke run (the edit-test loop, under 3 minutes)
#   make lab         # set up .venv, open notebooks/ in JupyterLab on 127.0.0.1 (prints the URL with its token)
#   make gpu-check   # on a GPU machine: every notebook in fp32 and bf16 on NCCL, save throughput, docs/gpu.md
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# One ninja and one build folder for DeepSpeed's JIT op: the venv's ninja (pip's 1.13) first on PATH, since a system
# ninja (1.11) reads the other's .ninja_log as a changed command and rebuilds the op in every new process; and the op
# built inside this checkout's venv, not in ~/.cache, which other checkouts (each with its own paths) rewrite
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

.PHONY: notebooks test test-fast lab lint bench gpu-check clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first, at the tested version (the CPU build here); deepspeed's setup.py imports torch.
	$(PY) -m pip install -c constraints.txt torch
	$(PY) -m pip install -c constraints.txt -e '.[dev]'
	# DeepSpeed's CPU ranks JIT-build one op (shared-memory comm) on first use: build it here, once, so no job pays
	# for it and no two jobs wait on each other's build (a job killed mid-build would leave torch's lock behind)
	DS_ACCELERATOR=cpu $(PY) -c "import importlib; importlib.import_module('deepspeed.comm.torch').build_shm_op()"
	touch $(STAMP)

notebooks: $(STAMP)
	$(PY) -m zckpt_nb.course.notebooks --build build

test: $(STAMP)
	$(PY) -m pytest

test-fast: $(STAMP)
	$(PY) -m pytest -m fast

lab: $(STAMP)
	$(PY) -m jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.root_dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

lint: $(STAMP)
	$(PY) -m ruff check zckpt_nb tests benchmarks
	$(PY) -m vulture zckpt_nb --min-confidence 80

bench: $(STAMP)
	$(PY) benchmarks/compare_world_sizes.py --model tiny --nproc 1 2 3 4 --output_dir build/bench/compare --fresh

gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf build .pytest_cache
