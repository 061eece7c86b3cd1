# Two entry points (README): `make bench` runs the main job, `make test` runs the tests.
# Both install what they need first: `make bench` the package with its `bench` extra (the CLI and benchmark stack),
# `make test` with its `test` extra (bench + pytest, hypothesis, NVRTC). On a machine without torch, the CPU build
# torch==2.13.0 is installed; a machine with torch (a GPU box) keeps its own.
PYTHON ?= python3
PYTEST_ARGS ?= -q

# The Gluon kernels are written against this Triton (SUPPORTED_TRITON in sparse_mla/mqa/gluon_sm90/__init__.py);
# `make test` installs it beside the environment's own, so tests/mqa/test_gluon_compile.py compiles every variant
# for sm_90.
GLUON_TRITON ?= 3.6.0
GLUON_TRITON_DIR ?= .cache/triton-gluon

.PHONY: install install-bench install-torch test bench lint gluon-triton

install-torch:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0

# An offline machine that already has the dependencies (the H200 image) gets the package alone.
install: install-torch
	@$(PYTHON) -m pip install -q -e '.[test]' || $(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .

install-bench: install-torch
	@$(PYTHON) -m pip install -q -e '.[bench]'

# A machine whose own Triton is that version (the H200 image) compiles with it: GLUON_TRITON_DIR points there.
gluon-triton:
	@test -f $(GLUON_TRITON_DIR)/triton/__init__.py || $(PYTHON) -c "import sys, triton; sys.exit(triton.__version__ != '$(GLUON_TRITON)')" 2>/dev/null || $(PYTHON) -m pip install -q --no-deps --target $(GLUON_TRITON_DIR) triton==$(GLUON_TRITON)

test: install gluon-triton
	GLUON_TRITON_DIR=$(abspath $(GLUON_TRITON_DIR)) $(PYTHON) -m pytest $(PYTEST_ARGS)

bench: install-bench
	$(PYTHON) -m sparse_mla bench

lint:
	ruff check .
