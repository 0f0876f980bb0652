# The targets are the commands people type. Each one sets up its own venv from nothing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; a bare "torch" pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 2

.PHONY: help install install-dev demo test test-all test-fast train train-ddp train-fsdp bench bench-fitrule gpu-check format lint typecheck check clean

help:
	@echo "make demo        train the tiny model on the stdlib corpus with DDP on $(NPROC) processes, plot the loss, print the validation perplexity and a sample"
	@echo "make train       train the built-in default (1 process)"
	@echo "make train-ddp   train configs/ddp.yaml;  make train-fsdp: configs/fsdp.yaml"
	@echo "make test        the test suite but its longest tests (real gloo processes on CPU); make test-all: all of it; make test-fast: a quick part of every test module, before every commit (~3 min)"
	@echo "make bench       loop overhead, the optimizer step, the MoE experts' kernels, the outer codec, the collectives' bus bandwidth, checkpoint save throughput, the pipeline bubble, then the strategy sweep (report in bench-out/)"
	@echo "make bench-fitrule  the fit rule dtlab plan applies: short trainings under a cgroup memory cap at fractions of the prediction (root; ~10 min; bench-out/fitrule.json)"
	@echo "make gpu-check   prove a GPU machine in under 10 minutes: every CUDA test, a 1B bf16 + compile training, memory, async saves, resume, the collectives across every GPU, layouts (report in runs/gpu-check-*; on CPU a smoke of the same)"
	@echo "make check       lint + format check + type check"
	@echo "make install     torch (CPU) and dtlab, what demo/train/bench use;  make install-dev: + the dev extra"

# Two layers: the package alone (what demo, train and bench run), then the dev extra on top (tests,
# linters, type checker, and what the tests compare against: transformers, datasets, mlx).
$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e .
	touch $@

$(BIN)/.installed-dev: $(BIN)/.installed
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

install: $(BIN)/.installed

install-dev: $(BIN)/.installed-dev

# One timestamp per make invocation: the run directory the demo trains in and then samples from.
DEMO_STAMP := $(shell date +%Y%m%d-%H%M%S)
DEMO_DIR ?= runs/demo-$(DEMO_STAMP)
DEMO_PROMPT ?= class
demo: install
	$(BIN)/dtlab train configs/demo.yaml --nproc $(NPROC) --set run.dir=$(DEMO_DIR)
	@printf '\nsample (200 tokens, temperature 0.7, top-k 20, seed 0):\n%s ' "$(DEMO_PROMPT)"
	@$(BIN)/dtlab generate $(DEMO_DIR) --prompt "$(DEMO_PROMPT) " --max-new-tokens 200 --temperature 0.7 --top-k 20 --seed 0 \
		2> $(DEMO_DIR)/generate.log || { cat $(DEMO_DIR)/generate.log; exit 1; }
	@echo

train: install
	$(BIN)/dtlab train

train-ddp: install
	$(BIN)/dtlab train configs/ddp.yaml --nproc $(NPROC)

train-fsdp: install
	$(BIN)/dtlab train configs/fsdp.yaml --nproc $(NPROC)

# Every test but the longest (marked slow: tests/slow.txt, chosen by tests/pick_fast.py from the
# measured durations, and a few marked in place); make test-all runs them too.
test: install-dev
	$(BIN)/python -m pytest -q -m "not slow"

test-all: install-dev
	$(BIN)/python -m pytest -q

# A quick test or more of every test module (tests/fast.txt, chosen by tests/pick_fast.py from the
# measured durations): about 2 minutes, for the edit loop. make test-all runs everything.
test-fast: install-dev
	$(BIN)/python -m pytest -q --fast

bench: install
	$(BIN)/python -m dtlab.bench.overhead
	$(BIN)/python -m dtlab.bench.optimizer
	$(BIN)/python -m dtlab.bench.experts
	$(BIN)/python -m dtlab.bench.codec
	$(BIN)/python -m dtlab.bench.collectives
	$(BIN)/python -m dtlab.bench.checkpoint --preset small
	$(BIN)/python -m dtlab.bench.pipeline --out bench-out/pipeline
	$(BIN)/dtlab bench --strategies single,ddp,fsdp,hsdp --nproc 1,2,4 --steps 8 --out bench-out \
		--set model.preset=tiny data.source=stdlib parallel.replicate=2

# Real trainings under a cgroup memory cap set from the plan's prediction (needs root and a writable
# memory cgroup): the margin docs/planning.md and src/dtlab/analysis/fitrule.py carry.
bench-fitrule: install
	$(BIN)/python -m dtlab.bench.fitrule --json bench-out/fitrule.json

# Every CUDA test, a llama3.2-1b training (tokens/s, MFU, peak memory against dtlab plan), async saves,
# a resume, and with 2 GPUs the layouts and a killed rank; report.md and report.json name the card
# (docs/gpu.md). GPU_CHECK_ARGS passes options, e.g. GPU_CHECK_ARGS="--out runs/gpu-check --skip cuda-tests".
GPU_CHECK_ARGS ?=
gpu-check: install-dev
	$(BIN)/python -m dtlab.gpucheck $(GPU_CHECK_ARGS)

format: install-dev
	$(BIN)/ruff format src tests
	$(BIN)/ruff check --fix src tests

lint: install-dev
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

typecheck: install-dev
	$(BIN)/mypy

check: lint typecheck

clean:
	rm -rf $(VENV) runs bench-out .pytest_cache .mypy_cache .ruff_cache
