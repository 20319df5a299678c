# The README's two commands: `make demo` and `make test`. Both create .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# pytest workers: the machine has 2 cores.
WORKERS ?= 2
# Where `make bench` finds the CPU build of torch (the version is pinned by the `torch`
# extra of pyproject.toml); empty: the default index only.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: demo test test-extended lint format bench docs notebooks clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[demo]"
	touch $@

$(VENV)/.dev: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,notebooks,bench,docs,models]"
	touch $(VENV)/.base $@

# The benchmark suites compare with PyTorch (benchmarks/gpt.py --torch): `make bench`
# alone adds torch, so that `make test` and `make demo` never download it.
$(VENV)/.bench: $(VENV)/.dev
	$(PY) -m pip install -q -e ".[bench,torch]" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	touch $@

demo: $(VENV)/.base
	$(PY) -m cannjax demo

lint: $(VENV)/.dev
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: $(VENV)/.dev
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Every test but those marked `extended` (the longest: operator config sweeps, smoke runs), which
# `make test-extended` runs; .ci/run runs both.
test: lint
	$(PY) -m pytest -n $(WORKERS) -q -m "not extended"

test-extended: $(VENV)/.dev
	$(PY) -m pytest -n $(WORKERS) -q -m extended

# Every suite as recorded, replacing benchmarks/results/ and benchmarks/README.md (long).
# To try a suite without touching them: .venv/bin/cannjax bench --quick NAME.
bench: $(VENV)/.bench
	$(PY) -m cannjax bench --write

# The site: feature pages, the executed notebooks (their stored outputs) and one API page
# per public module, warnings as errors. Open build/docs/html/index.html.
docs: $(VENV)/.dev
	$(PY) -m sphinx -W --keep-going -q -b html docs build/docs/html

# Re-executes the notebooks in place and stores their outputs (tests/test_notebooks.py
# fails when the stored outputs no longer match a fresh run).
notebooks: $(VENV)/.dev
	$(PY) notebooks/execute.py

clean:
	rm -rf $(VENV) build *.egg-info
