# Two set-up commands (README): `make train` runs the main job, `make test` runs the linter
# (ruff, settings in pyproject.toml), then the tests.
# Both create .venv and install everything on first use (CPU torch from constraints.txt).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: train test lint install
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $@

train: install
	$(BIN)/raggedvl train

lint: install
	$(BIN)/ruff check

test: lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q
