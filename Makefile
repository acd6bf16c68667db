# make run : set up .venv and run the main job on its embedded default
# make test: set up .venv and run the whole test suite
VENV ?= .venv
PYTHON := $(VENV)/bin/python
EXTRAS ?= test,bench

.PHONY: run test bench clean

$(VENV)/.installed: pyproject.toml tools/setup-venv.sh
	bash tools/setup-venv.sh $(VENV) $(EXTRAS)
	touch $@

run: $(VENV)/.installed
	$(PYTHON) -m kvstage replay

test: $(VENV)/.installed
	$(PYTHON) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info
