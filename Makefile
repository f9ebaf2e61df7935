# Every target that needs Python uses the project's own virtualenv (.venv), created on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DEMO    := demo-models
SYSPKGS := umockdev gir1.2-umockdev-1.0 python3-gi systemd stress-ng chromium

.PHONY: setup system-deps run test lint pytest bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# llama-cpp-python compiles llama.cpp from source here the first time (8-14 min on 2 cores).
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# Debian packages the tests use for real: umockdev (udev uevents), systemd-analyze (unit verification), stress-ng,
# chromium (the dashboard's page, driven by Playwright; Playwright's own browser download is never used).
# Installed only when missing and only where we are root with apt-get; otherwise those tests say why they skip.
system-deps:
	@if ! command -v umockdev-run >/dev/null || ! command -v systemd-analyze >/dev/null || ! /usr/bin/python3 -c "import gi" 2>/dev/null \
	  || ! command -v chromium >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SYSPKGS) >/dev/null; \
	  else echo "system-deps: not root or no apt-get; udev, systemd-analyze and browser tests will skip"; fi; \
	fi

# Sets everything up, writes the demo model ladder and runs the daemon in the foreground (Ctrl-C stops it).
run: setup
	$(BIN)/governor demo-models --dir $(DEMO) && $(BIN)/governor run --models $(DEMO)/ladder.toml

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

pytest: setup system-deps
	$(BIN)/python -m pytest

test: lint pytest

bench: setup
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache $(DEMO)
