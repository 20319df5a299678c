# The README's two commands: `make demo` and `make test`. Both create .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# pytest workers: the machine has 2 cores.
WORKERS ?= 2

.PHONY: demo test lint format bench clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[demo]"
	touch $@

$(VENV)/.dev: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,notebooks,bench]"
	touch $(VENV)/.base $@

demo: $(VENV)/.base
	$(PY) -m cannjax demo

lint: $(VENV)/.dev
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: $(VENV)/.dev
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	$(PY) -m pytest -n $(WORKERS) -q

bench: $(VENV)/.dev
	$(PY) -m cannjax bench

clean:
	rm -rf $(VENV) build *.egg-info
