"""frontend/models/dependencies.py without running pip (tests/integration/
test_model_dependencies.py installs real packages): what is installed, from where, and what
an installer's failure says."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from frontend.errors import DependencyInstallError
from frontend.models.dependencies import (
    NO_ENVIRONMENT,
    DependencyInstaller,
    failure_text,
    requirements_path,
)


def test_the_requirements_file_must_be_in_the_archive(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "requirements.txt").write_text("numpy\n")
    (tmp_path / "outside.txt").write_text("numpy\n")
    assert requirements_path(model_dir, "requirements.txt") == \
        (model_dir / "requirements.txt").resolve()
    for named in ("missing.txt", "../outside.txt", str(tmp_path / "outside.txt")):
        with pytest.raises(DependencyInstallError, match="names requirements file"):
            requirements_path(model_dir, named)


def test_nothing_is_made_unless_installing_or_a_venv_is_asked_for(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    installer = DependencyInstaller(tmp_path / "envs", install_requirements=False,
                                    timeout_s=60, model_log=logging.getLogger("test"))
    environment = asyncio.run(installer.prepare("m", "1.0", tmp_path, "requirements.txt",
                                                use_venv=False))
    assert environment is NO_ENVIRONMENT
    assert not (tmp_path / "envs").exists()
    assert "requirements file requirements.txt is not installed " \
           "(install_py_dep_per_model=false)" in caplog.text


def test_a_failure_quotes_the_installer_errors_else_its_last_lines() -> None:
    output = ["Looking in links: /wheels", "Processing ./x.whl",
              "ERROR: Could not install packages", "ERROR: no such file", "done"]
    assert failure_text(output) == "ERROR: Could not install packages | ERROR: no such file"
    assert failure_text(["a", "b", "c", "d"]) == "b | c | d"
    assert failure_text([]) == "no output"
