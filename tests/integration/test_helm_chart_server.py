"""The Helm chart's config.properties runs a real server that answers the chart's probes.

The chart is rendered by Helm (helm-python-sdk) as in tests/unit/test_deploy_manifests.py; its
config.properties is used as it is, but for what only makes sense in a pod: the binds (loopback
on free ports here, 0.0.0.0 in the pod) and the log directory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python as helm
import requests
import yaml

from frontend.config import read_properties
from tests.conftest import ServerProcess

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "batchserve"
POD_ONLY = ("inference_address", "management_address", "metrics_address",
            "grpc_inference_address", "grpc_management_address", "grpc_inference_port",
            "grpc_management_port", "log_location")


def _render(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rendered = helm.Chart.load(CHART).render(values, name="demo", namespace="models")
    return {doc["kind"]: doc for path, text in rendered.items() if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc}


def test_the_charts_config_serves_and_answers_its_probes(
        build_mar, server_process: Callable[..., ServerProcess], tmp_path: Path) -> None:
    build_mar("echo", "echo", version="3.0")
    resources = _render({"models": [{
        "name": "echo", "version": "3.0", "mar": "echo.mar", "url": "https://models/echo.mar",
        "minWorkers": 2, "maxWorkers": 2, "batchSize": 4, "maxBatchDelay": 5}]})
    properties_file = tmp_path / "chart.properties"
    properties_file.write_text(resources["ConfigMap"]["data"]["config.properties"])
    properties = {key: value for key, value in read_properties(properties_file).items()
                  if key not in POD_ONLY}
    assert properties["load_models"] == "echo=echo.mar"
    server = server_process(config=properties)

    [container] = resources["Deployment"]["spec"]["template"]["spec"]["containers"]
    probes = [container[probe]["httpGet"]
              for probe in ("startupProbe", "livenessProbe", "readinessProbe")]
    assert {probe["port"] for probe in probes} == {"http"}  # the inference port
    for probe in probes:
        answer = requests.get(f"{server.inference}{probe['path']}", timeout=10)
        assert answer.status_code == 200, (probe, answer.text)
    # Ready: the model's settings came from the chart, and both its workers are up.
    described = requests.get(f"{server.management}/models/echo", timeout=30).json()[0]
    assert (described["modelVersion"], described["batchSize"], described["maxBatchDelay"]) == \
        ("3.0", 4, 5)
    assert (described["minWorkers"], described["maxWorkers"]) == (2, 2)
    assert [w["status"] for w in described["workers"]] == ["READY", "READY"]

    annotations = resources["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    metrics = requests.get(f"{server.metrics}{annotations['prometheus.io/path']}", timeout=10)
    assert 'batchserve_queue_depth{model_name="echo",model_version="3.0",} 0.0' in metrics.text
    assert server.is_alive()
