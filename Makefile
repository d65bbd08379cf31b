# Set-up and the end-to-end pipelines. `make all` and `make test` work on a fresh clone.
#   make all                       tiny synth model, no network: synth -> convert -> profile -> plan -> run
#   make all MODEL=ReluLLaMA-7B    download -> (convert if SOURCE=original) -> (quantize if QUANT=Q4_0) -> plan -> run
# Every stage is a file, so make skips a stage whose output is newer than its inputs.
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
N_PREDICT ?= 32
# Context length: plan and run must agree on it, since the KV cache is part of the VRAM plan.
CTX ?= 512

# A supported model (`qinfer profiles`); empty = the tiny synth model.
MODEL ?=
# GiB of GPU memory the model may use.
VRAM ?= 8
# gguf: the PowerInfer GGUF repo; original: HF weights + predictors, converted here.
SOURCE ?= gguf
# f16 or q4 from the GGUF repo; empty = f16 where published.
VARIANT ?=
# Q4_0 to quantize after download/convert; empty = keep the downloaded type.
QUANT ?=
MODELS_DIR ?= models

# Tiny pipeline knobs: extra `qinfer prep synth` options (shape, --train-steps), corpus and profile sizes, and a
# VRAM budget (GiB) that leaves room for about a third of the default tiny FFN's neurons (the hottest, about half
# of its activations) beside the 256 MiB scratch reserve, so the plan really splits it between GPU and CPU.
SYNTH_ARGS ?=
CORPUS_CHARS ?= 200000
PROFILE_TOKENS ?= 20000
TINY_VRAM ?= 0.2518
TINY_CTX ?= 256

.PHONY: all setup setup-floor setup-floor-dependencies test test-floor lint clean tiny model FORCE

ifeq ($(MODEL),)
all: tiny
else
all: model
endif

setup: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[serve,dev,plot]'
	touch $@

# The suite on the oldest release of every dependency that pyproject.toml allows (itself and the `serve` extra;
# the dev tools are taken as they come), in an environment of its own. Its torch comes from PyPI: a CUDA build.
FLOOR_VENV ?= .venv-floor
FLOOR_BIN := $(FLOOR_VENV)/bin
FLOOR_TESTS ?= tests

# Its pinned dependencies first, the CUDA torch the bulk of them: they write nothing in the checkout, so this part
# can run beside `make setup` (.ci/run does), while the two editable installs, which write the same egg-info, cannot.
$(FLOOR_VENV)/.dependencies: pyproject.toml .ci/floor_constraints.py
	rm -rf $(FLOOR_VENV)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_BIN)/python .ci/floor_constraints.py serve > $(FLOOR_VENV)/floors.txt
	$(FLOOR_BIN)/pip install -q -r $(FLOOR_VENV)/floors.txt
	touch $@

$(FLOOR_BIN)/.installed: $(FLOOR_VENV)/.dependencies
	$(FLOOR_BIN)/pip install -q -c $(FLOOR_VENV)/floors.txt -e '.[serve,dev]'
	touch $@

setup-floor-dependencies: $(FLOOR_VENV)/.dependencies

setup-floor: $(FLOOR_BIN)/.installed

test-floor: setup-floor
	@echo "floor environment: $$($(FLOOR_BIN)/python --version)," \
		$$($(FLOOR_BIN)/pip list --format=freeze 2>/dev/null | grep -iE "^($$(cut -d= -f1 $(FLOOR_VENV)/floors.txt | sed 's/-/[-_]/g' | paste -sd'|'))==")
	$(FLOOR_BIN)/python -m pytest -q -p no:cacheprovider $(FLOOR_TESTS)

# Plan settings that changed since the last plan (the echo differs from the file) make this stamp newer, so the
# plan is made again; unchanged ones leave it alone. So does a .gpuidx written after make's last plan (the `plan`
# stamp beside this one): a `qinfer plan` by hand, with other settings, which run would refuse as stale.
%/plan-settings: FORCE
	@mkdir -p $(@D)
	@echo "$(PLAN_SETTINGS)" | cmp -s - $@ || echo "$(PLAN_SETTINGS)" > $@
	@index="$(PLAN_INDEX)"; if [ -e "$$index" ] && [ -e $(@D)/plan ] && [ "$$index" -nt $(@D)/plan ]; then touch $@; fi

# --- the tiny synth model -------------------------------------------------------------------------------------
TINY := $(WORK)/tiny.powerinfer.gguf

tiny: PLAN_SETTINGS := vram $(TINY_VRAM) ctx $(TINY_CTX)
tiny: PLAN_INDEX := $(TINY).generated.gpuidx
tiny: $(TINY).generated.gpuidx
	$(BIN)/qinfer run -m $(TINY) -p "$(PROMPT)" -n $(N_PREDICT) -t $(THREADS) --temp 0 -c $(TINY_CTX) \
		--vram-budget $(TINY_VRAM)

$(WORK)/synth/model/config.json: $(BIN)/.installed
	$(BIN)/qinfer prep synth --out $(WORK)/synth --seed $(SEED) $(SYNTH_ARGS)

$(TINY): $(WORK)/synth/model/config.json
	$(BIN)/qinfer prep convert $(WORK)/synth/model $(WORK)/synth/predictor --outfile $@

$(WORK)/corpus.txt: $(BIN)/.installed
	$(BIN)/qinfer prep corpus --out $@ --chars $(CORPUS_CHARS) --seed $(SEED)

# summary.json is written last, so it stands for the whole activation directory.
$(WORK)/activation/summary.json: $(WORK)/synth/model/config.json $(WORK)/corpus.txt
	$(BIN)/qinfer prep profile $(WORK)/synth/model --data $(WORK)/corpus.txt --seq-len 128 \
		--tokens $(PROFILE_TOKENS) --out $(WORK)/activation --device cpu

$(TINY).generated.gpuidx: $(TINY) $(WORK)/activation/summary.json $(WORK)/plan-settings
	$(BIN)/qinfer plan -m $(TINY) --vram-budget $(TINY_VRAM) --ctx-size $(TINY_CTX) --reset-gpu-index
	touch $(WORK)/plan

# --- a supported model from the hub ---------------------------------------------------------------------------
# File names come from the model's profile, so each stage's stamp in $(STAGE) holds the path that stage produced.
DIR := $(MODELS_DIR)/$(MODEL)
STAGE := $(DIR)/.make
FINAL := $(STAGE)/$(if $(QUANT),quantized,gguf)

model: PLAN_SETTINGS := vram $(VRAM) ctx $(CTX)
model: PLAN_INDEX = $$(cat $(FINAL) 2>/dev/null).generated.gpuidx
model: $(STAGE)/plan
	$(BIN)/qinfer run -m "$$(cat $(FINAL))" -p "$(PROMPT)" -n $(N_PREDICT) -t $(THREADS) --temp 0 -c $(CTX) \
		--vram-budget $(VRAM)

# Order-only on the set-up: reinstalling must not trigger a new download.
$(STAGE)/download: | $(BIN)/.installed
	@mkdir -p $(@D)
	$(BIN)/qinfer prep download $(MODEL) --source $(SOURCE) $(if $(VARIANT),--variant $(VARIANT) )--dir $(DIR) > $@.tmp
	mv $@.tmp $@

ifeq ($(SOURCE),original)
$(STAGE)/gguf: $(STAGE)/download
	$(BIN)/qinfer prep convert $(DIR)/model $(DIR)/predictor --outfile $(DIR)/$(MODEL).powerinfer.gguf
	echo "$(DIR)/$(MODEL).powerinfer.gguf" > $@
else
$(STAGE)/gguf: $(STAGE)/download
	cp $< $@
endif

# X.powerinfer.gguf -> X.q4.powerinfer.gguf, the hub's naming.
$(STAGE)/quantized: $(STAGE)/gguf
	in="$$(cat $<)"; case "$$in" in *.powerinfer.gguf) out="$${in%.powerinfer.gguf}.q4.powerinfer.gguf";; \
		*) out="$${in%.gguf}.q4.gguf";; esac; \
	$(BIN)/qinfer prep quantize "$$in" "$$out" $(QUANT) && echo "$$out" > $@

$(STAGE)/plan: $(FINAL) $(STAGE)/plan-settings
	$(BIN)/qinfer plan -m "$$(cat $(FINAL))" --vram-budget $(VRAM) --ctx-size $(CTX) --reset-gpu-index
	touch $@

# --------------------------------------------------------------------------------------------------------------
test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(WORK)
