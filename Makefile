# The two commands a newcomer needs: `make demo` and `make test`.
# Each creates .venv (spikehound's own environment: its top-level packages
# agent/collector/detectors/storage must never mix with PyPI's namesakes).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/spikehound demo

test: $(STAMP)
	sh tests/install-prometheus.sh
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m benchmarks.ingest
	$(BIN)/python -m benchmarks.detection
	$(BIN)/python -m benchmarks.agent_overhead
	$(BIN)/python -m benchmarks.retention
	$(BIN)/python -m benchmarks.compare
	$(BIN)/python -m benchmarks.alert_latency

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info

# The browser tests of the web pages (tests/test_web_browser.py) and their benchmark drive Debian's chromium:
# installed here when missing (as root, as CI runs); without it they skip and say why.
.PHONY: chromium bench-web-page
test: chromium
chromium:
	sh tests/install-chromium.sh

bench: bench-web-page
bench-web-page: $(STAMP) chromium
	$(BIN)/python -m benchmarks.web_page
