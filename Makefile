# make test: the whole suite against real servers; make demo: the example, no server needed;
# make bench: benchmarks/ into benchmarks/results/; make docs: the Sphinx site into docs/_build/html;
# make chaos: the nemesis soak (chaos/), CHAOS_SECONDS long (300 by default), on private servers
# it starts and stops itself; make compat: the worker tests on every Celery minor we claim;
# make typecheck: mypy --strict over the package (pyproject.toml's [tool.mypy]; in make test).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test compat compat-ci chaos-ci demo bench chaos lint typecheck servers clean docs

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[all,test,bench,docs,compat]'
	touch $(STAMP)

servers:
	bash scripts/ensure-servers.sh

# Most tests wait on servers and worker processes, not on the CPU: they run in PYTEST_JOBS
# processes; the few that stop or disconnect the shared broker (marked serial) run after them.
PYTEST_JOBS ?= 4

test: $(STAMP) servers docs
	$(BIN)/ruff check celery_semaphore tests benchmarks chaos example_project scripts
	$(BIN)/python scripts/check-negative-waits.py tests
	$(BIN)/python -m mypy --config-file pyproject.toml
	$(BIN)/python -m pytest -n $(PYTEST_JOBS) -m "not serial and not apart and not soak" --durations=25
	$(BIN)/python -m pytest -m "(serial or apart) and not soak" --durations=10

# make chaos-ci: a minute of the nemesis soak, every kind of fault once, as a test
# (tests/test_chaos.py, marked soak; .ci/run, after make test, which it would take past 10 min)
chaos-ci: $(STAMP)
	$(BIN)/python -m pytest -m soak --durations=5

# make compat: the worker tests that touch Celery's internals, against every Celery minor that
# setup.cfg claims (tox.ini: envs celery53 ... celery57, installed from PyPI), and on the oldest
# and the newest Python it claims (py310-celery53, py313-celery57), COMPAT_JOBS envs at a time;
# make compat-ci: the oldest and the newest Celery, and both Pythons (.ci/run). The Pythons'
# interpreters come from scripts/find-pythons.py ($CS_PYTHON_310, PATH, pyenv), which stops
# the run when one is missing. Arguments for pytest: make compat COMPAT_ARGS="-x".
COMPAT_PYTHON_ENVS ?= py310-celery53,py313-celery57
COMPAT_ENVS ?= celery53,celery54,celery55,celery56,celery57,$(COMPAT_PYTHON_ENVS)
COMPAT_CI_ENVS ?= celery53,celery57,$(COMPAT_PYTHON_ENVS)
COMPAT_JOBS ?= 2
COMPAT_ARGS ?=
TOX_PARALLEL = $(BIN)/tox run-parallel --parallel-live -p $(COMPAT_JOBS)
WITH_PYTHONS = pythons="$$($(BIN)/python scripts/find-pythons.py $(1))" && eval "$$pythons" &&

compat: $(STAMP) servers
	$(call WITH_PYTHONS,$(COMPAT_ENVS)) $(TOX_PARALLEL) -e $(COMPAT_ENVS) -- $(COMPAT_ARGS)

compat-ci: $(STAMP) servers
	$(call WITH_PYTHONS,$(COMPAT_CI_ENVS)) $(TOX_PARALLEL) -e $(COMPAT_CI_ENVS) -- $(COMPAT_ARGS)

demo: $(STAMP)
	$(BIN)/python -m example_project.demo

bench: $(STAMP) servers
	$(BIN)/python -m benchmarks

# The documentation site (docs/): warnings are errors. Its code examples live in docs/examples/
# and run in the test suite (tests/test_docs.py).
docs: $(STAMP)
	$(BIN)/sphinx-build -q -W --keep-going -b html docs docs/_build/html

# CHAOS_SEED (printed at the start) replays a run's faults; CHAOS_FAULTS picks among them.
CHAOS_SECONDS ?= 300
chaos: $(STAMP)
	CHAOS_SECONDS=$(CHAOS_SECONDS) $(BIN)/python -m chaos

lint: $(STAMP)
	$(BIN)/ruff check celery_semaphore tests benchmarks chaos example_project scripts
	$(BIN)/python scripts/check-negative-waits.py tests

typecheck: $(STAMP)
	$(BIN)/python -m mypy --config-file pyproject.toml

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .mypy_cache docs/_build .tox
