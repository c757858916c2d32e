"""Vertex AI's container environment (``AIP_*``), read once at start: what Google's prebuilt
PyTorch prediction image serves, as config keys.

Vertex AI starts a prediction container with these variables (Google's "Custom container
requirements", "Environment variables"): ``AIP_HTTP_PORT`` (where it sends every request;
``containerSpec.ports``' first, 8080 by default), ``AIP_HEALTH_ROUTE`` and
``AIP_PREDICT_ROUTE`` (the paths of its health checks, GET, and of its predictions, POST),
``AIP_STORAGE_URI`` (the ``gs://`` folder Vertex copied the model's ``artifactUri`` to),
``AIP_MODE`` (``PREDICTION``) and ``AIP_MODE_VERSION``, and, for the record,
``AIP_PROJECT_NUMBER``, ``AIP_ENDPOINT_ID``, ``AIP_DEPLOYED_MODEL_ID``, ``AIP_MODEL_NAME``,
``AIP_VERSION_NAME``, ``AIP_MACHINE_TYPE``, ``AIP_ACCELERATOR_TYPE`` and ``AIP_FRAMEWORK``.

The prebuilt PyTorch images are TorchServe serving the ``model.mar`` right under the artifact
URI as the model ``model``, on ``AIP_HTTP_PORT`` of 0.0.0.0, with TorchServe's ``json``
service envelope (``{"instances": [...]}`` in, each instance a row of the handler's batch,
``{"b64": ...}`` values decoded; ``{"predictions": [...]}`` out; ``parameters`` are not passed
to the handler). For them Vertex routes predictions to ``/predictions/model`` and health
checks to ``/ping`` (what Google's samples give ``LocalModel`` for them), the defaults here
when a route is not set. Vertex's online predictions take bodies of at most 1.5 MB
(``VERTEX_MAX_REQUEST_SIZE``, unless ``max_request_size`` is set: a dedicated endpoint takes
up to 10 MB).

Vertex's mode is on when any of the five variables that define the contract is set; a
variable that is set but cannot be what Vertex sets is a ConfigError naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from frontend.errors import ConfigError

#: The variables whose presence turns Vertex's mode on (the contract's own).
CONTRACT_VARIABLES = ("AIP_HTTP_PORT", "AIP_HEALTH_ROUTE", "AIP_PREDICT_ROUTE",
                      "AIP_STORAGE_URI", "AIP_MODE")
#: What Vertex sets beside them, only logged.
RECORDED_VARIABLES = ("AIP_MODE_VERSION", "AIP_PROJECT_NUMBER", "AIP_ENDPOINT_ID",
                      "AIP_DEPLOYED_MODEL_ID", "AIP_MODEL_NAME", "AIP_VERSION_NAME",
                      "AIP_MACHINE_TYPE", "AIP_ACCELERATOR_TYPE", "AIP_FRAMEWORK")
#: The one mode Vertex sets for a prediction container.
PREDICTION_MODE = "PREDICTION"
DEFAULT_HTTP_PORT = 8080
#: The routes Vertex uses for the prebuilt PyTorch images (TorchServe's).
DEFAULT_HEALTH_ROUTE = "/ping"
DEFAULT_PREDICT_ROUTE = "/predictions/model"
#: The name the prebuilt image serves ``model.mar`` under (Google asks for
#: ``--model-name model``), and the archive it looks for.
MODEL_NAME = "model"
ARCHIVE = "model.mar"
#: Vertex AI's online prediction request limit, 1.5 MB (read as MiB, the larger: a body
#: Vertex lets through is never refused here).
VERTEX_MAX_REQUEST_SIZE = 1536 * 1024


@dataclass(frozen=True, slots=True)
class VertexEnv:
    """Vertex AI's variables, checked."""

    http_port: int
    health_route: str
    predict_route: str
    storage_uri: str
    #: The other ``AIP_*`` variables that were set (for the start log).
    recorded: Mapping[str, str]

    def overrides(self, model_store: str) -> dict[str, str]:
        """The config keys Vertex's mode sets, with ``model_store`` the local folder that
        holds ``model.mar`` (``frontend/models/storage.py`` fetched it)."""
        return {"inference_address": f"http://0.0.0.0:{self.http_port}",
                "service_envelope": "json", "model_store": model_store,
                "load_models": f"{MODEL_NAME}={ARCHIVE}",
                "vertex_health_route": self.health_route,
                "vertex_predict_route": self.predict_route}


def vertex_env(environ: Mapping[str, str]) -> VertexEnv | None:
    """Vertex's variables when any of ``CONTRACT_VARIABLES`` is set (non-empty); else None.
    Raises ConfigError naming a variable whose value Vertex would not set."""
    given = {name: environ[name].strip() for name in (*CONTRACT_VARIABLES, *RECORDED_VARIABLES)
             if environ.get(name, "").strip()}
    if not any(name in given for name in CONTRACT_VARIABLES):
        return None
    mode = given.get("AIP_MODE", PREDICTION_MODE)
    if mode != PREDICTION_MODE:
        raise ConfigError(f"AIP_MODE={mode!r}: Vertex AI's prediction containers run with "
                          f"AIP_MODE={PREDICTION_MODE}")
    storage_uri = given.get("AIP_STORAGE_URI", "")
    if not storage_uri:
        raise ConfigError("AIP_STORAGE_URI is not set: Vertex AI sets it to the folder it "
                          f"copied the model's artifactUri to, which must hold {ARCHIVE}")
    health = route(given, "AIP_HEALTH_ROUTE", DEFAULT_HEALTH_ROUTE)
    predict = route(given, "AIP_PREDICT_ROUTE", DEFAULT_PREDICT_ROUTE)
    if health == predict:
        raise ConfigError(f"AIP_HEALTH_ROUTE and AIP_PREDICT_ROUTE are both {health!r}: "
                          "Vertex AI sends health checks and predictions to two routes")
    return VertexEnv(http_port=http_port(given.get("AIP_HTTP_PORT", str(DEFAULT_HTTP_PORT))),
                     health_route=health, predict_route=predict, storage_uri=storage_uri,
                     recorded={name: value for name, value in given.items()
                               if name in RECORDED_VARIABLES})


def http_port(text: str) -> int:
    """``AIP_HTTP_PORT``: 1 to 65535 (0, any free port, for tests)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise ConfigError(f"AIP_HTTP_PORT={text!r}: expected a port number, 1 to 65535")
    return value


def route(given: Mapping[str, str], name: str, default: str) -> str:
    """A route variable: an absolute path, without a query."""
    value = given.get(name, default)
    try:
        return route_path(value)
    except ValueError as exc:
        raise ConfigError(f"{name}={value!r}: {exc}") from None


def route_path(text: str) -> str:
    """An HTTP path a route serves exactly ("" for none): it starts with ``/`` and has no
    query or fragment (the config keys ``vertex_health_route``/``vertex_predict_route``)."""
    if text and (not text.startswith("/") or "?" in text or "#" in text or " " in text):
        raise ValueError("expected an absolute path such as /predict, without a query")
    return text
