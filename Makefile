PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test,bench,lightning,transformers]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/everystep demo

# Two workers: most tests wait on processes they start (ranks, agents, killed runs), so two
# workers keep a 2-core machine busy; more would crowd the ranks those tests start. loadgroup: the
# tests that import PyTorch Lightning and Transformers into the test process share one worker.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup tests

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
