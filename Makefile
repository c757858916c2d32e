# The two set-up commands: `make demo` and `make test`. Both create .venv when missing and
# reinstall only when the dependency declarations (setup.py, pyproject.toml) change. `make demo`
# installs what serving needs (`pip install -e .`); `make test` adds the development tools
# (setup.py's [dev] extra: pytest, mypy, ruff, the clients and stubs the tests use).
# VENV=/some/where puts the venv elsewhere (a fresh one to try a clean install in, say).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The development install (`make test`, `make lint`).
STAMP := $(VENV)/.install-stamp
# The serving install (`make demo`). A development install holds it too and stamps it as
# well: `make demo` after `make test` installs nothing; `make test` after `make demo` adds the
# development tools.
SERVE_STAMP := $(VENV)/.install-stamp-serve
TS_VENV := .venv-torchserve-archiver
# Named after what it holds, so a venv made before torchserve (then torch-workflow-archiver)
# joined it is brought up to date.
TS_STAMP := $(TS_VENV)/.install-stamp-torchserve-0.12.0-wfa
DEMO_MODEL := model_store/resnet-152-batch_v2.mar
EXAMPLE := examples/image_classifier/resnet_152_batch

.PHONY: demo test lint install clean image browser promtool wrk

install: $(STAMP)

$(STAMP): setup.py pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	@touch $(STAMP) $(SERVE_STAMP)

$(SERVE_STAMP): setup.py pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e .
	@touch $(SERVE_STAMP)

# TorchServe's own torch-model-archiver (its package is also named model_archiver, so it
# lives in a venv of its own); the compatibility tests build archives with it. TorchServe's
# wheel joins it (its `ts` package, which needs no torch to install): the `ts` coverage test
# reads its sources to compare with batchserve's `ts` (tests/unit/test_ts_coverage.py). And
# TorchServe's torch-workflow-archiver (0.2.15, the one TorchServe 0.12 ships with; its package
# is named workflow_archiver, as ours is): tests/unit/test_workflow_archiver.py compares .war
# files and the workflow tests serve archives it made.
$(TS_STAMP):
	@test -x $(TS_VENV)/bin/python || $(PYTHON) -m venv $(TS_VENV)
	$(TS_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
		torch-model-archiver==0.12.0 torchserve==0.12.0 torch-workflow-archiver==0.2.15
	@touch $(TS_STAMP)

# The SageMaker inference toolkit (sagemaker-pytorch-inference, which carries
# sagemaker_inference) in a venv of its own, as SageMaker's containers run it: the SageMaker
# tests (tests/integration/test_sagemaker.py) start its `serve` against batchserve. Its
# pkg_resources needs a setuptools that still ships it. When it cannot be installed (no index)
# those tests skip, saying why.
SM_VENV := .venv-sagemaker
SM_STAMP := $(SM_VENV)/.install-stamp-sagemaker-pytorch-inference-2.0.25
$(SM_STAMP):
	@test -x $(SM_VENV)/bin/python || $(PYTHON) -m venv $(SM_VENV)
	$(SM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
		sagemaker-pytorch-inference==2.0.25 "setuptools<81" && touch $(SM_STAMP) || \
		echo "the SageMaker toolkit could not be installed: its tests will skip"

# A real browser for the CORS and live-page tests (tests/integration/test_cors_and_legacy.py,
# test_dashboard.py): Debian's chromium, installed with apt-get when missing and this runs as
# root; otherwise those tests skip, saying why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			--no-install-recommends chromium) || \
		echo "chromium could not be installed: the browser CORS and dashboard tests will skip"; \
	else echo "no chromium (not root, or no apt-get): the browser CORS and dashboard tests will skip"; fi

# wrk, the C HTTP load generator the benchmarks drive, for the frontend-processes benchmark's
# smoke run (tests/integration/test_bench_fronts.py): Debian's package, installed with apt-get
# when missing and this runs as root; otherwise that test skips, saying why.
wrk:
	@command -v wrk >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			--no-install-recommends wrk) || \
		echo "wrk could not be installed: the benchmark smoke test will skip"; \
	else echo "no wrk (not root, or no apt-get): the benchmark smoke test will skip"; fi

# Prometheus' promtool for the Grafana dashboard's and the alert rules' tests
# (tests/unit/test_grafana_dashboard.py, tests/integration/test_grafana_metrics.py), when none
# is on the PATH: taken out of Debian's prometheus package (apt-get download, dpkg-deb -x) into
# .promtool/, so no Prometheus service is installed or started. Without apt (or, not as root,
# without package lists) the promtool checks skip, saying why.
PROMTOOL := .promtool/promtool
promtool:
	@command -v promtool >/dev/null 2>&1 || test -x $(PROMTOOL) || \
	( command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1 && \
	  rm -rf .promtool && mkdir -p .promtool/deb && cd .promtool/deb && \
	  { apt-get download -q prometheus 2>/dev/null || { [ "$$(id -u)" = 0 ] && \
	    apt-get update -q && apt-get download -q prometheus; }; } && \
	  dpkg-deb -x prometheus_*.deb root && mv root/usr/bin/promtool .. && \
	  cd .. && rm -rf deb && ./promtool --version ) || \
	echo "promtool could not be had (Debian's prometheus package): its checks will skip"

# The checks first (seconds), then the suite: ruff, mypy --strict (its files and settings are
# in pyproject.toml: frontend/, backend/, model_archiver/, protos/framing.py), pytest.
test: lint $(TS_STAMP) $(SM_STAMP) browser promtool wrk
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Built once (seeded random weights: no download is possible), then reused: a reinstall does
# not rebuild it (the install is an order-only prerequisite).
$(DEMO_MODEL): | $(SERVE_STAMP)
	$(PY) $(EXAMPLE)/build_mar.py --model-store model_store

# Other ports: `make demo PORT=8180` serves inference on 8180, management on 8181, metrics on
# 8182; GRPC_PORT=7170 moves gRPC inference to 7170 and management to 7171. They reach the
# server as TS_<KEY> variables (config.properties sets enable_envvars_config=true).
PORT ?= 8080
GRPC_PORT ?= 7070
DEMO_ENV := TS_INFERENCE_ADDRESS=http://127.0.0.1:$(PORT) \
	TS_MANAGEMENT_ADDRESS=http://127.0.0.1:$(shell expr $(PORT) + 1) \
	TS_METRICS_ADDRESS=http://127.0.0.1:$(shell expr $(PORT) + 2) \
	TS_GRPC_INFERENCE_PORT=$(GRPC_PORT) TS_GRPC_MANAGEMENT_PORT=$(shell expr $(GRPC_PORT) + 1)

demo: $(SERVE_STAMP) $(DEMO_MODEL)
	@echo
	@echo "Serving ResNet-152 (batch_size 8, max_batch_delay 10 ms, 1 worker). In another terminal:"
	@echo "  curl http://127.0.0.1:$(PORT)/predictions/resnet-152-batch_v2 -T $(EXAMPLE)/kitten.jpg"
	@echo "Stop with Ctrl-C."
	@echo
	$(DEMO_ENV) $(VENV)/bin/torchserve --start --foreground --ts-config config.properties \
		--model-store model_store --models resnet-152-batch_v2=resnet-152-batch_v2.mar \
		--disable-token-auth --enable-model-api

# The container image (docs/container.md), built here and smoke-tested: opt-in and slow (torch
# goes into it), never part of `make test`. Needs root; installs mmdebstrap, podman and runc
# with apt when missing. IMAGE_ARGS reach docker/build.py, e.g. IMAGE_ARGS="--variant cuda",
# or IMAGE_ARGS="--variant sagemaker" for the SageMaker image (docs/container.md).
IMAGE_TOOLS := mmdebstrap podman runc
IMAGE_ARGS ?=

image: $(STAMP)
	@for tool in $(IMAGE_TOOLS); do command -v $$tool >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
		$(IMAGE_TOOLS); fi
	$(PY) -m docker.build $(IMAGE_ARGS)

clean:
	rm -rf $(VENV) $(TS_VENV) $(SM_VENV) model_store/*.mar logs
