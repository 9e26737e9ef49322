PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-long test-mutations install install-peers clean gpu-check gpu-deps

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The installed packages are compiled on every core (pip compiles them one file at a time: 80 of
# its 150 s on two cores), so that an interpreter started where PYTHONDONTWRITEBYTECODE is set does
# not compile what it imports each time: tools/compile_installed.py says what it leaves out.
$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile -c constraints.txt -e ".[test,bench,s3,lightning,transformers]"
	$(BIN)/python tools/compile_installed.py
	touch $(STAMP)

install: $(STAMP)

# The checkpointing libraries the bench compares everystep with (the peers extra: DLRover's flash
# checkpoint, lm-resiliency, torch_checkpointing), with the same pinned torch. Not in `make test`:
# tests/test_libraries.py runs them where they are installed, and `make test-long` installs them.
PEERS_STAMP := $(VENV)/.peers

$(PEERS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile -c constraints.txt -e ".[peers]"
	touch $(PEERS_STAMP)

install-peers: $(PEERS_STAMP)

demo: $(STAMP)
	$(BIN)/everystep demo

# Three workers on two cores: most tests wait on processes they start (ranks, agents, killed runs)
# or on storage they hold back, and with two workers the cores stood idle for a sixth of the run; a
# third fills them (one commit, one run after the other: 354 s with two, 318-337 s with three).
# loadgroup: the tests that import PyTorch Lightning and Transformers into the test process share
# one worker.
# The package is compiled first: the suite starts hundreds of interpreters, and where bytecode is
# not written as modules are imported (PYTHONDONTWRITEBYTECODE) each would compile it again.
test: $(STAMP)
	$(BIN)/python -m compileall -q src
	$(BIN)/python -m pytest -q -n 3 --dist loadgroup -m "not long" tests

# The runs at an issue's acceptance scale (marked `long`): hosts lost again and again, four ranks, a
# lost machine of two ranks, node-local disks, the trainers on two and four ranks. Each restart starts
# interpreters anew, seconds of CPU apiece: 17 min on two cores for its 47 tests.
test-long: $(STAMP) $(PEERS_STAMP)
	$(BIN)/python -m compileall -q src
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m long tests

# The tests tested: deliberate bugs put into a scratch copy one at a time (tools/mutations.py), each
# against the tests that must catch it; fails when a bug survives.
test-mutations: $(STAMP)
	$(BIN)/python tools/mutations.py

# On a machine lent with a GPU there is nothing installed and no network: its own python3 (with a
# CUDA torch) runs the project from src/, with the test runner carried beside it in .gpu-deps
# (made here by `make gpu-deps`). Without a GPU, or without torch, it says so in one line.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)

gpu-check:
	@if $(GPU_PYTHON) -c "import torch" 2>/dev/null; then \
		PYTHONPATH=src $(GPU_PYTHON) -m everystep gpu-check $(ARGS); \
	else \
		echo "gpu-check: no GPU: $(GPU_PYTHON) has no torch; nothing to check"; \
	fi

gpu-deps: $(STAMP)
	$(BIN)/python tools/gpu_deps.py .gpu-deps

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .gpu-deps
