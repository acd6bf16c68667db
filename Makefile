# make run : set up .venv and run the main job on its embedded default
# make test: set up .venv and run the whole test suite
VENV ?= .venv
PYTHON := $(VENV)/bin/python
EXTRAS ?= test,bench

.PHONY: run test bench clean

# hashing/_page_chain.c: `pip install -e` compiles it in place, so an edit needs a reinstall.
$(VENV)/.installed: pyproject.toml tools/setup-venv.sh tools/apt-install.sh hashing/_page_chain.c
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

# sglang 0.5.23 for CPU (optional extra), so tests/integrations/sglang run sglang's own code;
# where it cannot be installed its tests skip with the reason, except under CI.
$(VENV)/.sglang: $(VENV)/.installed tools/install-sglang.sh tools/apt-install.sh
	bash tools/install-sglang.sh $(VENV) || { [ -z "$$CI" ] || exit 1; echo "make: sglang not installed; its tests will skip"; }
	touch $@

# The sglang tests run in a pytest process of their own: sglang's import on CPU patches
# process-wide state (see tests/integrations/sglang/conftest.py).
SGLANG_TESTS := tests/integrations/sglang

test: $(VENV)/.installed $(VENV)/.mooncake $(VENV)/.sglang
	$(PYTHON) -m pytest --ignore=$(SGLANG_TESTS)
	$(PYTHON) -m pytest $(SGLANG_TESTS)

bench: $(VENV)/.installed
	$(PYTHON) -m bench

clean:
	rm -rf $(VENV) build *.egg-info hashing/_*_chain*.so
