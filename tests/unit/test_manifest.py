"""Manifest <-> MAR-INF/MANIFEST.json, and reading it from each archive layout."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest

from model_archiver.errors import ManifestError, ModelArchiverError
from model_archiver.manifest import MANIFEST_PATH, Manifest, read_manifest

# What torch-model-archiver 0.12 writes, plus keys from older versions and the future.
TORCHSERVE_MANIFEST = {
    "createdOn": "22/11/2026 10:00:00",
    "runtime": "python",
    "model": {
        "modelName": "resnet-152",
        "serializedFile": "resnet152.pt",
        "handler": "image_classifier",
        "modelFile": "model.py",
        "modelVersion": "1.0",
        "requirementsFile": "requirements.txt",
        "configFile": "model-config.yaml",
        "someFutureKey": {"nested": True},
    },
    "archiverVersion": "0.12.0",
    "specificationVersion": "1.0",
    "modelServerVersion": "1.0",
}


def full_manifest() -> Manifest:
    return Manifest(
        model_name="resnet",
        model_version="2.0",
        handler="handler.py:handle",
        serialized_file="resnet.pt",
        model_file="model.py",
        extensions="ext",
        requirements_file="requirements.txt",
        config_file="model-config.yaml",
        created_on="22/11/2026 10:00:00",
        archiver_version="0.1.0",
    )


def test_round_trip_keeps_every_field() -> None:
    manifest = full_manifest()
    assert Manifest.from_json(manifest.to_json()) == manifest


def test_to_json_uses_torchserve_layout() -> None:
    data = json.loads(full_manifest().to_json())
    assert data == {
        "createdOn": "22/11/2026 10:00:00",
        "runtime": "python",
        "model": {
            "modelName": "resnet",
            "serializedFile": "resnet.pt",
            "handler": "handler.py:handle",
            "modelFile": "model.py",
            "modelVersion": "2.0",
            "extensions": "ext",
            "requirementsFile": "requirements.txt",
            "configFile": "model-config.yaml",
        },
        "archiverVersion": "0.1.0",
    }


def test_to_json_leaves_out_unset_keys() -> None:
    manifest = Manifest(model_name="m", handler="image_classifier")
    model = json.loads(manifest.to_json())["model"]
    assert model == {"modelName": "m", "handler": "image_classifier"}


def test_created_on_defaults_to_now_in_torchserve_format() -> None:
    created_on = Manifest(model_name="m", handler="h").created_on
    # "dd/mm/YYYY HH:MM:SS"
    assert len(created_on) == 19
    assert created_on[2] == created_on[5] == "/"
    assert created_on[10] == " "


def test_from_dict_accepts_torchserve_012_manifest_with_extra_keys() -> None:
    manifest = Manifest.from_dict(TORCHSERVE_MANIFEST)
    assert manifest == Manifest(
        model_name="resnet-152",
        model_version="1.0",
        handler="image_classifier",
        serialized_file="resnet152.pt",
        model_file="model.py",
        requirements_file="requirements.txt",
        config_file="model-config.yaml",
        runtime="python",
        created_on="22/11/2026 10:00:00",
        archiver_version="0.12.0",
    )


def test_from_dict_tolerates_missing_optional_keys() -> None:
    manifest = Manifest.from_dict({"model": {"modelName": "m", "handler": "h.py"}})
    assert manifest.model_version is None
    assert manifest.serialized_file is None
    assert manifest.runtime == "python"
    assert manifest.created_on == ""


def test_from_dict_turns_numeric_version_into_string() -> None:
    data = {"model": {"modelName": "m", "handler": "h", "modelVersion": 2.0}}
    assert Manifest.from_dict(data).model_version == "2.0"


@pytest.mark.parametrize("missing", ["modelName", "handler"])
def test_from_dict_requires_name_and_handler(missing: str) -> None:
    model = {"modelName": "m", "handler": "h"}
    del model[missing]
    with pytest.raises(ManifestError, match=f'no "{missing}"'):
        Manifest.from_dict({"model": model})


def test_from_dict_requires_model_section() -> None:
    with pytest.raises(ManifestError, match='no "model" section'):
        Manifest.from_dict({"runtime": "python"})


def test_manifest_error_is_a_model_archiver_error() -> None:
    assert issubclass(ManifestError, ModelArchiverError)


def test_from_dict_rejects_wrong_types() -> None:
    with pytest.raises(ManifestError, match='"serializedFile" must be a string'):
        Manifest.from_dict({"model": {"modelName": "m", "handler": "h", "serializedFile": []}})


def test_from_json_rejects_invalid_json() -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json("{not json")


def test_from_json_rejects_non_object() -> None:
    with pytest.raises(ManifestError, match="JSON object"):
        Manifest.from_json("[]")


# read_manifest: archives are made by hand here so these tests do not depend on packaging.


def manifest_text() -> str:
    return json.dumps(TORCHSERVE_MANIFEST)


def test_read_manifest_from_mar(tmp_path: Path) -> None:
    mar = tmp_path / "resnet-152.mar"
    with zipfile.ZipFile(mar, "w") as archive:
        archive.writestr("resnet152.pt", b"weights")
        archive.writestr(MANIFEST_PATH, manifest_text())
    assert read_manifest(mar).model_name == "resnet-152"


def test_read_manifest_from_tgz(tmp_path: Path) -> None:
    tgz = tmp_path / "resnet-152.tar.gz"
    with tarfile.open(tgz, "w:gz") as archive:
        for name, data in [
            ("resnet-152/resnet152.pt", b"weights"),
            (f"resnet-152/{MANIFEST_PATH}", manifest_text().encode()),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    assert read_manifest(tgz).serialized_file == "resnet152.pt"
    # Nothing was extracted next to the archive.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resnet-152.tar.gz"]


def test_read_manifest_from_tgz_with_other_suffix(tmp_path: Path) -> None:
    tgz = tmp_path / "m.tgz"
    data = manifest_text().encode()
    with tarfile.open(tgz, "w:gz") as archive:
        info = tarfile.TarInfo(f"./whatever/{MANIFEST_PATH}")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    assert read_manifest(tgz).handler == "image_classifier"


def test_read_manifest_from_directory(tmp_path: Path) -> None:
    (tmp_path / "MAR-INF").mkdir()
    (tmp_path / MANIFEST_PATH).write_text(manifest_text())
    assert read_manifest(tmp_path).config_file == "model-config.yaml"


def test_read_manifest_missing_manifest_in_each_format(tmp_path: Path) -> None:
    mar = tmp_path / "a.mar"
    with zipfile.ZipFile(mar, "w") as archive:
        archive.writestr("x.txt", "x")
    tgz = tmp_path / "a.tar.gz"
    with tarfile.open(tgz, "w:gz"):
        pass
    folder = tmp_path / "folder"
    folder.mkdir()
    for source in (mar, tgz, folder):
        with pytest.raises(ManifestError, match=r"MAR-INF/MANIFEST\.json"):
            read_manifest(source)


def test_read_manifest_reports_the_archive_on_bad_content(tmp_path: Path) -> None:
    mar = tmp_path / "bad.mar"
    with zipfile.ZipFile(mar, "w") as archive:
        archive.writestr(MANIFEST_PATH, json.dumps({"model": {"modelName": "m"}}))
    with pytest.raises(ManifestError, match=r"bad\.mar.*\"handler\""):
        read_manifest(mar)


def test_read_manifest_rejects_missing_and_unknown_files(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="not found"):
        read_manifest(tmp_path / "nope.mar")
    text_file = tmp_path / "model.mar"
    text_file.write_text("not a zip")
    with pytest.raises(ManifestError, match="not a model archive"):
        read_manifest(text_file)


def test_read_manifest_rejects_corrupt_tgz(tmp_path: Path) -> None:
    tgz = tmp_path / "broken.tar.gz"
    tgz.write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(ManifestError, match="cannot read"):
        read_manifest(tgz)
