"""A workflow's spec, read by ``workflow_archiver.spec`` (the same reader as the
``workflow-archiver`` tool's: TorchServe 0.12's rules), its errors as the server answers them.

What the reader returns: every DAG node (a model of ``models`` with its ``url``, or a
function of the handler file), its settings, parents and children, the one start node and the
leaves; model sections no node names are not served, as in TorchServe. A spec that cannot be
served is 400 (``InvalidWorkflowException``; a bad DAG ``InvalidDAGException``, as
TorchServe).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from frontend.errors import InvalidDag, InvalidWorkflow
from model_archiver.yaml_files import YamlError, load_yaml
from workflow_archiver import InvalidDAGError, SpecError, WorkflowArchiverError
from workflow_archiver.spec import (
    MAX_SPEC_BYTES,
    NodeSpec,
    WorkflowSpec,
    handler_names,
    parse_spec,
)

__all__ = ["NodeSpec", "WorkflowSpec", "dag_text", "read_spec"]


def read_spec(text: str, workflow_name: str, handler_source: str | None) -> WorkflowSpec:
    """The checked spec of the workflow ``workflow_name``; ``handler_source``: its handler
    file's text (a function node it does not define is refused), None without one."""
    functions: Collection[str] | None = None
    try:
        if handler_source is not None:
            functions = handler_names(handler_source)
        return parse_spec(text, workflow_name, functions=functions)
    except InvalidDAGError as exc:
        raise InvalidDag(str(exc)) from None
    except (SpecError, WorkflowArchiverError) as exc:
        raise InvalidWorkflow(str(exc)) from None


def dag_text(spec_text: str) -> str:
    """The spec's ``dag`` section as TorchServe's describe shows it (Java's Map.toString of
    what its YAML reader read): ``{pre=[m1, m2], m1=[post], m2=[post]}``."""
    try:
        dag = (load_yaml(spec_text, max_bytes=MAX_SPEC_BYTES) or {}).get("dag")
    except (YamlError, AttributeError):
        return "{}"
    if not isinstance(dag, Mapping):
        return "{}"

    def shown(value: object) -> str:
        if value is None:
            return "null"
        if isinstance(value, list):
            return "[" + ", ".join(shown(item) for item in value) + "]"
        return str(value)

    return "{" + ", ".join(f"{key}={shown(value)}" for key, value in dag.items()) + "}"
