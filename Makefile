# Every target that needs Python uses the project's own virtualenv (.venv), created on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DEMO    := demo-models
SYSPKGS := umockdev gir1.2-umockdev-1.0 python3-gi systemd stress-ng chromium

.PHONY: setup system-deps run test lint pytest bench clean llama-cflags

# llama-cpp-python: PyPI ships only its source, so llama.cpp is compiled here (8-14 min on 2 cores), once per version,
# build flags, Python and machine, into a wheel cache of ours; pip's own cache is keyed by the sdist alone and would
# hand back a wheel built with other flags. On x86 the compiler may not target AMX: llama.cpp then has no AMX kernels
# (its AMX weight buffer crashes on Sapphire Rapids and later, llama.cpp #20824) and keeps the x86 weight repack, so
# extra_buffers = "auto" stays on there (docs/engine.md#amx-cpus-and-extra_buffers). Must match pyproject.toml's pin.
LLAMA        := llama-cpp-python==0.3.36
NO_AMX       := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
# (a compiler too old to know these flags cannot build AMX kernels either)
LLAMA_CFLAGS := $(if $(filter x86_64,$(shell uname -m)),$(shell cc $(NO_AMX) -E -x c /dev/null >/dev/null 2>&1 && echo '$(NO_AMX)'))
CACHE        := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/governor
WHEELS       := $(CACHE)/wheels

$(STAMP): pyproject.toml native/build-llama-server.sh native/llama-server/CMakeLists.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	key=$$(printf '%s|%s|%s|%s' '$(LLAMA)' '$(LLAMA_CFLAGS)' "$$CMAKE_ARGS" \
	      "$$($(BIN)/python -c 'import platform, sys; print(sys.implementation.cache_tag, platform.machine())')" \
	      | sha256sum | cut -c1-16) && dir=$(WHEELS)/$$key && \
	if ! ls $$dir/*.whl >/dev/null 2>&1; then \
	  rm -rf $$dir.part && \
	  CFLAGS='$(LLAMA_CFLAGS)' CXXFLAGS='$(LLAMA_CFLAGS)' CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	    $(BIN)/python -m pip wheel --quiet --no-deps --no-cache-dir -w $$dir.part '$(LLAMA)' && \
	  rm -rf $$dir && mv $$dir.part $$dir; \
	fi && \
	$(BIN)/python -m pip install --quiet --no-deps --force-reinstall $$dir/*.whl
	$(BIN)/python -m pip install --quiet -e '.[engine,dev]'
	# llama.cpp's own llama-server against that wheel's libraries, once per llama.cpp build (cached in $(CACHE)).
	native/build-llama-server.sh $(VENV) $(CACHE)
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

# The flags llama.cpp is compiled with (tests/test_build.py checks that they keep AMX out).
llama-cflags:
	@echo '$(LLAMA_CFLAGS)'

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache $(DEMO)
