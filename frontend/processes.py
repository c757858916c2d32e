"""Starting Python child processes by module name, never from the working directory.

``python -m NAME`` puts the working directory first on ``sys.path``, so a folder there named
like the module is imported instead: from the root of a pytorch/serve checkout (where
TorchServe's READMEs run every command) ``python -m frontend`` imported its ``frontend/``,
and an archive holding a ``pip/`` folder would have been run by ``python -m pip`` in it.
``python_module`` leaves the working directory out: Python 3.11's ``-P``, or on 3.10 a
bootstrap that removes it before running the module.
"""

from __future__ import annotations

import os
import re
import sys

#: Python 3.10 (no -P): ``-c`` puts "" (the working directory) first on sys.path; drop it,
#: then run the module named by the next argument as ``-m`` would.
BOOTSTRAP = ("import runpy, sys; del sys.path[0]; "
             "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def python_module(python: str, module: str, *, safe_path_flag: bool | None = None
                  ) -> list[str]:
    """The command that runs ``python -m module`` with the working directory off
    ``sys.path`` (arguments follow it). ``python`` is this interpreter or a venv made from it,
    so this interpreter's version says whether it has ``-P``."""
    if safe_path_flag is None:
        safe_path_flag = sys.version_info >= (3, 11)
    if safe_path_flag:
        return [python, "-P", "-m", module]
    return [python, "-c", BOOTSTRAP, module]


def worker_environment(blocklist: str) -> dict[str, str]:
    """The environment a worker (or the fork server) starts with: the server's, less the
    variables whose names ``blocklist`` (``blacklist_env_vars``) matches in full."""
    env = dict(os.environ)
    if blocklist:
        blocked = re.compile(blocklist)
        env = {name: value for name, value in env.items() if not blocked.fullmatch(name)}
    env["PYTHONUNBUFFERED"] = "1"
    return env
