"""Per-model Python dependencies end to end: an archive's requirements file installed for its
model alone (``install_py_dep_per_model``), in a venv of its own with ``useVenv``.

The requirement is a tiny package built here once (a wheel, no index needed) and shipped in
the archive; its requirements file names it by a path relative to the archive's root, which
pip resolves in the model directory, as TorchServe runs it. Nothing reaches the network.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from model_archiver.packaging import ArchiveOptions, build_archive
from tests.conftest import HANDLERS, RunningServer

PACKAGE = "bs_tinydep"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``bs_tinydep-0.1-py3-none-any.whl``: ``shout(b"hi") == "HI!"``."""
    source = tmp_path_factory.mktemp("tinydep")
    (source / PACKAGE).mkdir()
    (source / PACKAGE / "__init__.py").write_text(
        "def shout(value):\n"
        "    text = value.decode() if isinstance(value, bytes) else str(value)\n"
        "    return text.upper() + '!'\n")
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "bs-tinydep"\nversion = "0.1"\n')
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "--disable-pip-version-check", "-q", "-w", str(out),
                    str(source)], check=True)
    (built,) = out.glob("*.whl")
    return built


def _archive(model_store: Path, work: Path, name: str, handler: str, *,
             requirements: str | None = None, wheel: Path | None = None,
             model_config: str | None = None) -> Path:
    work.mkdir(exist_ok=True)
    requirements_file = config_file = None
    if requirements is not None:
        requirements_file = work / f"{name}-requirements.txt"
        requirements_file.write_text(requirements)
    if model_config is not None:
        config_file = work / f"{name}-config.yaml"
        config_file.write_text(model_config)
    return build_archive(ArchiveOptions(
        model_name=name, handler=str(HANDLERS / f"{handler}.py"),
        extra_files=(str(wheel),) if wheel else (), export_path=model_store, force=True,
        requirements_file=str(requirements_file) if requirements_file else None,
        config_file=str(config_file) if config_file else None))


def _register(server: RunningServer, url: str, **params: object) -> requests.Response:
    return requests.post(f"{server.management}/models",
                         params={"url": url, "synchronous": "true", "initial_workers": 1,
                                 **params}, timeout=300)


def _install_runs(log: Path, name: str) -> int:
    """How many times pip ran for ``name`` (each run logs its command line first)."""
    lines = log.read_text().splitlines() if log.exists() else []
    return sum(1 for line in lines
               if f" install-{name}_1.0 MODEL_LOG - " in line and " -m pip install " in line)


def _answer(server: RunningServer, name: str) -> dict[str, str]:
    response = server.predict(name, b"hi")
    assert response.status_code == 200, response.text
    return json.loads(response.text)  # type: ignore[no-any-return]


def test_requirements_are_installed_once_for_their_model_alone(
        wheel: Path, model_store: Path, tmp_path: Path, start_server) -> None:
    _archive(model_store, tmp_path / "src", "dep", "uses_dep", wheel=wheel,
             requirements=f"./{wheel.name}\n")
    _archive(model_store, tmp_path / "src", "other", "probe_dep")
    run_dir = tmp_path / "run"
    log = model_store.parent / "logs" / "model_log.log"
    server = start_server(install_py_dep_per_model=True, run_dir=run_dir)

    assert _register(server, "dep.mar").status_code == 200
    answer = _answer(server, "dep")
    assert answer["answer"] == "HI!"
    # Installed under the run directory, for this version, and run by the server's python.
    installed = Path(answer["package"])
    assert (run_dir / "envs") in installed.parents
    assert answer["prefix"] == sys.prefix
    assert server.describe("dep")["useVenv"] is False
    assert _install_runs(log, "dep") == 1
    assert "Successfully installed bs-tinydep-0.1" in log.read_text()

    # A second worker uses the same install (its handler imports the package as it loads,
    # so the scale-up succeeds only if it can): pip does not run again.
    scaled = requests.put(f"{server.management}/models/dep",
                          params={"min_worker": 2, "synchronous": "true"}, timeout=120)
    assert scaled.status_code == 200, scaled.text
    assert [w["status"] for w in server.describe("dep")["workers"]] == ["READY", "READY"]  # type: ignore[union-attr]
    assert _install_runs(log, "dep") == 1
    # Its packages must come before the server's: its workers start fresh, not forked from
    # the fork server, which has imported the server's (docs/workers.md).
    assert [w["startMode"] for w in server.describe("dep")["workers"]] == ["fresh"] * 2  # type: ignore[union-attr]

    # Another model in the same server does not see the first one's packages.
    assert _register(server, "other.mar").status_code == 200
    assert server.predict("other", b"x").text == "missing"
    assert server.describe("other")["workers"][0]["startMode"] == "forked"  # type: ignore[index]

    # Unregistering the version deletes what was installed for it.
    assert requests.delete(f"{server.management}/models/dep", timeout=60).status_code == 200
    assert not installed.exists()
    assert list((run_dir / "envs").iterdir()) == []


def test_without_install_py_dep_per_model_the_handler_fails_to_load(
        wheel: Path, model_store: Path, tmp_path: Path, start_server) -> None:
    _archive(model_store, tmp_path / "src", "dep", "uses_dep", wheel=wheel,
             requirements=f"./{wheel.name}\n")
    server = start_server()  # install_py_dep_per_model defaults to false
    refused = _register(server, "dep.mar")
    assert refused.status_code == 500
    message = refused.json()["message"]
    assert f"No module named '{PACKAGE}'" in message
    assert "requirements file dep-requirements.txt was not installed: " \
           "install_py_dep_per_model is false" in message
    assert requests.get(f"{server.management}/models/dep", timeout=10).status_code == 404
    assert _install_runs(model_store.parent / "logs" / "model_log.log", "dep") == 0


def test_a_broken_requirement_is_a_clear_registration_error(
        model_store: Path, tmp_path: Path, start_server) -> None:
    _archive(model_store, tmp_path / "src", "broken", "uses_dep",
             requirements="./bs_missing-0.1-py3-none-any.whl\n")
    run_dir = tmp_path / "run"
    server = start_server(install_py_dep_per_model=True, run_dir=run_dir)
    refused = _register(server, "broken.mar")
    assert refused.status_code == 400
    body = refused.json()
    assert body["type"] == "ModelException"
    assert body["message"].startswith(
        "Custom pip package installation failed for model broken version 1.0: ")
    assert "bs_missing-0.1-py3-none-any.whl" in body["message"]  # pip's own words
    assert requests.get(f"{server.management}/models", timeout=10).json()["models"] == []
    assert list((run_dir / "envs").iterdir()) == []
    assert list((run_dir / "models").iterdir()) == []
    assert _install_runs(model_store.parent / "logs" / "model_log.log", "broken") == 1


def test_an_install_that_overruns_its_timeout_is_stopped(
        wheel: Path, model_store: Path, tmp_path: Path, start_server) -> None:
    _archive(model_store, tmp_path / "src", "dep", "uses_dep", wheel=wheel,
             requirements=f"./{wheel.name}\n")
    run_dir = tmp_path / "run"
    # No pip finishes in a millisecond (starting its interpreter takes longer).
    server = start_server(install_py_dep_per_model=True, install_py_dep_timeout_s=0.001,
                          run_dir=run_dir)
    refused = _register(server, "dep.mar")
    assert refused.status_code == 400
    assert "did not finish within 0.001 s (install_py_dep_timeout)" in refused.json()["message"]
    assert requests.get(f"{server.management}/models", timeout=10).json()["models"] == []
    assert list((run_dir / "envs").iterdir()) == []


def test_use_venv_runs_the_model_in_a_venv_of_its_own(
        wheel: Path, model_store: Path, tmp_path: Path, start_server) -> None:
    _archive(model_store, tmp_path / "src", "venvdep", "uses_dep", wheel=wheel,
             requirements=f"./{wheel.name}\n", model_config="useVenv: true\n")
    run_dir = tmp_path / "run"
    server = start_server(install_py_dep_per_model=True, run_dir=run_dir)
    assert _register(server, "venvdep.mar").status_code == 200, "registration failed"
    answer = _answer(server, "venvdep")
    assert answer["answer"] == "HI!"
    # The worker's interpreter is the venv's, and the package is in the venv's site-packages;
    # the server's packages (the worker's own imports: protobuf, ...) are visible in it.
    venv = Path(answer["prefix"])
    assert (run_dir / "envs") in venv.parents and venv.name == "venv"
    assert venv in Path(answer["package"]).parents
    assert server.describe("venvdep")["useVenv"] is True
    assert server.describe("venvdep")["workers"][0]["startMode"] == "fresh"  # type: ignore[index]


def test_a_bad_use_venv_value_is_refused_like_the_other_model_config_keys(
        model_store: Path, tmp_path: Path, start_server) -> None:
    _archive(model_store, tmp_path / "src", "badvenv", "probe_dep", model_config="useVenv: 2\n")
    server = start_server(install_py_dep_per_model=True)
    refused = _register(server, "badvenv.mar")
    assert refused.status_code == 400
    assert refused.json()["message"] == "model-config.yaml: useVenv must be true or false, got 2"
