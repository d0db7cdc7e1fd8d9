# Entry points: `make demo` trains the MNIST demo, `make test` runs the test suite. Both first run
# `setup`, which makes sure a Vulkan adapter exists (lavapipe on machines without a GPU) and
# installs meganeura in editable mode with its test and plot extras.

PYTHON ?= python3
RUFF ?= $(PYTHON) -m ruff
# Wheels dropped in .whl/ (e.g. a local torch CPU wheel) are offered to pip.
PIP_FLAGS ?= $(if $(wildcard .whl/*.whl),--find-links .whl)
LINT_PATHS = meganeura tests scripts

.PHONY: setup demo test lint format

setup:
	PYTHON=$(PYTHON) bash scripts/setup_vulkan.sh
	PIP_ROOT_USER_ACTION=ignore $(PYTHON) -m pip install -q --disable-pip-version-check \
		$(PIP_FLAGS) -e '.[test,plot]'

demo: setup
	$(PYTHON) -m meganeura train mnist

test: setup
	$(PYTHON) -m pytest -q tests

lint:
	$(RUFF) check $(LINT_PATHS)
	$(RUFF) format --check $(LINT_PATHS)

format:
	$(RUFF) format $(LINT_PATHS)
	$(RUFF) check --fix $(LINT_PATHS)
