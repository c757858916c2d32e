"""model_archiver.files: what both archivers share (collecting an archive's files, reading a
manifest back within a bound), checked once here with both archivers' error classes."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

from model_archiver.errors import ManifestError, ModelArchiverError
from model_archiver.files import (
    ArchiveEntries,
    existing_file,
    read_folder_member,
    read_zip_member,
    write_zip,
)
from model_archiver.manifest import MANIFEST_PATH, read_manifest
from workflow_archiver.errors import WorkflowArchiverError

ERRORS = [ModelArchiverError, WorkflowArchiverError]


@pytest.mark.parametrize("error", ERRORS)
def test_the_caller_s_error_class_is_raised(tmp_path: Path, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"--spec-file: .* does not exist"):
        existing_file(str(tmp_path / "nope.yaml"), "--spec-file", error)
    with pytest.raises(error, match="is not a file"):
        existing_file(str(tmp_path), "--spec-file", error)
    entries = ArchiveEntries("WAR-INF", error)
    with pytest.raises(error, match="WAR-INF/ is reserved"):
        entries.add("WAR-INF/MANIFEST.json", tmp_path)
    with pytest.raises(error, match="outside the archive"):
        entries.add("../up.txt", tmp_path)


@pytest.mark.parametrize("links_may_leave", [True, False])
def test_a_walk_follows_links_as_told_and_refuses_broken_ones(
        tmp_path: Path, links_may_leave: bool) -> None:
    outside = tmp_path / "blobs" / "weights.bin"
    outside.parent.mkdir()
    outside.write_bytes(b"w")
    extra = tmp_path / "extra"
    (extra / "sub").mkdir(parents=True)
    (extra / "sub" / "a.txt").write_text("a")
    (extra / "weights.bin").symlink_to(outside)  # as a Hugging Face snapshot links its blobs
    (extra / "loop").symlink_to(extra, target_is_directory=True)  # walked once
    os.mkfifo(extra / "pipe")  # nothing to ship (reading it would block)
    entries = ArchiveEntries("MAR-INF", ModelArchiverError)
    if links_may_leave:
        entries.add_extra_files([str(extra)], links_may_leave=True)
        assert [name for name, _ in entries.sorted()] == ["sub/a.txt", "weights.bin"]
    else:
        with pytest.raises(ModelArchiverError, match="outside"):
            entries.add_extra_files([str(extra)], links_may_leave=False)

    (extra / "weights.bin").unlink()
    (extra / "dangling.bin").symlink_to(extra / "gone.bin")
    with pytest.raises(ModelArchiverError, match=r"dangling\.bin is a broken link"):
        ArchiveEntries("MAR-INF", ModelArchiverError).add_extra_files(
            [str(extra)], links_may_leave=links_may_leave)


def test_a_zip_is_written_whole_with_the_manifest_first(tmp_path: Path) -> None:
    source = tmp_path / "b.txt"
    source.write_text("b")
    target = tmp_path / "out.mar"
    write_zip(target, [("b.txt", source)], MANIFEST_PATH, "{}", zipfile.ZIP_STORED)
    with zipfile.ZipFile(target) as archive:
        assert archive.namelist() == [MANIFEST_PATH, "b.txt"]
        assert archive.getinfo("b.txt").compress_type == zipfile.ZIP_STORED
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.txt", "out.mar"]


def test_a_member_is_read_no_further_than_its_bound(tmp_path: Path) -> None:
    # A few kilobytes that inflate to far more than a manifest: refused, not read whole.
    mar = tmp_path / "bomb.mar"
    with zipfile.ZipFile(mar, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(MANIFEST_PATH, " " * (4 << 20))
    assert mar.stat().st_size < 64 << 10
    with pytest.raises(ManifestError, match="is over 1048576 bytes"):
        read_manifest(mar)
    assert read_zip_member(mar, MANIFEST_PATH, 8 << 20, ManifestError) == b" " * (4 << 20)
    with pytest.raises(WorkflowArchiverError, match=r"has no WAR-INF/MANIFEST\.json"):
        read_zip_member(mar, "WAR-INF/MANIFEST.json", 100, WorkflowArchiverError)
    (tmp_path / "MAR-INF").mkdir()
    (tmp_path / MANIFEST_PATH).write_text("12345")
    with pytest.raises(ManifestError, match="is over 4 bytes"):
        read_folder_member(tmp_path, MANIFEST_PATH, 4, ManifestError)
    assert read_folder_member(tmp_path, MANIFEST_PATH, 5, ManifestError) == b"12345"
