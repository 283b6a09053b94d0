# One-command set-up on a fresh machine (Python >= 3.10 with pip).
# torch is pinned to the 2.13.0 CPU wheel in the same pip call, so pip never resolves
# a newer torch (which would pull gigabytes of CUDA packages).
PYTHON ?= python3
PIP_INSTALL = $(PYTHON) -m pip install --disable-pip-version-check --quiet
WORKERS ?= 2

.PHONY: install demo test typecheck bench clean

install:
	$(PIP_INSTALL) "torch==2.13.0" -e ".[test,examples,bench,models]"

demo: install
	$(PYTHON) -m unison.launch --workers $(WORKERS) examples/digits.py

test: install
	$(PYTHON) -m pytest -q

typecheck: install
	$(PIP_INSTALL) mypy
	$(PYTHON) -m mypy src/unison --ignore-missing-imports

bench: install
	$(PYTHON) benchmarks/fast_path.py
	$(PYTHON) benchmarks/multi_worker.py

clean:
	rm -rf build dist src/*.egg-info .pytest_cache benchmarks/out checkpoints
