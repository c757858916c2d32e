"""The Kubernetes manifests in deploy/, checked offline.

The Helm chart is rendered by Helm itself: helm-python-sdk's wheel carries Helm's Go SDK as a
shared library, so no helm binary, cluster or download is needed. Every resource, rendered or
written by hand, is then validated strictly:

* built-in kinds by kubernetes-validate against the Kubernetes release pinned below, its strict
  schemas refusing unknown fields; a kind it has no schema for (what its command line reports
  as a warning) fails here;
* custom resources (KServe's ClusterServingRuntime and InferenceService, KEDA's ScaledObject)
  against the CRDs vendored in deploy/crds: jsonschema checks types, enums, patterns and
  required fields of the openAPIV3Schema, and a walk of the schema refuses every field the
  schema does not declare, as the API server's field validation does where a structural schema
  would prune it (x-kubernetes-preserve-unknown-fields keeps them), with list-type map/set
  uniqueness; metadata is checked as ObjectMeta. CEL rules are not evaluated: the one our
  manifests reach (KEDA's minReplicaCount <= maxReplicaCount) is checked by hand.

The chart's config.properties is read back by batchserve's own config loader.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from frontend.config import Address, build_config, read_properties

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "batchserve"
KSERVE = DEPLOY / "kserve"
CRDS = DEPLOY / "crds"
#: The Kubernetes release the built-in kinds are validated against (KServe 0.20 builds on the
#: 1.34 API; 1.32 is the oldest release still widely run, so nothing newer is relied on).
KUBERNETES_VERSION = "1.32.0"
CUSTOM_KINDS = {
    ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"):
        CRDS / "kserve" / "serving.kserve.io_clusterservingruntimes.yaml",
    ("serving.kserve.io/v1beta1", "InferenceService"):
        CRDS / "kserve" / "serving.kserve.io_inferenceservices.yaml",
    ("keda.sh/v1alpha1", "ScaledObject"): CRDS / "keda" / "keda.sh_scaledobjects.yaml",
}
#: The CEL rules (x-kubernetes-validations) our manifests reach, each checked by hand below.
KNOWN_CEL_RULES = {
    "!has(self.minReplicaCount) || self.minReplicaCount <= (has(self.maxReplicaCount) ? "
    "self.maxReplicaCount : 100)",
}
RUNTIME_ARGS = ["torchserve", "--start", "--model-store=/mnt/models/model-store",
                "--ts-config=/mnt/models/config/config.properties"]


# ---- validation -------------------------------------------------------------------------------


class Crd:
    """One served version of a vendored CRD."""

    def __init__(self, path: Path, version: str) -> None:
        document = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
        [served] = [v for v in document["spec"]["versions"] if v["name"] == version]
        self.schema: dict[str, Any] = served["schema"]["openAPIV3Schema"]
        self.namespaced = document["spec"]["scope"] == "Namespaced"
        # OpenAPI v3.0 schemas are JSON Schema draft 4 in their validation keywords.
        self.validator = jsonschema.Draft4Validator(self.schema)


@functools.cache
def crd_for(api_version: str, kind: str) -> Crd:
    return Crd(CUSTOM_KINDS[api_version, kind], api_version.rpartition("/")[2])


def undeclared_fields(value: Any, schema: dict[str, Any], path: str,
                      rules: set[str]) -> Iterator[str]:
    """Fields of ``value`` that ``schema`` does not declare, and duplicates in lists keyed as
    maps or sets; collects the CEL rules on the way into ``rules``."""
    for rule in schema.get("x-kubernetes-validations", ()):
        rules.add(rule["rule"])
    if isinstance(value, dict):
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields", False)
        embedded = schema.get("x-kubernetes-embedded-resource", False)
        for key, item in value.items():
            where = f"{path}.{key}"
            if properties is not None and key in properties:
                yield from undeclared_fields(item, properties[key], where, rules)
            elif isinstance(extra, dict):
                yield from undeclared_fields(item, extra, where, rules)
            elif not (preserve or (embedded and key in ("apiVersion", "kind", "metadata"))):
                yield where
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            yield from undeclared_fields(item, schema["items"], f"{path}[{index}]", rules)
        list_type = schema.get("x-kubernetes-list-type")
        if list_type == "map":
            keys = schema.get("x-kubernetes-list-map-keys", [])
            seen = [tuple(item.get(k) for k in keys) for item in value]
        elif list_type == "set":
            seen = [json.dumps(item, sort_keys=True) for item in value]
        else:
            seen = []
        if len(set(seen)) != len(seen):
            yield f"{path} (duplicate {list_type} entries)"


def check_metadata(metadata: dict[str, Any], namespaced: bool) -> None:
    """ObjectMeta, strictly: kubernetes-validate's schema of it, through a ConfigMap."""
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata},
                                 KUBERNETES_VERSION, strict=True)
    assert namespaced or "namespace" not in metadata, "a cluster-scoped resource has a namespace"


def validate_custom(resource: dict[str, Any]) -> set[str]:
    """Validate a custom resource against its CRD; return the CEL rules it reaches."""
    crd = crd_for(resource["apiVersion"], resource["kind"])
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in crd.validator.iter_errors(resource)]
    assert not errors, errors
    check_metadata(resource["metadata"], crd.namespaced)
    body = {key: value for key, value in resource.items() if key != "metadata"}
    rules: set[str] = set()
    undeclared = list(undeclared_fields(body, crd.schema, resource["kind"], rules))
    assert not undeclared, f"fields the CRD does not declare: {undeclared}"
    return rules


def validate(resource: dict[str, Any]) -> set[str]:
    """Validate one resource strictly (see the module's docstring); return the CEL rules left
    to check by hand. A kind neither validator knows fails."""
    if (resource["apiVersion"], resource["kind"]) in CUSTOM_KINDS:
        return validate_custom(resource)
    kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    return set()


def validate_all(resources: list[dict[str, Any]]) -> None:
    rules: set[str] = set()
    for resource in resources:
        rules |= validate(resource)
    assert rules <= KNOWN_CEL_RULES, f"CEL rules with no check here: {rules - KNOWN_CEL_RULES}"


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render(values: dict[str, Any] | None = None, namespace: str = "models"
           ) -> dict[str, dict[str, Any]]:
    """The chart's resources for ``values``, by kind (each kind at most once here)."""
    rendered = helm.Chart.load(CHART).render(values, name="demo", namespace=namespace,
                                             is_install=True)
    resources = [doc for path, text in rendered.items() if path.endswith(".yaml")
                 for doc in documents(text)]
    by_kind = {resource["kind"]: resource for resource in resources}
    assert len(by_kind) == len(resources), [r["kind"] for r in resources]
    return by_kind


def render_error(values: dict[str, Any]) -> str:
    with pytest.raises(helm.HelmError) as caught:
        render(values)
    return str(caught.value)


# ---- the validators themselves --------------------------------------------------------------


def _inference_service() -> dict[str, Any]:
    return documents((KSERVE / "inferenceservice-raw-keda.yaml").read_text())[0]


def test_the_crd_check_refuses_undeclared_fields_and_keeps_preserved_ones() -> None:
    isvc = _inference_service()
    validate(isvc)
    typo = json.loads(json.dumps(isvc))
    typo["spec"]["predictor"]["model"]["storageURI"] = "pvc://x"
    with pytest.raises(AssertionError, match=r"predictor\.model\.storageURI"):
        validate(typo)
    # status is x-kubernetes-preserve-unknown-fields: anything goes there.
    preserved = {**isvc, "status": {"anything": {"at": "all"}}}
    validate(preserved)
    duplicate = json.loads(json.dumps(isvc))
    ports = duplicate["spec"]["predictor"]["model"]["ports"]
    ports.append(dict(ports[0]))
    with pytest.raises(AssertionError, match="duplicate map entries"):
        validate(duplicate)
    wrong_type = json.loads(json.dumps(isvc))
    wrong_type["spec"]["predictor"]["minReplicas"] = "one"
    with pytest.raises(AssertionError, match="minReplicas"):
        validate(wrong_type)
    bad_metadata = {**isvc, "metadata": {**isvc["metadata"], "labelz": {}}}
    with pytest.raises(jsonschema.ValidationError, match="labelz"):
        validate(bad_metadata)


def test_builtin_kinds_are_strict_and_an_unknown_kind_fails() -> None:
    deployment = render()["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["path"] = "/ping"
    with pytest.raises(jsonschema.ValidationError, match="path"):
        validate(deployment)
    with pytest.raises(kubernetes_validate.utils.SchemaNotFoundError):
        validate({"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
                  "metadata": {"name": "x"}})


def test_the_vendored_crds_are_the_upstream_files_named_in_their_readme() -> None:
    readme = (CRDS / "README.md").read_text()
    digests = dict((path, digest) for digest, path in
                   re.findall(r"^([0-9a-f]{64})  (\S+)$", readme, re.MULTILINE))
    assert set(digests) == {str(path.relative_to(CRDS)) for path in CUSTOM_KINDS.values()}
    for path, digest in digests.items():
        assert hashlib.sha256((CRDS / path).read_bytes()).hexdigest() == digest, path
    for project in ("kserve", "keda"):
        assert "Apache License\n                           Version 2.0" in \
            (CRDS / project / "LICENSE").read_text()


# ---- KServe ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(KSERVE.glob("*.yaml")), ids=lambda p: p.name)
def test_kserve_manifests_validate(path: Path) -> None:
    resources = documents(path.read_text())
    assert resources
    validate_all(resources)


def test_runtime_is_kserve_torchserve_with_batchserve_in_it() -> None:
    [runtime] = documents((KSERVE / "kserve-batchserve.yaml").read_text())
    assert runtime["kind"] == "ClusterServingRuntime"
    assert runtime["metadata"]["name"] == "kserve-batchserve"
    # What makes KServe set the serviceEnvelope label and PROTOCOL_VERSION for it.
    assert runtime["metadata"]["annotations"]["serving.kserve.io/server-type"] == "torchserve"
    spec = runtime["spec"]
    assert spec["annotations"] == {"prometheus.kserve.io/port": "8082",
                                   "prometheus.kserve.io/path": "/metrics"}
    assert [f["name"] for f in spec["supportedModelFormats"]] == ["pytorch"]
    assert spec["protocolVersions"] == ["v1", "v2", "grpc-v2"]
    [container] = spec["containers"]
    assert container["name"] == "kserve-container"  # the name KServe merges the predictor into
    assert container["args"] == RUNTIME_ARGS
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {"TS_SERVICE_ENVELOPE": "{{.Labels.serviceEnvelope}}", "PROTOCOL_VERSION": "v1"}
    assert "ports" not in container  # Knative allows one; KServe gives 8080 or the ISVC's h2c
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 1000
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]


def test_serverless_sample_lets_batches_fill() -> None:
    text = (KSERVE / "inferenceservice-serverless.yaml").read_text()
    [isvc] = documents(text)
    # The batch size and workers the sample's comment says its config.properties gives.
    stated = re.search(r"batch_size (\d+) and (\d+) workers", text)
    assert stated is not None
    in_one_go = int(stated[1]) * int(stated[2])
    models_line = re.search(r"^#\s+models=(.*)$", text, re.MULTILINE)
    assert models_line is not None
    models = json.loads(models_line[1])
    [[settings]] = [list(versions.values()) for versions in models.values()]
    assert (settings["batchSize"], settings["minWorkers"]) == (int(stated[1]), int(stated[2]))
    predictor = isvc["spec"]["predictor"]
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Serverless"
    assert predictor["containerConcurrency"] >= in_one_go
    assert predictor["scaleMetric"] == "concurrency"
    assert in_one_go <= predictor["scaleTarget"] <= predictor["containerConcurrency"]
    model = predictor["model"]
    assert (model["runtime"], model["modelFormat"]["name"]) == ("kserve-batchserve", "pytorch")
    assert model["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"


def test_raw_sample_scales_on_request_rate_and_queue_depth_with_keda() -> None:
    [isvc] = documents((KSERVE / "inferenceservice-raw-keda.yaml").read_text())
    annotations = isvc["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] == "RawDeployment"
    assert annotations["serving.kserve.io/autoscalerClass"] == "keda"
    predictor = isvc["spec"]["predictor"]
    rate, depth = predictor["autoScaling"]["metrics"]
    for metric, prefix in ((rate, "sum(rate(ts_inference_requests_total{"),
                           (depth, "sum(batchserve_queue_depth{")):
        external = metric["external"]
        assert (metric["type"], external["metric"]["backend"]) == ("External", "prometheus")
        query = external["metric"]["query"]
        assert query.startswith(prefix)
        pods = re.search(r'pod=~"([^"]+)"', query)
        assert pods is not None
        # KServe names the predictor's pods <isvc>-predictor-<replicaset>-<pod>.
        assert re.fullmatch(pods[1], f"{isvc['metadata']['name']}-predictor-5d8f7c9b4-x2x7q")
        assert int(external["target"]["value"]) > 0
    model = predictor["model"]
    assert [(p["name"], p["containerPort"]) for p in model["ports"]] == \
        [("http1", 8080), ("h2c", 8081)]
    assert model["protocolVersion"] == "v2"


# ---- the Helm chart -------------------------------------------------------------------------


VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "pvc-created": {"modelStore": {"type": "pvc", "pvc": {"create": True,
                                                           "storageClassName": "fast"}}},
    "pvc-existing": {"modelStore": {"type": "pvc", "pvc": {"claimName": "models",
                                                            "subPath": "store"}}},
    "image": {"modelStore": {"type": "image", "image": {"repository": "registry/models",
                                                         "tag": "v3"}}},
    "hpa": {"autoscaling": {"enabled": True, "kind": "hpa"}},
    "keda": {"autoscaling": {"enabled": True, "kind": "keda", "minReplicas": 2,
                             "maxReplicas": 6}},
    "gpu-exposed": {"gpus": 2, "management": {"expose": True},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                     "effect": "NoSchedule"}]},
}


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_chart_renders_valid_resources(values: dict[str, Any]) -> None:
    validate_all(list(render(values).values()))


def test_chart_lints_clean() -> None:
    report = helm.lint(CHART, strict=True, kube_version=f"v{KUBERNETES_VERSION}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # warnings and errors


def _config(resources: dict[str, dict[str, Any]], tmp_path: Path) -> Any:
    path = tmp_path / "config.properties"
    path.write_text(resources["ConfigMap"]["data"]["config.properties"])
    config, unknown = build_config(read_properties(path))
    assert unknown == []
    return config


def test_chart_config_is_batchserves_own(tmp_path: Path) -> None:
    values = {"models": [
        {"name": "resnet", "version": "2.0", "mar": "resnet.mar", "url": "https://h/resnet.mar",
         "minWorkers": 2, "maxWorkers": 4, "batchSize": 8, "maxBatchDelay": 10},
        {"name": "bert", "version": "1.0", "mar": "bert.mar", "url": "https://h/bert.mar"}],
        "config": {"max_request_size": 10_000_000, "request_header_timeout": 2.5},
        "gpus": 1}
    config = _config(render(values), tmp_path)
    assert config.inference_address == Address("0.0.0.0", 8080)
    assert config.metrics_address == Address("0.0.0.0", 8082)
    assert config.management_address == Address("127.0.0.1", 8081)
    assert (config.grpc_inference_address, config.grpc_inference_port) == ("0.0.0.0", 7070)
    assert config.grpc_management_address == "127.0.0.1"
    assert str(config.model_store) == "/mnt/models/model-store"
    assert config.load_models == ("resnet=resnet.mar", "bert=bert.mar")
    assert config.models["resnet"]["2.0"].settings == {
        "min_workers": 2, "max_workers": 4, "batch_size": 8, "max_batch_delay_ms": 10}
    assert config.models["bert"]["1.0"].settings == {}  # the server's defaults
    assert config.number_of_gpu == 1
    assert config.disable_token_authorization is True
    assert config.max_request_size_bytes == 10_000_000  # not 1e+07
    assert config.request_header_timeout_s == 2.5

    exposed = _config(render({"management": {"expose": True}}), tmp_path)
    assert exposed.management_address == Address("0.0.0.0", 8081)
    assert exposed.grpc_management_address == "0.0.0.0"


def test_chart_pod_probes_scrapes_and_runs_as_non_root() -> None:
    deployment = render()["Deployment"]
    pod = deployment["spec"]["template"]
    [container] = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8080, "grpc": 7070, "metrics": 8082}
    assert container["args"][:3] == ["torchserve", "--start", "--foreground"]
    assert container["startupProbe"]["httpGet"] == {"path": "/ping", "port": "http"}
    assert container["startupProbe"]["periodSeconds"] * \
        container["startupProbe"]["failureThreshold"] >= 600
    assert container["livenessProbe"]["httpGet"] == {"path": "/ping", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    assert annotations["prometheus.io/path"] == "/metrics"
    security = pod["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 1000
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    # The default model store: an emptyDir the init step downloads the archives into.
    [init] = pod["spec"]["initContainers"]
    assert init["args"] == ["/mnt/models/model-store",
                            "https://torchserve.pytorch.org/mar_files/resnet-18.mar",
                            "resnet-18.mar"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["model-store"] == {"name": "model-store", "emptyDir": {}}
    assert deployment["spec"]["replicas"] == 1
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})


def test_chart_gpus_are_requested_and_limited() -> None:
    [container] = render({"gpus": 2})["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["resources"]["requests"]["cpu"] == "2"  # the other requests stay


def test_chart_model_store_sources() -> None:
    created = render(VALUE_SETS["pvc-created"])
    claim = created["PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    pod = created["Deployment"]["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-store"]["persistentVolumeClaim"] == {
        "claimName": claim["metadata"]["name"], "readOnly": True}

    existing = render(VALUE_SETS["pvc-existing"])
    assert "PersistentVolumeClaim" not in existing
    pod = existing["Deployment"]["spec"]["template"]["spec"]
    [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model-store"]
    assert mount == {"name": "model-store", "mountPath": "/mnt/models/model-store",
                     "readOnly": True, "subPath": "store"}

    [init] = render(VALUE_SETS["image"])["Deployment"]["spec"]["template"]["spec"][
        "initContainers"]
    assert init["image"] == "registry/models:v3"
    assert init["command"][-1] == "/models"


def test_chart_hpa_scales_on_request_rate_and_queue_depth_per_pod() -> None:
    resources = render(VALUE_SETS["hpa"])
    assert "replicas" not in resources["Deployment"]["spec"]  # the autoscaler owns it
    hpa = resources["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == resources["Deployment"]["metadata"]["name"]
    rate, depth = hpa["spec"]["metrics"]
    assert rate["type"] == depth["type"] == "Pods"
    assert rate["pods"]["metric"]["name"] == "ts_inference_requests_per_second"
    assert rate["pods"]["target"] == {"type": "AverageValue", "averageValue": "50"}
    assert depth["pods"]["metric"]["name"] == "batchserve_queue_depth"
    assert depth["pods"]["target"] == {"type": "AverageValue", "averageValue": "16"}
    assert "ScaledObject" not in resources


def test_chart_keda_scales_on_the_release_pods_request_rate_and_queue_depth() -> None:
    resources = render(VALUE_SETS["keda"], namespace="serving")
    scaled = resources["ScaledObject"]
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == resources["Deployment"]["metadata"]["name"]
    assert spec["minReplicaCount"] <= spec["maxReplicaCount"]  # KEDA's CEL rule
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 6)
    rate, depth = spec["triggers"]
    name = resources["Deployment"]["metadata"]["name"]
    for trigger, threshold, prefix in (
            (rate, "50", "sum(rate(ts_inference_requests_total{"),
            (depth, "16", "sum(batchserve_queue_depth{")):
        assert trigger["type"] == "prometheus"
        assert trigger["metadata"]["threshold"] == threshold
        query = trigger["metadata"]["query"]
        assert query.startswith(prefix) and 'namespace="serving"' in query
        pods = re.search(r'pod=~"([^"]+)"', query)
        assert pods is not None
        assert re.fullmatch(pods[1], f"{name}-7c9d5b8f6-q4w2z")
        assert not re.fullmatch(pods[1], f"{name}-other-7c9d5b8f6-q4w2z")
    assert "HorizontalPodAutoscaler" not in resources


def test_chart_refuses_bad_values() -> None:
    assert "replicas" in render_error({"replicas": 3})  # a typo: the schema lists every key
    assert "workers" in render_error({"models": [{"name": "a", "version": "1", "mar": "a.mar",
                                                  "url": "u", "workers": 2}]})
    assert "models" in render_error({"config": {"models": "{}"}})  # the chart's own key
    assert "has no url" in render_error({"models": [{"name": "a", "version": "1",
                                                     "mar": "a.mar"}]})
    assert "listed twice" in render_error({"models": [
        {"name": "a", "version": "1", "mar": "a.mar", "url": "u"}] * 2})
    assert "maxWorkers below minWorkers" in render_error({"models": [
        {"name": "a", "version": "1", "mar": "a.mar", "url": "u", "minWorkers": 3,
         "maxWorkers": 2}]})
    assert "claimName" in render_error({"modelStore": {"type": "pvc"}})
    assert "repository is required" in render_error({"modelStore": {"type": "image"}})
    assert "hpa" in render_error({"autoscaling": {"enabled": True, "kind": "vpa"}})
