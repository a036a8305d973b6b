# `make demo` and `make test` each set up .venv on a fresh machine, then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# --no-compile: Python compiles only the modules a run imports, when it first imports them, not all of torch's
	$(BIN)/python -m pip install -q --no-compile -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/memguard demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mypy --platform win32

# one worker per core (two on CI), each test handed to whichever worker is free; the slowest tests are listed
test: lint
	$(BIN)/python -m pytest -m "not cuda" -n auto --dist worksteal --durations=15

clean:
	rm -rf $(VENV) demo_logs lightning_logs .pytest_cache .mypy_cache .ruff_cache
