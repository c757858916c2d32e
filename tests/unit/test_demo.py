"""``make demo``: what it installs (the server alone, not the development tools ``make test``
adds), how the two set-ups follow each other, and the README's sample answer (its shape and
labels here; tests/e2e/test_resnet152.py compares it with what the demo serves)."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "image_classifier" / "resnet_152_batch"
#: What only development needs (setup.py's [dev] extra), by distribution name.
DEV_TOOLS = ("pytest", "mypy", "ruff", "hypothesis", "requests", "tritonclient", "types-",
             "grpcio-tools", "openapi-spec-validator", "helm-python-sdk", "kubernetes-validate",
             "promql-parser")

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def _dry_run(target: str, venv: Path) -> list[str]:
    """The commands ``make -n TARGET VENV=venv`` would run."""
    done = subprocess.run(["make", "-n", "-s", target, f"VENV={venv}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.splitlines()


def _installs(commands: list[str]) -> list[str]:
    return [line for line in commands if " -m pip install" in line]


def _stamp(venv: Path, *names: str) -> None:
    """``venv`` as a set-up left it: its stamps newer than setup.py and pyproject.toml."""
    venv.mkdir(exist_ok=True)
    newest = max((ROOT / name).stat().st_mtime for name in ("setup.py", "pyproject.toml"))
    for name in names:
        (venv / name).touch()
        os.utime(venv / name, (newest + 10, newest + 10))


@needs_make
def test_make_demo_installs_the_server_without_the_development_tools(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    demo = _installs(_dry_run("demo", venv))
    assert len(demo) == 1, demo
    assert demo[0].endswith(" -e ."), demo[0]
    assert "[dev]" not in demo[0]
    test = _installs(_dry_run("test", venv))
    assert len(test) == 1 and test[0].endswith(' -e ".[dev]"'), test


@needs_make
def test_demo_after_test_installs_nothing_and_test_after_demo_adds_the_tools(
        tmp_path: Path) -> None:
    after_test = tmp_path / "after_test"
    _stamp(after_test, ".install-stamp", ".install-stamp-serve")
    assert _installs(_dry_run("demo", after_test)) == []
    assert _installs(_dry_run("lint", after_test)) == []

    after_demo = tmp_path / "after_demo"
    _stamp(after_demo, ".install-stamp-serve")
    assert _installs(_dry_run("demo", after_demo)) == []
    [install] = _installs(_dry_run("test", after_demo))
    assert install.endswith(' -e ".[dev]"')
    # The development install stamps the serving one too (what makes the first case hold).
    assert any(line.startswith("touch ") and line.endswith(".install-stamp-serve")
               and ".install-stamp " in line for line in _dry_run("test", after_demo))


def test_serving_needs_none_of_the_development_tools() -> None:
    """setup.py's install_requires (what ``pip install -e .`` brings) names no tool that only
    the tests and checks use; they are in the [dev] extra."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    values = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
              for target in node.targets if isinstance(target, ast.Name)}
    required = ast.literal_eval(values["INSTALL_REQUIRES"])
    names = [re.split(r"[<>=!~;\[ ]", requirement)[0].lower() for requirement in required]
    assert "torch" in names
    assert not [name for name in names if name.startswith(DEV_TOOLS)], names


# ---- the README's sample answer ---------------------------------------------------------------


#: The READMEs that show the kitten's answer: the project's and the example's.
READMES = (ROOT / "README.md", EXAMPLE / "README.md")


def readme_sample() -> tuple[str, dict[str, float]]:
    """The README's demo request (its curl line) and the answer it shows."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"```bash\n(curl [^\n]*/predictions/resnet-152-batch_v2[^\n]*)\n```"
                      r".*?```json\n(.*?)```", text, re.S)
    assert match, "the README's demo request and its answer"
    return match.group(1), json.loads(match.group(2))


def kitten_answers() -> dict[Path, dict[str, float]]:
    """The kitten's answer as each of ``READMES`` shows it (its first JSON block)."""
    answers = {}
    for readme in READMES:
        match = re.search(r"```json\n(.*?)```", readme.read_text(), re.S)
        assert match, readme
        answers[readme] = json.loads(match.group(1))
    return answers


def test_the_readme_sample_is_a_top5_answer_of_the_demo_model() -> None:
    curl, answer = readme_sample()
    image = curl.split(" -T ")[1].strip()
    assert image.endswith("/kitten.jpg") and (ROOT / image).is_file(), image
    assert curl.startswith("curl http://127.0.0.1:8080/")  # make demo's default port
    labels = {name for _, name in json.loads((EXAMPLE / "index_to_name.json").read_text()
                                             ).values()}
    assert len(answer) == 5 and set(answer) <= labels
    values = list(answer.values())
    assert values == sorted(values, reverse=True)
    assert 0 < sum(values) <= 1
    # The example's README shows the same answer to the same picture.
    for readme, shown in kitten_answers().items():
        assert list(shown.items()) == list(answer.items()), readme


@needs_make
def test_the_readme_request_is_what_make_demo_says_to_send(tmp_path: Path) -> None:
    curl, _ = readme_sample()
    told = [line.strip() for line in _dry_run("demo", tmp_path / "venv")
            if line.strip().startswith("echo \"  curl ")]
    assert told == [f'echo "  {curl}"']
