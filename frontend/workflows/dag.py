"""A workflow's DAG, checked: one start node, no cycle; each node's parents and children.

TorchServe's rules (its ``Dag``): a node feeding itself, two nodes feeding each other, more
or fewer than one start node (a node nothing feeds) and any other cycle are refused
(InvalidDAGException, 400). A node with no children is a leaf: the workflow's answer is its
output (several leaves: a JSON object of their outputs by node name).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from frontend.errors import InvalidDag


@dataclass(frozen=True, slots=True)
class Dag:
    start: str
    #: Every node, parents before children.
    order: tuple[str, ...]
    #: Node -> the nodes that feed it, in the order the spec names the edges.
    parents: Mapping[str, tuple[str, ...]]
    children: Mapping[str, tuple[str, ...]]
    leaves: tuple[str, ...]


def build_dag(edges: Mapping[str, tuple[str, ...]]) -> Dag:
    """The DAG of ``edges`` (node -> the nodes it feeds); InvalidDag when it is not one."""
    nodes: list[str] = []
    for node, targets in edges.items():
        for name in (node, *targets):
            if name not in nodes:
                nodes.append(name)
    parents: dict[str, list[str]] = {node: [] for node in nodes}
    children: dict[str, list[str]] = {node: [] for node in nodes}
    for node, targets in edges.items():
        for target in targets:
            if target == node:
                raise InvalidDag(f"Self loop exception: node {node} feeds itself")
            if node in children[target]:
                raise InvalidDag(f"loop exception: nodes {node} and {target} feed each other")
            if target not in children[node]:
                children[node].append(target)
                parents[target].append(node)
    starts = [node for node in nodes if not parents[node]]
    if len(starts) != 1:
        found = f"found {len(starts)}" + (f" ({', '.join(starts)})" if starts else "")
        raise InvalidDag(f"DAG should have only one start node, {found}")
    order: list[str] = []
    waiting = {node: len(parents[node]) for node in nodes}
    ready = list(starts)
    while ready:
        node = ready.pop(0)
        order.append(node)
        for child in children[node]:
            waiting[child] -= 1
            if not waiting[child]:
                ready.append(child)
    if len(order) != len(nodes):
        cycle = ", ".join(node for node in nodes if node not in order)
        raise InvalidDag(f"Not a valid DAG: a cycle passes through {cycle}")
    return Dag(starts[0], tuple(order),
               {node: tuple(value) for node, value in parents.items()},
               {node: tuple(value) for node, value in children.items()},
               tuple(node for node in nodes if not children[node]))
