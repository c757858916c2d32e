"""A model version's own Python packages: TorchServe's ``install_py_dep_per_model`` and
model-config.yaml's ``useVenv``.

An archive built with ``--requirements-file`` carries a pip requirements file. With
``install_py_dep_per_model=true`` it is installed when the version is registered, once (its
workers, however many and however often restarted, share the install), into a folder of
that version alone under ``{run_dir}/envs``, deleted when the version is unregistered:

* by default with ``pip install --target``; the version's workers put that folder on
  ``sys.path``, ahead of the server's packages, before importing the handler (the LOAD
  message's ``dependency_dirs``), so no other model sees its packages;
* with ``useVenv: true``, into a venv of the model's own whose python runs its workers. The
  server's packages stay visible in it (a ``.pth`` file adds the server's site directories
  after the venv's own), as TorchServe's setup_model_venv.py does. ``useVenv`` without
  ``install_py_dep_per_model`` runs the model in that venv with nothing installed, as
  TorchServe does.

pip runs as TorchServe runs it: in the model directory (a relative path in the requirements
names a file of the archive), with the server's environment (so its index settings,
``PIP_INDEX_URL`` or pip.conf, apply). It runs as a subprocess the event loop waits on,
bounded by ``install_py_dep_timeout``, and its output goes to the model log. Installing runs
code the archive names (build scripts, packages): that is why it is off by default.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import shutil
import signal
import site
import sys
import sysconfig
import uuid
from dataclasses import dataclass
from pathlib import Path

from frontend.errors import DependencyInstallError, quoted
from frontend.observe.logs import log_output, output_lines
from frontend.processes import python_module
from model_archiver.paths import UnsafePath, contained

logger = logging.getLogger(__name__)

#: The installer's last lines kept; its ERROR lines among them (else the last three) are
#: quoted in the error when it fails.
TAIL_LINES = 20
PTH_FILE = "batchserve-server-site-packages.pth"


@dataclass(frozen=True, slots=True)
class ModelEnvironment:
    """Where one model version's workers find its own packages."""

    #: The interpreter the workers run: the model's venv's with ``useVenv``.
    python: str = sys.executable
    #: Folders the workers put on sys.path (``pip install --target``).
    dependency_dirs: tuple[str, ...] = ()
    #: Ours to delete with the model version; None: nothing was made for it.
    folder: Path | None = None

    def remove(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


#: A model version with nothing of its own: the server's interpreter and packages.
NO_ENVIRONMENT = ModelEnvironment()


def requirements_path(model_dir: Path, requirements_file: str) -> Path:
    """The archive's requirements file: inside the model directory, or DependencyInstallError."""
    try:
        path = contained(requirements_file, model_dir)  # its links too: pip reads it
    except UnsafePath:
        path = None
    if path is None or not path.is_file():
        raise DependencyInstallError(
            f"the archive names requirements file {quoted(requirements_file)} but has none")
    return path


def server_site_dirs() -> list[str]:
    """The server's site directories, which a model's venv sees after its own."""
    dirs = [entry for entry in site.getsitepackages() if os.path.isdir(entry)]
    user_site = site.getusersitepackages()
    if site.ENABLE_USER_SITE and os.path.isdir(user_site):
        dirs.insert(0, user_site)
    return dirs


def venv_site_packages(venv: Path) -> Path:
    scheme = "venv" if "venv" in sysconfig.get_scheme_names() else "posix_prefix"
    return Path(sysconfig.get_path("purelib", scheme,
                                   vars={"base": str(venv), "platbase": str(venv)}))


class DependencyInstaller:
    """Makes each registered model version's environment (see the module docstring)."""

    def __init__(self, root: Path, install_requirements: bool, timeout_s: float,
                 model_log: logging.Logger) -> None:
        self.root = root
        self.install_requirements = install_requirements
        self.timeout_s = timeout_s
        self._model_log = model_log

    async def prepare(self, name: str, version: str, model_dir: Path,
                      requirements_file: str | None, use_venv: bool) -> ModelEnvironment:
        """Create the version's venv (``use_venv``) and install its requirements (when
        ``install_py_dep_per_model`` is on and the archive has some). Raises
        DependencyInstallError, leaving nothing behind, when either fails."""
        install = self.install_requirements and bool(requirements_file)
        if requirements_file and not install:
            logger.warning("model %s version %s: its requirements file %s is not installed "
                           "(install_py_dep_per_model=false)", name, version, requirements_file)
        if not install and not use_venv:
            return NO_ENVIRONMENT
        requirements = (requirements_path(model_dir, requirements_file)
                        if install and requirements_file else None)
        self.root.mkdir(mode=0o700, exist_ok=True)
        safe_version = re.sub(r"[^A-Za-z0-9_.-]", "_", version)
        folder = self.root / f"{name}-{safe_version}-{uuid.uuid4().hex[:8]}"
        folder.mkdir(mode=0o700)
        run = _Runner(f"install-{name}_{version}", f"model {name} version {version}",
                      model_dir, self.timeout_s, self._model_log)
        try:
            environment = ModelEnvironment(folder=folder)
            if use_venv:
                environment = await self._create_venv(folder, run)
            if requirements is not None:
                environment = await self._install(environment, requirements, use_venv, run)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return environment

    @staticmethod
    async def _create_venv(folder: Path, run: _Runner) -> ModelEnvironment:
        venv = folder / "venv"
        # No pip of its own (ensurepip costs seconds): the server's is visible in it.
        await run([*python_module(sys.executable, "venv"), "--without-pip", str(venv)],
                  "Virtual environment creation failed")
        lines = "".join(f"import site; site.addsitedir({entry!r})\n"
                        for entry in server_site_dirs())
        (venv_site_packages(venv) / PTH_FILE).write_text(lines, encoding="utf-8")
        logger.info("%s: created a virtual environment in %s", run.who, venv)
        return ModelEnvironment(python=str(venv / "bin" / "python"), folder=folder)

    @staticmethod
    async def _install(environment: ModelEnvironment, requirements: Path, use_venv: bool,
                       run: _Runner) -> ModelEnvironment:
        pip = [*python_module(environment.python, "pip"), "install", "--disable-pip-version-check",
               "--no-input", "--progress-bar", "off"]
        if use_venv:  # TorchServe's options: the server's packages count as installed
            await run([*pip, "-U", "--upgrade-strategy", "only-if-needed",
                       "-r", str(requirements)], "Custom pip package installation failed")
        else:
            assert environment.folder is not None
            target = environment.folder / "site-packages"
            await run([*pip, "--target", str(target), "-r", str(requirements)],
                      "Custom pip package installation failed")
            environment = ModelEnvironment(dependency_dirs=(str(target),),
                                           folder=environment.folder)
        logger.info("%s: installed the packages of %s", run.who, requirements.name)
        return environment


@dataclass(frozen=True, slots=True)
class _Runner:
    """Runs the installer's commands for one model version."""

    #: Names the installer's lines in the model log (their thread: ``install-m_1.0``).
    label: str
    #: Names the model version in messages.
    who: str
    cwd: Path
    timeout_s: float
    model_log: logging.Logger

    async def __call__(self, command: list[str], failure: str) -> None:
        """Run ``command``, its output into the model log; raise DependencyInstallError
        (``failure`` and the output's last lines) unless it succeeds in time."""
        log_output(self.model_log, self.label, " ".join(command))
        process = await asyncio.create_subprocess_exec(
            *command, cwd=self.cwd, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            # Its own process group: a timeout ends whatever it started too (build backends).
            start_new_session=True)
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        try:
            await asyncio.wait_for(self._forward(process, tail), self.timeout_s)
        except TimeoutError:
            raise DependencyInstallError(
                f"{failure} for {self.who}: it did not finish within {self.timeout_s:g} s "
                "(install_py_dep_timeout)") from None
        finally:
            if process.returncode is None:  # timed out or cancelled
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        if process.returncode != 0:
            said = failure_text(list(tail))
            logger.error("%s: %s (exit code %s): %s", self.who, failure, process.returncode,
                         said)
            raise DependencyInstallError(f"{failure} for {self.who}: {said}")

    async def _forward(self, process: asyncio.subprocess.Process,
                       tail: collections.deque[str]) -> None:
        assert process.stdout is not None
        async for text in output_lines(process.stdout):
            if text:
                tail.append(text)
                log_output(self.model_log, self.label, text)
        await process.wait()


def failure_text(lines: list[str]) -> str:
    """What to quote of a failed installer's last lines: pip's ERROR lines, else the last."""
    shown = [line for line in lines if line.startswith("ERROR")] or lines[-3:]
    return " | ".join(shown) or "no output"
