"""Registered workflows by name: each one's archive, DAG and node models, and its runs.

Only bookkeeping: the workflow loader (frontend/workflows/loader.py) registers and removes
them; the inference side (frontend/ops/workflows.py) runs them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

from frontend.errors import Conflict, WorkflowNotFound, excerpt
from frontend.models.model import Model
from frontend.workflows.archive import WorkflowArchive
from frontend.workflows.spec import NodeSpec, WorkflowSpec


@dataclass(frozen=True, slots=True)
class WorkflowNode:
    """One node of a registered workflow and the model that serves it."""

    spec: NodeSpec
    model: Model

    @property
    def name(self) -> str:
        return self.spec.name


class Workflow:
    """A registered workflow: what describe shows, what a prediction runs."""

    @property
    def spec(self) -> WorkflowSpec:
        return self.archive.spec

    def __init__(self, archive: WorkflowArchive, nodes: dict[str, WorkflowNode]) -> None:
        self.name = archive.name
        self.archive = archive
        #: The nodes (their parents, children, settings) by name, in the DAG's order.
        self.nodes = nodes
        #: Predictions running now; ``idle`` is set whenever there are none.
        self.running = 0
        self.idle = asyncio.Event()
        self.idle.set()
        #: False once unregistering began: no new prediction starts.
        self.accepting = True

    def begin_run(self) -> None:
        self.running += 1
        self.idle.clear()

    def end_run(self) -> None:
        self.running -= 1
        if not self.running:
            self.idle.set()


class WorkflowRegistry:
    """Workflows by name; a name is reserved while its registration runs."""

    def __init__(self) -> None:
        self._workflows: dict[str, Workflow] = {}
        self._reserved: set[str] = set()

    def get(self, name: str) -> Workflow:
        workflow = self._workflows.get(name)
        if workflow is None:
            raise WorkflowNotFound(f"Workflow not found: {excerpt(name)}")
        return workflow

    def names(self) -> list[str]:
        return sorted(self._workflows)

    def __iter__(self) -> Iterator[Workflow]:
        return iter(list(self._workflows.values()))

    def __len__(self) -> int:
        return len(self._workflows)

    def reserve(self, name: str) -> None:
        """Hold ``name`` for a registration (Conflict when taken or being registered)."""
        if name in self._workflows or name in self._reserved:
            raise Conflict(f"Workflow {name} is already registered.")
        self._reserved.add(name)

    def release(self, name: str) -> None:
        self._reserved.discard(name)

    def add(self, workflow: Workflow) -> None:
        self._reserved.discard(workflow.name)
        self._workflows[workflow.name] = workflow

    def remove(self, name: str) -> Workflow:
        workflow = self.get(name)
        del self._workflows[name]
        workflow.accepting = False
        return workflow
