"""The PromQL of deploy/: the Grafana dashboard's queries and variables, and the alert rules,
read for the tests that check them (tests/unit/test_grafana_dashboard.py against Grafana's
schemas and promtool, tests/integration/test_grafana_metrics.py against a real server).

Expressions are parsed with promql-parser (the Prometheus parser, ported to Rust by
GreptimeDB) to find the metrics and labels they use; promtool, Prometheus' own tool, checks
them where it is installed (Debian's ``prometheus`` package: ``make test`` takes it out of it).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import promql_parser
import yaml

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "batchserve.json"
SCHEMAS = GRAFANA / "schema"
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "batchserve-alerts.yml"
RULES_TEST = PROMETHEUS / "batchserve-alerts.test.yml"

#: Grafana's variables in the queries, for a syntax check: any job, instance and model.
ANY = {"job": ".*", "instance": ".*", "model": ".*", "__rate_interval": "5m",
       "__range": "1h"}
_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*(\w+)\)$", re.S)
#: Labels every scraped series has (Prometheus adds them) or that PromQL makes.
SCRAPE_LABELS = {"job", "instance"}


@dataclass(frozen=True)
class Query:
    """One PromQL expression of deploy/ and where it is."""

    where: str
    expr: str


@dataclass
class Uses:
    """What an expression reads: metric names, each with the labels its selectors match on;
    the labels it aggregates or matches by (``by``, ``on``); and selectors by name regex."""

    metrics: dict[str, set[str]] = field(default_factory=dict)
    grouping: set[str] = field(default_factory=set)
    name_patterns: list[str] = field(default_factory=list)
    made_labels: set[str] = field(default_factory=set)


def dashboard() -> dict[str, Any]:
    import json

    return json.loads(DASHBOARD.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def panels(board: Mapping[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Every panel, those inside rows included (rows themselves are not)."""
    for panel in (board or dashboard())["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def dashboard_queries() -> list[Query]:
    return [Query(f"panel {panel['id']} {panel['title']!r} query {target['refId']}",
                  target["expr"])
            for panel in panels() for target in panel.get("targets", [])]


def variable_queries() -> list[tuple[Query, str]]:
    """The query variables' ``label_values(selector, label)``: the selector and the label."""
    found = []
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = _LABEL_VALUES.match(variable["query"])
        assert match, f"variable {variable['name']}: not label_values(selector, label)"
        found.append((Query(f"variable {variable['name']}", match[1]), match[2]))
    return found


def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [rule for group in document["groups"] for rule in group["rules"]]


def rule_queries() -> list[Query]:
    return [Query(f"rule {rule.get('alert') or rule.get('record')}", rule["expr"])
            for rule in rules()]


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """``expr`` with Grafana's variables replaced by ``values`` (KeyError: an unknown one)."""
    return _VARIABLE.sub(lambda match: values[match[1] or match[2]], expr)


def uses(expr: str) -> Uses:
    """What ``expr`` (no Grafana variables left) reads; ValueError when it does not parse."""
    found = Uses()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            labels = {matcher.name for matcher in node.matchers.matchers}
            if node.name is not None:
                found.metrics.setdefault(node.name, set()).update(labels - {"__name__"})
            for matcher in node.matchers.matchers:
                if matcher.name == "__name__":
                    found.name_patterns.append(matcher.value)
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            if "By" in str(node.modifier.type):
                found.grouping.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            matching = node.modifier.matching
            if matching is not None and "Include" in str(matching.type):  # on (...)
                found.grouping.update(matching.labels)
        elif isinstance(node, promql_parser.Call) and node.func.name == "label_replace":
            found.made_labels.add(node.args[1].val)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def promtool() -> str | None:
    """Prometheus' promtool: the PATH's, else the one ``make promtool`` put in .promtool/."""
    local = ROOT / ".promtool" / "promtool"
    return shutil.which("promtool") or (str(local) if local.is_file() else None)


PROMTOOL_MISSING = ("no promtool on the PATH or in .promtool/ (`make promtool`, part of `make "
                    "test`, takes it out of Debian's prometheus package where apt-get can "
                    "download it)")
