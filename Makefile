# make test: create .venv if needed, install the project with the pinned CPU torch, run the whole suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo install vectors bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[torch,viz,export,dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest tests

demo: $(STAMP)
	$(BIN)/trainhist demo --inject-nan 20

vectors: $(STAMP)
	$(BIN)/python tools/gen_vectors.py

bench: $(STAMP)
	$(BIN)/python tools/bench_format.py

clean:
	rm -rf demo_out .pytest_cache build dist
