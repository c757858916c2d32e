"""Hostile paths against the real server: the cases of tests/hostile_paths.py (the same the
unit suite, tests/unit/test_containment.py, runs against every caller of
``model_archiver.paths.contained``) as .mar, .tar.gz and .war archives in the model store,
as folder models whose manifest names them (its config file, its handler), and as the
register ``handler`` parameter. Each is refused 400 with the error type of its API, nothing
is written outside the run directory and nothing is left in it; look-alike names register;
the server goes on serving.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import uuid
import zipfile
from pathlib import Path

import requests

from tests.conftest import RunningServer
from tests.hostile_paths import (
    BY_ID,
    EVIL,
    IN_TAR,
    IN_ZIP,
    LINKS,
    LOOKALIKES,
    SECRET,
    TEXT,
    add_to_tar,
    add_to_zip,
    plant,
)

WAR_MEMBERS = {
    "WAR-INF/MANIFEST.json": json.dumps(
        {"createdOn": "01/01/2025 00:00:00", "archiverVersion": "0.2.15",
         "workflow": {"workflowName": "wf", "specFile": "wf.yaml", "handler": "h.py"}}),
    "wf.yaml": "models:\n  m1:\n    url: m1.mar\ndag:\n  pre: [m1]\n",
    "h.py": "def pre(data, context):\n    return data\n",
}


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path below ``root`` but the logs, and each file's bytes."""
    found: dict[str, bytes | None] = {}
    for directory, dirs, files in os.walk(root):
        dirs[:] = [name for name in dirs if name != "logs"]
        for name in dirs + files:
            path = Path(directory) / name
            found[str(path)] = path.read_bytes() if path.is_file() and not path.is_symlink() \
                else None
    return found


def _refused(response: requests.Response, type_name: str) -> str:
    assert response.status_code == 400, (response.status_code, response.text)
    body = response.json()
    assert body["code"] == 400 and body["type"] == type_name, body
    return str(body["message"])


def _hostile_store(good: Path, store: Path, outside: Path) -> dict[str, list[str]]:
    """Write the hostile archives and folders into ``store``: url -> what registers it."""
    urls: dict[str, list[str]] = {"models": [], "workflows": []}
    for case_id in sorted(IN_ZIP - LOOKALIKES):
        mar, war = store / f"zip-{case_id}.mar", store / f"zip-{case_id}.war"
        mar.write_bytes(good.read_bytes())
        with zipfile.ZipFile(mar, "a") as archive:
            add_to_zip(archive, BY_ID[case_id], outside, store)
        with zipfile.ZipFile(war, "w") as archive:
            for name, text in WAR_MEMBERS.items():
                archive.writestr(name, text)
            add_to_zip(archive, BY_ID[case_id], outside, store)
        urls["models"].append(mar.name)
        urls["workflows"].append(war.name)
    for case_id in sorted(IN_TAR - LOOKALIKES):
        tgz = store / f"tar-{case_id}.tar.gz"
        with zipfile.ZipFile(good) as source, tarfile.open(tgz, "w:gz") as archive:
            for name in source.namelist():
                data = source.read(name)
                info = tarfile.TarInfo(name)
                info.size = len(data)
                archive.addfile(info, fileobj=io.BytesIO(data))
            add_to_tar(archive, BY_ID[case_id], outside, store)
        urls["models"].append(tgz.name)
    for case_id in sorted((TEXT | LINKS) - {"hardlink"}):
        folder = store / f"config-{case_id}"
        (folder / "MAR-INF").mkdir(parents=True)
        case = BY_ID[case_id]
        if case.link is not None:
            plant(folder, case, outside)
        (folder / "MAR-INF" / "MANIFEST.json").write_text(json.dumps(
            {"createdOn": "01/01/2025 00:00:00", "runtime": "python", "archiverVersion": "0.12.0",
             "model": {"modelName": "cfg", "handler": "echo.py", "configFile": case.name}}))
        urls["models"].append(folder.name)
    return urls


def _assert_serving(server: RunningServer) -> None:
    ping = requests.get(f"{server.inference}/ping", timeout=10)
    assert ping.status_code == 200
    payload = f"still-serving-{uuid.uuid4()}".encode()
    answer = server.predict("echo", payload)
    assert answer.status_code == 200 and answer.content == payload


def test_hostile_archives_folders_and_handlers_are_400_and_write_nothing_outside(
        build_mar, start_server, model_store: Path, tmp_path: Path) -> None:
    good = build_mar("echo", "echo")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(SECRET)
    urls = _hostile_store(good, model_store, outside)
    server = start_server("echo.mar")
    run_dir = server.server.services.loader.run_dir  # type: ignore[union-attr]
    before, run_before = _tree(tmp_path), _tree(run_dir)
    management = server.management
    for url in urls["models"]:
        answer = requests.post(f"{management}/models", params={
            "url": url, "model_name": "evil", "initial_workers": 0}, timeout=30)
        message = _refused(answer, "ModelArchiveException")
        assert any(word in message for word in ("unsafe path", "link", "only files")), message
    for url in urls["workflows"]:
        _refused(requests.post(f"{management}/workflows", params={"url": url}, timeout=30),
                 "InvalidWorkflowException")
    # The handler parameter names a file in the model, as the manifest's handler does.
    for case_id in sorted(TEXT - {"drive"}):
        answer = requests.post(f"{management}/models", params={
            "url": "echo.mar", "model_name": "h", "initial_workers": 0,
            "handler": f"{BY_ID[case_id].name}:handle"}, timeout=30)
        assert "the handler parameter" in _refused(answer, "ModelArchiveException")

    assert _tree(tmp_path) == before, "something was written outside the run directory"
    # The workflows' folder of the run directory is made at the first registration.
    run_before.setdefault(str(run_dir / "workflows"), None)
    assert _tree(run_dir) == run_before, "a refused registration left files behind"
    for folder in (run_dir, run_dir.parent, model_store, tmp_path, Path("/tmp"), Path("/")):
        assert not os.path.lexists(folder / EVIL), folder
    listed = requests.get(f"{management}/models", timeout=10).json()
    assert [model["modelName"] for model in listed["models"]] == ["echo"]
    _assert_serving(server)


def test_lookalike_names_are_ordinary_names(build_mar, start_server, model_store: Path
                                            ) -> None:
    """U+2025 and U+FF0E are not '.', U+2215 is not '/': an archive member or a handler so
    named registers, and its file is unpacked where its name says, inside."""
    good = build_mar("echo", "echo")
    server = start_server("echo.mar")
    run_dir = server.server.services.loader.run_dir  # type: ignore[union-attr]
    for case_id in sorted(LOOKALIKES):
        case = BY_ID[case_id]
        mar = model_store / f"{case_id}.mar"
        mar.write_bytes(good.read_bytes())
        with zipfile.ZipFile(mar, "a") as archive:
            archive.writestr(case.name, b"payload")
        for params in ({"url": mar.name}, {"url": "echo.mar", "handler": f"{case.name}:h"}):
            name = f"look-{uuid.uuid4().hex[:6]}"
            answer = requests.post(f"{server.management}/models", params={
                **params, "model_name": name, "initial_workers": 0}, timeout=30)
            assert answer.status_code == 200, answer.text
            if "handler" not in params:
                unpacked = list((run_dir / "models").glob(f"**/{case.name}"))
                assert len(unpacked) == 1 and unpacked[0].read_bytes() == b"payload"
                assert run_dir.resolve() in unpacked[0].resolve().parents
            deleted = requests.delete(f"{server.management}/models/{name}", timeout=30)
            assert deleted.status_code == 200, deleted.text
    _assert_serving(server)
