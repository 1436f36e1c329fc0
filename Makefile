# The two commands the README opens with:
#   make serve   create .venv, install Roundhouse, fetch the default model, serve it on 127.0.0.1:8080
#   make test    create .venv, install Roundhouse with its test tools, fetch fixtures, lint, run the tests
#                (as root on Debian it also installs the chromium package for the browser tests)
# Installs are stamped, so a second run installs and fetches nothing.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check
# torch first, pinned: our machines hold this CPU build on local disk; an
# unpinned torch would pull a multi-GB CUDA build. Override for GPU hosts.
TORCH ?= torch==2.13.0
# On a GPU box (nvidia-smi on PATH) the runtime install adds CuPy, which
# compiles our CUDA kernels; CPU machines install exactly what they did.
CUDA_EXTRA ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda13,)
EXTRAS := $(if $(CUDA_EXTRA),[$(CUDA_EXTRA)],)
ARGS ?=
# The slowest tests in every run's log: the suite must stay under 15 minutes.
PYTEST_ARGS ?= --durations=25
comma := ,

.PHONY: serve test install install-test fixtures lint browser

serve: $(VENV)/.runtime
	$(BIN)/roundhouse serve $(ARGS)

test: $(VENV)/.test fixtures lint browser
	$(BIN)/python -m pytest $(PYTEST_ARGS)

install: $(VENV)/.runtime

install-test: $(VENV)/.test

fixtures: $(VENV)/.test
	$(BIN)/python -m tests.support.fixtures

lint: $(VENV)/.test
	$(BIN)/ruff check .

# Debian's chromium for the browser tests (Playwright drives it; it never
# downloads a browser). The stamp is left only once chromium is there, so a
# machine that cannot install it is told so on every run.
browser: $(VENV)/.browser

$(VENV)/.browser: tests/support/install_browser.sh | $(BIN)/python
	sh tests/support/install_browser.sh
	@if command -v chromium >/dev/null 2>&1; then touch $@; fi

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(PIP) install --quiet "$(TORCH)"
	$(PIP) install --quiet -e ".$(EXTRAS)"
	touch $@

$(VENV)/.test: $(VENV)/.runtime pyproject.toml
	$(PIP) install --quiet -e ".[test$(if $(CUDA_EXTRA),$(comma)$(CUDA_EXTRA),)]"
	touch $@
