# Two commands set everything up on a fresh Debian/Ubuntu machine:
#   make demo   installs what is missing, then trains a small model with OffloadedAdamW
#   make test   installs what is missing, then runs the whole suite (ruff, the layer contract and mypy included)
PYTHON ?= python3
SCRATCH ?= $(shell $(PYTHON) -c 'import tempfile; print(tempfile.gettempdir())')/nvme-offload-demo
STAMP := build/.installed

.PHONY: install demo test lint bench clean

# Reinstall when the native sources, the build script or the metadata change.
$(STAMP): scripts/install-deps.sh pyproject.toml setup.py offload/_build.py offload/_version.py native/offload_engine.c native/offload_engine.h native/offload_kernels.c native/offload_kernels.h
	PYTHON=$(PYTHON) bash scripts/install-deps.sh
	@mkdir -p build && touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PYTHON) -m offload.tools.demo --path $(SCRATCH)

lint: $(STAMP)
	$(PYTHON) -m ruff check .
	$(PYTHON) -c 'import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))'
	$(PYTHON) -m mypy

# The suite in TEST_WORKERS processes (pytest-xdist), each test file whole in one of them (its module fixtures
# run once); TEST_WORKERS=0 runs it in this process. The lint checks are tests of it (tests/test_lint.py), run
# beside the others rather than before them.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PYTHON) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

bench: $(STAMP)
	$(PYTHON) -m offload.tools io --size 1GiB --fio

clean:
	rm -rf build dist *.egg-info offload/_engine.c offload/_kernels.c offload/*.so offload/*.o .pytest_cache .ruff_cache .mypy_cache
