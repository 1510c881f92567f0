# Two commands do everything on a fresh machine: `make demo` and `make test`.
# The virtual environment sees system packages, so a machine that already has a (GPU) torch
# keeps it; torch is installed only where it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test setup clean

$(STAMP): setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/moe-train demo --workdir demo-work

# Test files run in parallel, one worker per core up to 4 (none on one core): most integration
# tests drive single-threaded CLI processes, which leave a second core idle.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; [ $$n -lt 2 ] && n=0; echo $$n)

test: $(STAMP)
	$(BIN)/python -m pytest -q -rs --durations=25 -n $(TEST_WORKERS) --dist loadfile tests   # -rs: every skipped test says why; the 25 slowest, for the CI budget

clean:
	rm -rf demo-work .pytest_cache
