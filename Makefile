# Two commands on a fresh machine: `make demo` (a real bulk job, end to end) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
# The CPU build that lies on this kind of machine; on a GPU box set TORCH_SPEC to a CUDA build.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: setup
	$(BIN)/llmq demo

test: setup
	$(BIN)/lint-imports
	$(BIN)/pytest

bench: setup
	$(BIN)/python benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) var
