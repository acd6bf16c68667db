# make run : set up .venv and run the main job on its embedded default
# make test: set up .venv and run the whole test suite
VENV ?= .venv
PYTHON := $(VENV)/bin/python
EXTRAS ?= test,bench

.PHONY: run test lint format bench clean

# hashing/_page_chain.c, kernels/_host_copy.c: `pip install -e` compiles them in place, so an edit needs a reinstall.
$(VENV)/.installed: pyproject.toml tools/setup-venv.sh tools/apt-install.sh hashing/_page_chain.c kernels/_host_copy.c
	bash tools/setup-venv.sh $(VENV) $(EXTRAS)
	touch $@

run: $(VENV)/.installed
	$(PYTHON) -m kvstage replay

# The Mooncake store (optional extra) so its tests run against a real master; where it cannot
# be installed (no root for apt, no wheel for this platform) its tests skip with the reason,
# except under CI, where they must run.
$(VENV)/.mooncake: $(VENV)/.installed tools/install-mooncake.sh tools/apt-install.sh
	bash tools/install-mooncake.sh $(VENV) || { [ -z "$$CI" ] || exit 1; echo "make: Mooncake not installed; its tests will skip"; }
	touch $@

# Dynamo's standalone KV indexer (ai-dynamo-runtime, Linux x86_64) in DYNAMO_VENV, a venv of its
# own (its pydantic pin is older than the engines'), so tests/events/test_dynamo.py feeds a real
# router's index, started as its own process; where it cannot be installed that test skips with
# the reason, except under CI, where it must run.
DYNAMO_VENV ?= .venv-dynamo
$(DYNAMO_VENV)/.installed: tools/install-dynamo.sh
	bash tools/install-dynamo.sh $(DYNAMO_VENV) || { [ -z "$$CI" ] || exit 1; echo "make: ai-dynamo-runtime not installed; its test will skip"; }
	touch $@

# vLLM 0.33.0's KV offloading code on CPU (tools/install-vllm.sh, pins from ../shared/reference)
# for the vLLM adapter's tests, in VLLM_VENV: an overlay of VENV (its own packages first, then
# VENV's), since vLLM's pins and sglang's disagree (openai). Where vLLM cannot be installed its
# tests skip with the reason, except under CI, where they must run.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed: $(VENV)/.installed tools/install-vllm.sh tools/overlay-scripts.sh
	bash tools/install-vllm.sh $(VLLM_VENV) $(VENV) || { [ -z "$$CI" ] || exit 1; echo "make: vLLM not installed; its tests will skip"; }
	touch $@

# sglang 0.5.23 for CPU (optional extra) in a virtual environment of its own, so
# tests/integrations/sglang run sglang's own code: its pinned packages include the CUDA build of
# torchvision, which breaks transformers' model imports in $(VENV), and sglang's CPU import
# patches process-wide state. Where it cannot be installed its tests skip with the reason,
# except under CI.
SGLANG_VENV ?= .venv-sglang
SGLANG_TESTS := tests/integrations/sglang
$(SGLANG_VENV)/.sglang: pyproject.toml tools/setup-venv.sh tools/install-sglang.sh tools/install-mooncake.sh tools/apt-install.sh hashing/_page_chain.c kernels/_host_copy.c
	{ bash tools/setup-venv.sh $(SGLANG_VENV) test && bash tools/install-sglang.sh $(SGLANG_VENV); } \
		|| { [ -z "$$CI" ] || exit 1; echo "make: sglang not installed; its tests will skip"; }
	[ ! -x $(SGLANG_VENV)/bin/python ] || bash tools/install-mooncake.sh $(SGLANG_VENV) \
		|| { [ -z "$$CI" ] || exit 1; echo "make: Mooncake not installed in $(SGLANG_VENV); its sglang test will skip"; }
	touch $@

# Tests run in a network namespace of their own (tools/in-netns.sh): the servers they start
# (mooncake_master binds a port on every interface) are reachable from this machine alone.
# Each engine's tests run in their own pytest process, in the venv holding its pinned packages.
IN_NETNS := bash tools/in-netns.sh
# pytest-xdist workers per pytest process: 2 halves the suite's wall time on a 2-core machine
# (most tests wait on threads, subprocesses or the interpreter's one core); each worker imports
# torch, so a large machine still runs 2 unless told (`make test PYTEST_WORKERS=8`; 0: no workers).
PYTEST_WORKERS ?= 2
PYTEST := -m pytest -n $(PYTEST_WORKERS)
# vLLM's suite runs without workers: its TP=2 tests start two rank processes each, and beside a
# second worker on 2 cores one of them missed its hit once (test_hybrid_tp.py, a fresh-clone CI).
PYTEST_VLLM := -m pytest

test: $(VENV)/.installed $(VENV)/.mooncake $(DYNAMO_VENV)/.installed $(VLLM_VENV)/.installed $(SGLANG_VENV)/.sglang
	$(IN_NETNS) $(PYTHON) $(PYTEST)
	if [ -x $(VLLM_VENV)/bin/python ]; then $(IN_NETNS) $(VLLM_VENV)/bin/python $(PYTEST_VLLM) tests/integrations/vllm; else $(IN_NETNS) $(PYTHON) $(PYTEST_VLLM) tests/integrations/vllm; fi
	if [ -x $(SGLANG_VENV)/bin/python ]; then $(IN_NETNS) $(SGLANG_VENV)/bin/python $(PYTEST) $(SGLANG_TESTS); else $(IN_NETNS) $(PYTHON) $(PYTEST) $(SGLANG_TESTS); fi

# ruff's linter and formatter, as configured in pyproject.toml (the version pinned in the test
# extra); `.ci/run` runs it before the tests. `make format` rewrites files to pass it.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(VENV)/.installed
	$(PYTHON) -m bench

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(DYNAMO_VENV) build *.egg-info hashing/_*_chain*.so kernels/_host_copy*.so
