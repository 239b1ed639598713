# optmem: the README's two commands are `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip

.PHONY: setup demo test lint circles bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: a looser requirement pulls a multi-GB CUDA build here.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[all,torch]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) -m optmem demo

# lint-imports: the layer contract of pyproject.toml [tool.importlinter] (docs/architecture.md).
test: setup lint
	$(PY) -m pytest -q --doctest-modules optmem tests

lint: setup
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) tools/import_graph.py --modules
	$(PY) -m mypy optmem

# Import circles (package- and module-level, lazy imports included); exits 1 on any circle
# (also run by `make lint`).
circles: setup
	$(PY) tools/import_graph.py --modules

# The headline benchmark (persistent DP vs a C transcription of rotor); the others are
# benchmarks/bench_*.py (see benchmarks/RESULTS.md, reassembled by collect_results.py).
bench: setup
	$(PY) benchmarks/bench_checkpoint_dp.py
	$(PY) benchmarks/collect_results.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .import_linter_cache build *.egg-info
