# Two commands for a new machine: `make demo` and `make test`. Both create .venv on first use.
# torch is installed first, pinned to the CPU build that lies on this machine's disk
# (`pip install torch==2.13.0`), so that nothing resolves a multi-GB CUDA build.

VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: setup demo test quick lint types unit docs bench bench-suite clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[torch,dev,docs]"
	@$(PY) -c "import torch; print('torch', torch.__version__, 'cuda' if torch.version.cuda else 'cpu build')"
	touch $@

demo: setup
	$(PY) examples/quickstart.py

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The overloads check runs with other options than the package's (--warn-unreachable), so it keeps
# its own cache: sharing one, each run would throw away the other's and check everything again.
types: setup
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --strict --warn-unreachable --cache-dir .mypy_cache/overloads tests/typing/check_overloads.py

# The suite runs on one pytest-xdist worker per core and one more (PYTEST_WORKERS=N sets it; 0 runs
# it in this process). Each worker starts with its share of the long tests, dealt out evenly from
# the last run's durations (tests/support/schedule.py), and takes from the others' queues once its
# own is empty (worksteal). On an idle 2-core machine the suite also waits (servers, ranks,
# grace periods), and a third worker fills those waits: the suite 358 -> 301 s, make quick's
# tests 82 -> 65 s. On a loaded machine it is bound by its CPU-seconds and more workers do not help.
PYTEST_WORKERS ?= $(shell python3 -c 'import os; print((os.cpu_count() or 1) + 1)')
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist worksteal

unit: setup
	$(VENV)/bin/pytest $(PYTEST_PARALLEL)

# lint and types run beside the suite (their output is shown once it ends); make test fails if
# any of the three does.
test: setup
	@log=$$(mktemp); { $(MAKE) --no-print-directory lint types >$$log 2>&1; echo $$? >>$$log.rc; } & \
	$(MAKE) --no-print-directory unit; unit=$$?; wait; \
	echo "--- lint and types:"; cat $$log; checks=$$(cat $$log.rc); rm -f $$log $$log.rc; \
	test $$unit = 0 && test $$checks = 0

# The inner loop: every test but those marked slow (more than a second or two each: processes,
# ranks, servers under faults, the docs pages run as scripts), distributed or ray (a Ray cluster).
quick: setup
	$(VENV)/bin/pytest $(PYTEST_PARALLEL) -q -m "not slow and not distributed and not ray"

# The documentation site, into site/ (mkdocs.yml). --strict: a warning (a broken link, a page
# missing from the nav, a docstring that does not render) fails the build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

bench: setup
	$(PY) -m benchmarks local

# guideloom against torch, torchdata, Streaming, LitData and Grain (installs them in its own venv)
bench-suite: setup
	$(PY) -m benchmarks suite

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache site
