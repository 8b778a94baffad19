# Two commands do all set-up: `make smoke` runs the main job, `make test` the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

export DO_NOT_TRACK := 1
export KEDRO_DISABLE_TELEMETRY := true

.PHONY: smoke test viz install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

smoke: $(STAMP)
	$(BIN)/kedro run --pipelines=smoke

test: $(STAMP)
	$(BIN)/python -m pytest

viz: $(STAMP)
	$(BIN)/kedro viz build

clean:
	rm -rf build mlflow.db data/0[2-8]_*/[!.]*
