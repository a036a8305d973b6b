# `make demo` and `make test` each set up .venv on a fresh machine, then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-costs test-floor lint clean

$(STAMP): pyproject.toml tools/pip_indexes.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# uv unpacks torch's wheels several times faster than pip, from the sources pip is set to use
	@# (tools/pip_indexes.py) and resolving as pip does; pip itself where uv cannot be had
	$(BIN)/python -m pip install -q uv && $(BIN)/uv pip install -q --python $(BIN)/python \
	    --index-strategy unsafe-best-match $$($(BIN)/python tools/pip_indexes.py) -e '.[dev]' \
	  || $(BIN)/python -m pip install -q --no-compile -e '.[dev]'
	@# byte-compiled on every core (pip would on one; some packages ship files that do not compile, skipped)
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/memguard demo

# the two type checks run at once, each on a core with its own cache; either failing fails the target
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy --platform win32 --cache-dir .mypy_cache/win32 & win=$$!; $(BIN)/mypy; linux=$$?; wait $$win && exit $$linux

# one worker per core (two on CI), each test handed to whichever worker is free; the slowest tests are listed
test: lint
	$(BIN)/python -m pytest -m "not cuda" -n auto --dist worksteal --durations=15

# the tests measured under 2 s that need no two-rank launch, in under 3 minutes on two cores: tests/conftest.py marks
# the others `slow` or `ddp` from tests/costs.json, what each test cost in a full run
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not cuda and not slow and not ddp" -n auto --dist worksteal -q

# every test's cost measured again into tests/costs.json: the whole suite, each test's seconds added up
test-costs: $(STAMP)
	MEMGUARD_TEST_COSTS=tests/costs.json $(BIN)/python -m pytest -m "not cuda" -n auto --dist worksteal -q

# the oldest releases supported (tools/floor.txt: torch, torchvision, lightning, timm, transformers), in a venv of
# their own, the rest resolved as `make test` resolves it; CI runs it after `make test` (.ci/run)
FLOOR := .venv-floor
$(FLOOR)/.installed: pyproject.toml tools/floor.txt tools/pip_indexes.py
	test -x $(FLOOR)/bin/python || $(PYTHON) -m venv $(FLOOR)
	$(FLOOR)/bin/python -m pip install -q uv && $(FLOOR)/bin/uv pip install -q --python $(FLOOR)/bin/python \
	    --index-strategy unsafe-best-match $$($(FLOOR)/bin/python tools/pip_indexes.py) --constraint tools/floor.txt \
	    -e '.[dev]' || $(FLOOR)/bin/python -m pip install -q --no-compile --constraint tools/floor.txt -e '.[dev]'
	touch $@

test-floor: $(FLOOR)/.installed
	$(FLOOR)/bin/python -c "import torch, lightning; print('floor: torch', torch.__version__, 'lightning', lightning.__version__)"
	$(FLOOR)/bin/python -m pytest -m "not cuda" -n auto --dist worksteal -q

# what make demo and the examples leave here: demo_logs, lightning_logs, the spill checkpoint of an older spill example
clean:
	rm -rf $(VENV) $(FLOOR) demo_logs lightning_logs .pytest_cache .mypy_cache .ruff_cache
	rm -f checkpoints/memguard-spill-*.ckpt && { rmdir checkpoints 2>/dev/null || true; }
