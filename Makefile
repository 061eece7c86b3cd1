# Two entry points (README): `make bench` runs the main job, `make test` runs the tests.
# Both install what they need first. On a machine without torch, the CPU build torch==2.13.0 is
# installed; a machine with torch (a GPU box) keeps its own.
PYTHON ?= python3
PYTEST_ARGS ?= -q

.PHONY: install test bench lint

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	@$(PYTHON) -m pip install -q -e '.[test]'

test: install
	$(PYTHON) -m pytest $(PYTEST_ARGS)

bench: install
	sparse-mla bench

lint:
	ruff check .
