# Every target that needs the environment depends on $(STAMP): the first use
# creates .venv and installs everything; later uses cost nothing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Without a CUDA driver take the CPU build of torch (it lies on this machine's
# disk); with one, pip's default build.  Override: make install TORCH='torch==X'.
TORCH   ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)
JOBS    ?= 2

.PHONY: install test lint bias-study bias-study-quick report train-demo train-compare train-study train-study-quick bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev,hf]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check seco_lab experiments tests

bias-study: $(STAMP)
	$(BIN)/python -m experiments.bias_study --jobs $(JOBS)
	$(BIN)/python -m seco_lab.report bias

bias-study-quick: $(STAMP)
	$(BIN)/python -m experiments.bias_study --quick --jobs $(JOBS)

report: $(STAMP)
	$(BIN)/python -m seco_lab.report bias
	@if [ -f reports/training/throughput.csv ]; then $(BIN)/python -m seco_lab.report training; fi
	@if [ -f reports/bench/results.csv ]; then $(BIN)/python -m seco_lab.report bench; fi

# A few minutes of SeCO on the Python standard library's sources (byte level).
train-demo: $(STAMP)
	$(BIN)/seco-lab train --run-dir runs/demo --overwrite --mode seco --data text --seq-len 1024 \
	  --chunk-size 128 --batch-size 4 --steps 250 --lr 2e-3 --eval-every 50 --ckpt-every 50 \
	  --d-model 128 --n-layers 4 --n-heads 4 --n-kv-heads 2 --d-ff 384
	@echo "run directory: runs/demo (metrics.jsonl, loss.png, checkpoints/)"

# Throughput of every mode on the demo configuration, far-token loss on the synthetic task.
train-compare: $(STAMP)
	$(BIN)/python -m experiments.train_compare
	$(BIN)/python -m seco_lab.report training

# Does the bias matter?  Every scheme trained against SeCO (resumable; see reports/training_study.md).
train-study: $(STAMP)
	$(BIN)/python -m experiments.train_study --jobs $(JOBS)
	$(BIN)/python -m seco_lab.train_study.report

train-study-quick: $(STAMP)
	$(BIN)/python -m experiments.train_study --quick --jobs $(JOBS)
	$(BIN)/python -m seco_lab.train_study.report --results runs/training_study_quick \
	  --out runs/training_study_quick/report.md

# Time and memory of every method as sequences grow; report from the stored CSV.
bench: $(STAMP)
	$(BIN)/python -m experiments.bench
	$(BIN)/python -m seco_lab.report bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
