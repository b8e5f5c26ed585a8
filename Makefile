# Two commands on a fresh machine (Python 3.11, no GPU, no conda):
#   make notebooks   # set up .venv, execute every notebook into build/
#   make test        # set up .venv, run the whole test suite (what CI runs)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: notebooks test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch first and pinned: the CPU build here, and deepspeed's setup.py imports torch.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	touch $(STAMP)

notebooks: $(STAMP)
	$(PY) -m zckpt_nb notebooks --build build

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(PY) -m ruff check zckpt_nb tests benchmarks

clean:
	rm -rf build .pytest_cache
