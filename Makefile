# Two commands do everything on a fresh machine: `make demo` and `make test`.
# tools/setup_env.py makes the virtual environment once (again if it is broken), one set-up at
# a time; it sees the system's packages and those of the venv python3 runs in, so a machine
# that already has a (GPU) torch keeps it: torch is installed only where it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test setup clean

setup:
	$(PYTHON) tools/setup_env.py $(VENV)

demo: setup
	$(BIN)/moe-train demo --workdir demo-work

# Test files run in parallel, one worker per core up to 4 (none on one core): most integration
# tests drive single-threaded CLI processes, which leave a second core idle.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; [ $$n -lt 2 ] && n=0; echo $$n)

test: setup
	$(BIN)/python -m pytest -q -rs --durations=25 -n $(TEST_WORKERS) --dist loadfile tests   # -rs: every skipped test says why; the 25 slowest, for the CI budget

clean:
	rm -rf demo-work .pytest_cache
