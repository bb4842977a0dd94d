# Two commands on a fresh machine: `make run` (the main job) and `make test` (the whole suite).
# Both create .venv when it is missing. torch is pinned to the CPU wheel that lies on this machine's
# disk when no torch is importable: an unpinned torch would pull a CUDA build of several GB.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.moeflow-installed
DOCS_STAMP := $(VENV)/.moeflow-docs-installed

.PHONY: setup run test test-fast lint docs bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[dev,hf,tensorboard]"
# Headless Chromium, for the report's screenshot test (tests/test_report_html.py skips without it):
# best effort, only where apt-get exists and we are root, quietly; setup never fails for it.
	-@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
		&& { apt-get install -y -qq chromium || { apt-get update -qq && apt-get install -y -qq chromium; }; } \
		>/dev/null 2>&1; } || true
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/moeflow train

test: $(STAMP)
	$(PY) -m pytest -q

# The edit-test loop: the single-process tests under two seconds and one distributed case per family
# (about a minute on 2 cores); CI runs the whole suite.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "(not distributed and not slow) or smoke"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples docs/conf.py

# The documentation site, into docs/_build/html; any warning fails the build. The docs extra
# (sphinx, myst-parser) is installed on first use, not by setup.
docs: $(DOCS_STAMP)
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[docs]"
	@touch $(DOCS_STAMP)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache docs/_build
