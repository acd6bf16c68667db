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

# Tests run in a network namespace with loopback only (tools/in-netns.sh): the servers they
# start (mooncake_master binds a port on every interface) are reachable from this machine alone.
IN_NETNS := bash tools/in-netns.sh

test: $(VENV)/.installed $(VENV)/.mooncake
	$(IN_NETNS) $(PYTHON) -m pytest

bench: $(VENV)/.installed
	$(PYTHON) -m bench

clean:
	rm -rf $(VENV) build *.egg-info hashing/_*_chain*.so
