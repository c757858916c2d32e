"""Registered models: names, versions and each name's default version.

Only bookkeeping: the loader (frontend/models/loader.py) builds, starts and stops models;
the management layer (frontend/ops/management.py) describes them.

A name belongs to one owner: the models registered through the model API (any number of
versions), or one workflow, whose node it serves (``Model.workflow``; one version, the
node's). Nothing can add a version under a name a workflow owns, and a workflow's node
cannot take a name that is registered: so a workflow's node is never replaced, joined by
another version or made to answer for someone else, and the node calls of a workflow reach
the very ``Model`` it registered (frontend/ops/workflow_runs.py holds it, not its name).
"""

from __future__ import annotations

from collections.abc import Iterator

from frontend.errors import Conflict, ModelNotFound, ModelVersionNotFound, excerpt
from frontend.models.model import Model


class ModelRegistry:
    """All registered models by name and version, and which version is the default."""

    def __init__(self) -> None:
        self._models: dict[str, dict[str, Model]] = {}
        self._defaults: dict[str, str] = {}
        #: Startup models (model_snapshot, load_models) that failed to register: while one is
        #: not registered, the server is not ready (KServe's readiness).
        self.failed_at_startup: set[str] = set()
        #: The models loaded at start-up by ``load_models`` / ``--models`` (not a snapshot's),
        #: while registered: SageMaker's ``/invocations`` without a model name means the one
        #: model here when there is exactly one (TorchServe's ``startupModels``).
        self.startup_models: set[str] = set()

    # ---- lookup -------------------------------------------------------------------------

    def _versions_of(self, name: str) -> dict[str, Model]:
        versions = self._models.get(name)
        if not versions:
            raise ModelNotFound(f"Model not found: {excerpt(name)}")
        return versions

    def get(self, name: str, version: str | None = None) -> Model:
        versions = self._versions_of(name)
        if version is None:
            return versions[self._defaults[name]]
        try:
            return versions[version]
        except KeyError:
            raise ModelVersionNotFound(
                f"Model version {excerpt(version)} does not exist for model "
                f"{excerpt(name)}") from None

    def has(self, name: str, version: str) -> bool:
        return version in self._models.get(name, {})

    def holds(self, model: Model) -> bool:
        """Whether this very version is registered (not another under its name)."""
        return self._models.get(model.name, {}).get(model.version) is model

    def owner(self, name: str) -> str | None:
        """The workflow whose node the model ``name`` is, or None (a model of the model API,
        or no model)."""
        versions = self._models.get(name)
        return next(iter(versions.values())).workflow if versions else None

    def check_free(self, name: str, version: str | None, workflow: str | None = None) -> None:
        """Conflict (409) unless version ``version`` of ``name`` may be added (None: any
        version), for the model API (``workflow`` None) or as a node of ``workflow``: see the
        module's text."""
        versions = self._models.get(name)
        if not versions:
            return
        owner = self.owner(name)
        if owner is not None:
            raise Conflict(f"Model {name} is a node of workflow {owner}: its name is the "
                           f"workflow's alone (it is registered and removed with the workflow)")
        if workflow is not None:
            raise Conflict(f"Model {name} is already registered: workflow {workflow} cannot "
                           f"serve a node under its name")
        if version in versions:
            raise Conflict(f"Model version {version} is already registered for model {name}")

    def versions(self, name: str) -> list[Model]:
        return list(self._versions_of(name).values())

    def names(self) -> list[str]:
        return sorted(self._models)

    def missing(self) -> list[str]:
        """The startup models that failed to register and are still not registered."""
        return sorted(name for name in self.failed_at_startup if name not in self._models)

    def default_version(self, name: str) -> str:
        self._versions_of(name)  # ModelNotFound
        return self._defaults[name]

    def __iter__(self) -> Iterator[Model]:
        for versions in self._models.values():
            yield from versions.values()

    def worker_count(self) -> int:
        """Workers of every model version (the CPU share of a new worker depends on it)."""
        return sum(len(model.workers) for model in self)

    # ---- changes ------------------------------------------------------------------------

    def add(self, model: Model, make_default: bool = False) -> None:
        """Add a version; the first of a name, or one marked ``make_default``, becomes the
        default."""
        self.check_free(model.name, model.version, model.workflow)
        versions = self._models.setdefault(model.name, {})
        versions[model.version] = model
        if model.name not in self._defaults or make_default:
            self._defaults[model.name] = model.version

    def remove(self, model: Model) -> None:
        """Remove a version (no-op when it is not this registry's); when it was the default,
        the oldest remaining version becomes the default."""
        if not self.holds(model):
            return
        versions = self._models[model.name]
        del versions[model.version]
        if not versions:
            del self._models[model.name]
            self._defaults.pop(model.name, None)
            self.startup_models.discard(model.name)
        elif self._defaults.get(model.name) == model.version:
            self._defaults[model.name] = next(iter(versions))

    def set_default(self, name: str, version: str) -> None:
        self.get(name, version)
        self._defaults[name] = version
