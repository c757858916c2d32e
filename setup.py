"""Packaging for batchserve: console scripts ``torchserve``, ``model-archiver`` and
``workflow-archiver`` (also as ``torch-model-archiver`` and ``torch-workflow-archiver``,
TorchServe's names for them)."""

from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "torch>=2.2",
    "torchvision>=0.17",
    "pillow>=10.0",
    "grpcio>=1.85.1,<2",  # the committed *_pb2_grpc.py files refuse older grpcio
    "grpcio-health-checking>=1.85.1,<2",  # grpc.health.v1 on the gRPC ports
    "grpcio-reflection>=1.85.1,<2",  # server reflection (grpcurl and friends)
    "googleapis-common-protos>=1.75,<2",  # google.rpc.status_pb2 for inference.proto
    "protobuf>=7.35,<8",  # the committed *_pb2.py files were generated for protobuf 7.35
    "psutil>=5.9",
    # .safetensors weights (--serialized-file), memory-mapped: backend/weights/files.py.
    "safetensors>=0.4",
    "click>=8.1",
    "prometheus-client>=0.19",
    # One minor version: frontend/api/http/{fast,protocol,app}.py build on uvicorn's private
    # HttpToolsProtocol, RequestResponseCycle and Server steps; a new minor must pass
    # tests/unit/test_uvicorn_contract.py before this pin moves.
    "uvicorn>=0.54,<0.55",
    "httptools>=0.8",  # what uvicorn 0.54 asks for; protocol.py sets its leniencies
    "uvloop>=0.19; sys_platform != 'win32'",
    "python-multipart>=0.0.9",
    "javaproperties>=0.8",
    "pyyaml>=6.0",
    # TLS (frontend/tls.py): PKCS12 keystores, and certificate and key files checked at start.
    "cryptography>=42",
]

#: The otel extra: the SDK and both OTLP exporters (light: pure Python, on the grpcio and
#: protobuf the server has anyway).
OTEL = [
    "opentelemetry-sdk>=1.30,<2",
    "opentelemetry-exporter-otlp-proto-http>=1.30,<2",
    "opentelemetry-exporter-otlp-proto-grpc>=1.30,<2",
]

EXTRAS_REQUIRE = {
    "dev": [
        "pytest>=8.0",
        "requests>=2.31",
        "grpcio-tools>=1.60",
        "ruff>=0.5",
        # Type checking in `make test`: mypy --strict and the stubs of what we import.
        "mypy>=1.10",
        "types-protobuf",
        "types-grpcio",
        "types-psutil",
        "types-PyYAML",
        "types-requests",
        "openapi-spec-validator>=0.7",
        "hypothesis>=6.100",  # property tests: tests/unit/test_fuzz.py, test_bad_input.py
        # Triton's client against our KServe v2 endpoints: tests/integration/test_kserve_clients.py.
        # Not its [grpc] extra, which pins protobuf<7; tritonclient.grpc needs only grpcio and
        # protobuf, which are installed anyway, and works with protobuf 7.
        "tritonclient[http]>=2.73,<3",
        # Explanations by the built-in image classifiers (tests/integration/test_explanations.py).
        "captum>=0.9,<0.10",
        # deploy/ checked offline (tests/unit/test_deploy_manifests.py): Helm's Go SDK as a
        # shared library in the wheel renders the chart (no helm binary or download), and
        # kubernetes-validate's strict schemas (1.32 among them) and jsonschema (the vendored
        # KServe and KEDA CRDs) validate what it renders.
        "helm-python-sdk>=0.2.2,<0.3",
        "kubernetes-validate>=1.32,<2",
        # jsonschema also validates the Grafana dashboard (deploy/grafana) against Grafana's
        # JSON schemas (tests/unit/test_grafana_dashboard.py).
        "jsonschema>=4.18",
        # The PromQL of the dashboard and the alert rules, parsed to check the metrics and
        # labels they use (promtool, from Debian's prometheus package, checks them too).
        "promql-parser>=0.5,<1",
        # Traces (the otel extra, below) in the tests: tests/integration/test_traces.py exports
        # to an OTLP receiver built on opentelemetry-proto, which the exporters bring.
        *OTEL,
    ],
    # Explanations (/explanations, KServe's explain) with Captum's IntegratedGradients, as
    # TorchServe's image classifier gives them; without it they answer 501.
    "explain": [
        "captum>=0.9,<0.10",
    ],
    # OpenTelemetry traces of predictions (otel_traces=true: docs/batches.md, "Traces"),
    # exported over OTLP/HTTP or OTLP/gRPC; imported only when tracing is on.
    "otel": OTEL,
    # Vertex AI's AIP_STORAGE_URI in Google Cloud Storage (gs://): Google's storage client
    # library fetches model.mar at start (frontend/models/storage.py); imported only then.
    "vertex": [
        "google-cloud-storage>=2.10,<4",
    ],
    # benchmarks/ (python -m benchmarks.suite): plots and progress bars.
    "bench": [
        "matplotlib>=3.8",
        "tqdm>=4.66",
    ],
}

setup(
    name="batchserve",
    version="0.1.0",
    description="A TorchServe-compatible multi-process model server that batches better",
    python_requires=">=3.10",
    packages=find_packages(include=["frontend*", "backend*", "protos*", "model_archiver*",
                                    "workflow_archiver*"]),
    # frontend/observe/metrics.yaml: TorchServe's default metrics configuration (data);
    # frontend/api/http/dashboard.html: the live page (GET /dashboard), served as it is.
    package_data={"protos": ["*.proto", "*.pyi"], "frontend.observe": ["*.yaml"],
                  "frontend.api.http": ["*.html"],
                  "backend.compat.ts": ["version.txt"],
                  "": ["py.typed"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={
        "console_scripts": [
            "torchserve=frontend.cli:main",
            "model-archiver=model_archiver.cli:main",
            # The name TorchServe users type: the same tool.
            "torch-model-archiver=model_archiver.cli:main",
            # A model.py plus weights, or a TorchScript file, as both .pt2 kinds (issue 37).
            "batchserve-export=backend.weights.export:main",
            "workflow-archiver=workflow_archiver.cli:main",
            "torch-workflow-archiver=workflow_archiver.cli:main",
        ],
    },
)
