"""The Grafana dashboard and the Prometheus alert rules in deploy/, checked offline.

* The dashboard is what deploy/grafana/generate.py writes, and it validates against Grafana's
  own JSON schemas (deploy/grafana/schema: the classic dashboard model, and per panel the
  plugin's options, field config and the Prometheus query model), kept unchanged with their
  source, commit and licence; the schemas refuse an unknown field, so a typo fails here.
* Every query (panels, variables, rules) parses as PromQL, checked by promql-parser always and
  by Prometheus' own promtool where it is installed (``make test`` takes it out of Debian's
  ``prometheus`` package into .promtool/): the dashboard's queries as recording rules, the
  alert rules with ``promtool check rules`` and their behaviour with ``promtool test rules``.

That every metric and label they name is one a real server exports, and that each dashboard
query returns data from it, is tests/integration/test_grafana_metrics.py.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.unit import queries
from tests.unit.queries import ANY, SCHEMAS

#: The files kept from grafana/grafana-foundation-sdk, and their SHA-256 as fetched
#: (deploy/grafana/schema/README.md): an edit there is caught.
SCHEMA_DIGESTS = {
    "dashboard.jsonschema.json":
        "67451cd5b288f97e3f68eccd52ffa4f75151fc87c669b8cd93c051056b294265",
    "prometheus.jsonschema.json":
        "726fc97eeb1e37791dbbf988c3cf40de17bb8e623926e6979c4a3f947cb1af87",
    "timeseries.jsonschema.json":
        "77ba36d66bbfcb363eeb5e6957813ca4b4cbc5a5bc4e8a12034d4c3b8cbbbde4",
    "stat.jsonschema.json": "da547c8b1e52883a77e876f34d90d6034266ca8488a5601900ca26fc01d74b9e",
    "heatmap.jsonschema.json":
        "1e1905eef14ada48c121374ecad41412380b317e8183771d99a7504753d5005c",
    "bargauge.jsonschema.json":
        "dbd22a7b71c4133b880ad39daeaf33c5bf0509fe0d5dc7a882fe3449207b636f",
}
GRID_COLUMNS = 24
SEVERITIES = {"critical", "warning", "info"}


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("grafana_generate",
                                                  queries.GRAFANA / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _schema(name: str, definition: str | None = None) -> dict[str, Any]:
    """A kept schema, or one of its definitions as the root (its other definitions kept)."""
    schema: dict[str, Any] = json.loads((SCHEMAS / name).read_text(encoding="utf-8"))
    if definition is None:
        return schema
    assert definition in schema["definitions"], f"{name} defines no {definition}"
    return {"$schema": schema["$schema"], "definitions": schema["definitions"],
            "$ref": f"#/definitions/{definition}"}


def _errors(schema: dict[str, Any], instance: Any) -> list[str]:
    """Each error, at its path; where no branch of an anyOf (a panel or a row) fits, the
    reason of the branch that fits best."""
    found = []
    for error in jsonschema.Draft7Validator(schema).iter_errors(instance):
        while error.context:
            error = jsonschema.exceptions.best_match(error.context)
        found.append(f"{'/'.join(map(str, error.absolute_path)) or '(root)'}: {error.message}")
    return found


def _dashboard_errors(board: dict[str, Any]) -> list[str]:
    """Every schema error of ``board``: the dashboard model, then each panel's plugin options,
    custom field config and Prometheus queries."""
    problems = _errors(_schema("dashboard.jsonschema.json"), board)
    for panel in queries.panels(board):
        plugin = f"{panel['type']}.jsonschema.json"
        where = f"panel {panel.get('id')} {panel.get('title')!r}"
        # The dashboard's panels are a Panel or a RowPanel: the reason a panel is neither.
        problems += [f"{where}: {e}"
                     for e in _errors(_schema("dashboard.jsonschema.json", "Panel"), panel)]
        assert (SCHEMAS / plugin).exists(), f"{where}: no schema kept for {panel['type']}"
        problems += [f"{where} options: {e}"
                     for e in _errors(_schema(plugin, "Options"), panel.get("options", {}))]
        custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom")
        if custom is not None:
            problems += [f"{where} fieldConfig.defaults.custom: {e}"
                         for e in _errors(_schema(plugin, "FieldConfig"), custom)]
        for target in panel.get("targets", []):
            problems += [f"{where} target {target.get('refId')}: {e}"
                         for e in _errors(_schema("prometheus.jsonschema.json"), target)]
    return problems


# -- the dashboard -----------------------------------------------------------------------------

def test_the_committed_dashboard_is_what_the_generator_writes() -> None:
    assert queries.DASHBOARD.read_text(encoding="utf-8") == _generator().render(), (
        "deploy/grafana/batchserve.json is stale: run python deploy/grafana/generate.py")


def test_the_kept_schemas_are_unchanged() -> None:
    kept = {path.name for path in SCHEMAS.glob("*.json")}
    assert kept == set(SCHEMA_DIGESTS)
    for name, digest in SCHEMA_DIGESTS.items():
        assert hashlib.sha256((SCHEMAS / name).read_bytes()).hexdigest() == digest, name
    readme = (SCHEMAS / "README.md").read_text(encoding="utf-8")
    for name, digest in SCHEMA_DIGESTS.items():
        assert f"{digest}  {name}" in readme, f"README.md lacks the digest of {name}"
    assert "Apache License" in (SCHEMAS / "LICENSE").read_text(encoding="utf-8")


def test_the_dashboard_validates_against_grafanas_schemas() -> None:
    assert _dashboard_errors(queries.dashboard()) == []


@pytest.mark.parametrize("break_it, expected", [
    (lambda board: board.__setitem__("refreshh", "30s"), "Additional properties"),
    (lambda board: next(queries.panels(board))["gridPos"].__setitem__("w", 25),
     "is greater than the maximum"),
    (lambda board: next(queries.panels(board))["targets"][0].pop("expr"),
     "'expr' is a required property"),
    (lambda board: next(p for p in queries.panels(board) if p["type"] == "timeseries")
     ["fieldConfig"]["defaults"]["custom"].__setitem__("drawStyle", "dots"),
     "is not one of"),
    (lambda board: next(p for p in queries.panels(board) if p["type"] == "heatmap")
     ["options"].pop("yAxis"), "'yAxis' is a required property"),
], ids=["unknown-key", "too-wide", "query-without-expr", "bad-draw-style", "heatmap-no-axis"])
def test_the_schemas_refuse_a_broken_dashboard(break_it: Any, expected: str) -> None:
    board = copy.deepcopy(queries.dashboard())
    break_it(board)
    problems = _dashboard_errors(board)
    assert any(expected in problem for problem in problems), problems


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    board = queries.dashboard()
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    taken: dict[tuple[int, int], int] = {}
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= GRID_COLUMNS, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, f"{panel['title']!r} overlaps panel {taken[x, y]}"
                taken[x, y] = panel["id"]
    for panel in queries.panels(board):
        assert panel.get("datasource") == {"type": "prometheus", "uid": "${datasource}"}, (
            f"{panel['title']!r} is not on the $datasource variable")
        assert panel.get("description"), f"{panel['title']!r} says not what it shows"


def test_every_dashboard_query_is_filtered_by_the_variables() -> None:
    """Each selector keeps to the chosen job and instance, and a per-model metric to the
    chosen models, by the label that names its model (model_name, or ModelName for a handler's)."""
    model_label = _generator().model_label
    for query in queries.dashboard_queries():
        found = queries.uses(queries.substitute(query.expr, ANY))
        assert found.metrics, query
        for metric, labels in found.metrics.items():
            assert {"job", "instance"} <= labels, f"{query.where}: {metric} unfiltered"
            if metric.startswith(("batchserve_", "ts_")):
                assert model_label(metric) in labels, f"{query.where}: {metric} not by $model"
            if metric in ("PredictionTime", "HandlerTime"):
                assert "ModelName" in labels, f"{query.where}: {metric} not by $model"
    assert model_label("batchserve_request_phase_seconds_bucket") == "model_name"
    assert model_label("batchserve_queue_depth") == "model_name"


# -- PromQL --------------------------------------------------------------------------------------

def _all_queries() -> list[queries.Query]:
    return [*queries.dashboard_queries(), *(query for query, _ in queries.variable_queries()),
            *queries.rule_queries()]


def test_every_query_parses_as_promql() -> None:
    for query in _all_queries():
        try:
            queries.uses(queries.substitute(query.expr, ANY))
        except ValueError as exc:
            pytest.fail(f"{query.where}: {exc}\n{query.expr}")


def test_the_parser_refuses_broken_promql() -> None:
    for broken in ("sum(rate(ts_inference_requests_total[5m])",
                   "histogram_quantile(0.99, rate(x_bucket))",
                   'rate(ts_inference_requests_total{model_name=~"a"}[5x])'):
        with pytest.raises(ValueError):
            queries.uses(broken)


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    tool = queries.promtool()
    if tool is None:
        pytest.skip(queries.PROMTOOL_MISSING)
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, cwd=cwd,
                          check=False)


def _as_recording_rules(exprs: list[queries.Query]) -> dict[str, Any]:
    return {"groups": [{"name": "dashboard", "rules": [
        {"record": f"batchserve_dashboard:query_{index}", "expr": query.expr}
        for index, query in enumerate(exprs)]}]}


def test_promtool_accepts_every_dashboard_query(tmp_path: Path) -> None:
    exprs = [queries.Query(query.where, queries.substitute(query.expr, ANY))
             for query in [*queries.dashboard_queries(),
                           *(query for query, _ in queries.variable_queries())]]
    rules = tmp_path / "dashboard.yml"
    rules.write_text(yaml.safe_dump(_as_recording_rules(exprs)), encoding="utf-8")
    checked = _promtool("check", "rules", str(rules))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in checked.stdout


def test_promtool_refuses_a_broken_query(tmp_path: Path) -> None:
    rules = tmp_path / "broken.yml"
    rules.write_text(yaml.safe_dump(_as_recording_rules(
        [queries.Query("broken", "sum by (model_name) (rate(batchserve_workers))")])),
        encoding="utf-8")
    checked = _promtool("check", "rules", str(rules))
    assert checked.returncode != 0
    assert "expected type range vector" in checked.stdout + checked.stderr


def test_promtool_accepts_the_alert_rules() -> None:
    checked = _promtool("check", "rules", str(queries.RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(queries.rules())} rules found" in checked.stdout


def test_the_alert_rules_fire_when_they_should_and_only_then() -> None:
    """promtool's unit tests: each rule against series that must make it fire and series that
    must not (deploy/prometheus/batchserve-alerts.test.yml)."""
    tested = _promtool("test", "rules", queries.RULES_TEST.name, cwd=queries.PROMETHEUS)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout
    cases = yaml.safe_load(queries.RULES_TEST.read_text(encoding="utf-8"))["tests"]
    firing = {test["alertname"] for case in cases for test in case.get("alert_rule_test", [])
              if test["exp_alerts"]}
    assert firing == {rule["alert"] for rule in queries.rules()}, "an alert without a test"


def test_each_alert_rule_says_what_and_how_bad() -> None:
    names = [rule["alert"] for rule in queries.rules()]
    assert len(names) == len(set(names))
    for rule in queries.rules():
        assert re.fullmatch(r"Batchserve[A-Z]\w+", rule["alert"]), rule["alert"]
        assert re.fullmatch(r"\d+m", rule.get("for", "")), f"{rule['alert']}: no for:"
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_the_docs_explain_every_alert() -> None:
    docs = (queries.ROOT / "docs" / "grafana.md").read_text(encoding="utf-8")
    for rule in queries.rules():
        assert f"| {rule['alert']} |" in docs, f"docs/grafana.md does not list {rule['alert']}"
