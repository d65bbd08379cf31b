# Set-up and the tiny end-to-end pipeline. `make all` and `make test` work on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel this project is developed with; with a GPU, `make TORCH_SPEC=torch` takes a CUDA build.
TORCH_SPEC ?= torch==2.13.0
WORK ?= work/tiny
SEED ?= 0
PROMPT ?= Once upon a time
THREADS ?= 2

.PHONY: all setup test lint clean

all: $(WORK)/tiny.powerinfer.gguf
	$(BIN)/qinfer run -m $< -p "$(PROMPT)" -n 32 -t $(THREADS) --temp 0

setup: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

$(WORK)/synth/model/config.json: $(BIN)/.installed
	$(BIN)/qinfer prep synth --out $(WORK)/synth --seed $(SEED)

$(WORK)/tiny.powerinfer.gguf: $(WORK)/synth/model/config.json
	$(BIN)/qinfer prep convert $(WORK)/synth/model $(WORK)/synth/predictor --outfile $@

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(WORK)
