# The two commands a newcomer needs: `make demo` and `make test`.
# Each creates .venv and installs spikehound (one top-level package, `spikehound`) into it.

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

# Parallel on pytest-xdist workers; TEST_WORKERS=0 runs serially (docs/development.md).
TEST_WORKERS ?= 5

test: $(STAMP)
	sh tests/apt-install.sh prometheus "the Prometheus tests" prometheus promtool
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

bench: $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,bench]'
	$(BIN)/python -m benchmarks.ingest
	$(BIN)/python -m benchmarks.ingest --compare hop-streams --pairs 3
	$(BIN)/python -m benchmarks.scale_out
	$(BIN)/python -m benchmarks.detection
	$(BIN)/python -m benchmarks.agent_overhead
	$(BIN)/python -m benchmarks.profiling_overhead
	$(BIN)/python -m benchmarks.retention
	$(BIN)/python -m benchmarks.compare
	$(BIN)/python -m benchmarks.alert_latency
	$(BIN)/python -m benchmarks.memory_abuse
	$(BIN)/python -m benchmarks.resume_memory
	$(BIN)/python -m benchmarks.arena_bursts
	$(BIN)/python -m benchmarks.profile_diff
	$(BIN)/python -m benchmarks.fuzz
	$(BIN)/python -m benchmarks.api_fuzz
	$(BIN)/python -m benchmarks.spike_list
	$(BIN)/python -m benchmarks.soak

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info

# The browser tests of the web pages (tests/test_web_browser.py) and their benchmark drive Debian's chromium:
# installed here when missing (as root, as CI runs); without it they skip and say why.
.PHONY: chromium bench-web-page
test: chromium
chromium:
	sh tests/apt-install.sh chromium "the browser tests" /usr/bin/chromium

bench: bench-web-page
bench-web-page: $(STAMP) chromium
	$(BIN)/python -m benchmarks.web_page

# On a GPU host: the real-NVML test (skipped elsewhere), then this host's GPUs recorded in the format of
# tests/fixtures/nvml/ (idle as they are now; run it again under load for a busy recording).
.PHONY: gpu-check
gpu-check: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider -m gpu -rs tests/test_nvml_sampler.py
	mkdir -p nvml-recordings
	$(BIN)/python -m spikehound.agent.samplers.nvml --record nvml-recordings/$$(hostname)-$$(date +%s).json --samples 5

# The OCI image for both daemons (deploy/container/, docs/kubernetes.md): built from Debian packages with
# buildah and debootstrap, no registry needed; skipped when an image of the same inputs exists. The image tests
# (tests/test_image.py) run it with podman, and the manifest tests (tests/test_kubernetes.py) render with kubectl:
# their tools are installed here when missing (as root, as CI runs); without them those tests skip and say why.
.PHONY: image image-tools
image: $(STAMP)
	$(BIN)/python deploy/container/build_image.py
test: image-tools
image-tools:
	sh tests/apt-install.sh buildah "the image tests" buildah
	sh tests/apt-install.sh debootstrap "the image tests" debootstrap
	sh tests/apt-install.sh podman "the image tests" podman
	sh tests/apt-install.sh runc "the image tests (podman's crun refuses hosts with hybrid cgroups)" runc
	sh tests/apt-install.sh kubernetes-client "the manifest tests" kubectl
