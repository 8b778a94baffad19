# Two commands do all set-up: `make smoke` runs the main job, `make test` the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

export DO_NOT_TRACK := 1
export KEDRO_DISABLE_TELEMETRY := true

.PHONY: smoke test test-quick viz clean bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	touch $@

# the test extra adds pytest and torch (the reference for logits parity)
$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

smoke: $(VENV)/.installed
	$(BIN)/kedro run --pipelines=smoke

# two workers, a test file each at a time (its module fixtures built once): most of a test is one core's work
# (XLA compiling, Python), and CI has two cores and 24 GiB; the longest files first (tests/conftest.py). The
# slowest 25 tests are listed on every run.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25
test: $(VENV)/.installed-test
	$(PYTEST)

# the edit-test loop: every test not marked slow (whole pipeline runs, processes of their own, real models, XLA:TPU
# compiles, the tiny model's training and generation loops: anything past ~5 s with both workers busy)
test-quick: $(VENV)/.installed-test
	$(PYTEST) -m "not slow"

# throughput benchmarks (torch from the test extra is the PyTorch baseline); writes benchmarks/results/latest.json
bench: $(VENV)/.installed-test
	$(BIN)/python benchmarks/run_all.py

viz: $(VENV)/.installed
	$(BIN)/kedro viz build

clean:
	rm -rf build mlflow.db mlruns data/mlflow.db data/mlruns data/mlflow_run.json data/0[2-8]_*/[!.]*
