# Two entry points on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet
TORCH_VERSION ?= 2.13.0

.PHONY: run test bench clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	# torch first and pinned: a bare `torch` requirement would pull the CUDA build.
	$(PIP) torch==$(TORCH_VERSION)
	touch $@

$(VENV)/.run-deps: $(VENV)/.created pyproject.toml
	$(PIP) -e '.[torch,mlx]'
	touch $@

$(VENV)/.test-deps: $(VENV)/.run-deps
	$(PIP) -e '.[torch,mlx,test]'
	touch $@

run: $(VENV)/.run-deps
	$(VENV)/bin/exo-like --model demo $(ARGS)

test: $(VENV)/.test-deps
	$(PY) -m pytest -q -rs $(PYTEST_ARGS)

bench: $(VENV)/.test-deps
	$(PY) bench/bench_torch_vs_hf.py

clean:
	rm -rf $(VENV)
