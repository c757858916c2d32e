"""build_archive and the model-archiver CLI, on real files in tmp_path."""

from __future__ import annotations

import json
import re
import tarfile
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from model_archiver.cli import main
from model_archiver.errors import ModelArchiverError
from model_archiver.handlers import BUILTIN_HANDLERS
from model_archiver.manifest import MANIFEST_PATH, read_manifest
from model_archiver.packaging import ArchiveFormat, ArchiveOptions, build_archive

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    """A folder with the files of a small model, in sub-folders to check base names."""
    src = tmp_path / "src"
    (src / "weights").mkdir(parents=True)
    (src / "weights" / "toy.pt").write_bytes(b"\x00weights")
    (src / "model.py").write_text("class Toy: ...\n")
    (src / "handler.py").write_text("def handle(data, context):\n    return data\n")
    (src / "requirements.txt").write_text("numpy\n")
    (src / "model-config.yaml").write_text("batchSize: 4\n")
    (src / "index_to_name.json").write_text('{"0": "cat"}')
    assets = src / "assets"
    (assets / "vocab").mkdir(parents=True)
    (assets / "labels.txt").write_text("cat\n")
    (assets / "vocab" / "words.txt").write_text("hello\n")
    (assets / "__pycache__").mkdir()
    (assets / "__pycache__" / "x.pyc").write_bytes(b"")
    return src


def options(src: Path, export: Path, **overrides: object) -> ArchiveOptions:
    values: dict[str, object] = {
        "model_name": "toy",
        "version": "1.0",
        "handler": str(src / "handler.py"),
        "serialized_file": str(src / "weights" / "toy.pt"),
        "model_file": str(src / "model.py"),
        "extra_files": (str(src / "index_to_name.json"),),
        "requirements_file": str(src / "requirements.txt"),
        "config_file": str(src / "model-config.yaml"),
        "export_path": export,
    }
    values.update(overrides)
    return ArchiveOptions(**values)  # type: ignore[arg-type]


EXPECTED_FILES = [
    "MAR-INF/MANIFEST.json",
    "handler.py",
    "index_to_name.json",
    "model-config.yaml",
    "model.py",
    "requirements.txt",
    "toy.pt",
]


def zip_names(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as archive:
        return sorted(archive.namelist())


def test_default_format_is_a_deflated_mar(inputs: Path, tmp_path: Path) -> None:
    written = build_archive(options(inputs, tmp_path))
    assert written == tmp_path / "toy.mar"
    assert zip_names(written) == EXPECTED_FILES
    with zipfile.ZipFile(written) as archive:
        types = {info.compress_type for info in archive.infolist()}
        assert archive.read("toy.pt") == b"\x00weights"
    assert types == {zipfile.ZIP_DEFLATED}


def test_manifest_records_base_names(inputs: Path, tmp_path: Path) -> None:
    manifest = read_manifest(build_archive(options(inputs, tmp_path)))
    assert manifest.model_name == "toy"
    assert manifest.model_version == "1.0"
    assert manifest.handler == "handler.py"
    assert manifest.serialized_file == "toy.pt"
    assert manifest.model_file == "model.py"
    assert manifest.requirements_file == "requirements.txt"
    assert manifest.config_file == "model-config.yaml"
    assert manifest.runtime == "python"


def test_zip_store_format_is_uncompressed(inputs: Path, tmp_path: Path) -> None:
    written = build_archive(options(inputs, tmp_path, archive_format=ArchiveFormat.ZIP_STORE))
    assert written == tmp_path / "toy.mar"
    with zipfile.ZipFile(written) as archive:
        assert {info.compress_type for info in archive.infolist()} == {zipfile.ZIP_STORED}
        assert sorted(archive.namelist()) == EXPECTED_FILES


def test_tgz_format_has_one_top_folder(inputs: Path, tmp_path: Path) -> None:
    written = build_archive(options(inputs, tmp_path, archive_format="tgz"))
    assert written == tmp_path / "toy.tar.gz"
    with tarfile.open(written, "r:gz") as archive:
        names = sorted(archive.getnames())
    assert names == [f"toy/{name}" for name in EXPECTED_FILES]
    assert read_manifest(written).serialized_file == "toy.pt"


def test_no_archive_format_writes_a_folder(inputs: Path, tmp_path: Path) -> None:
    written = build_archive(options(inputs, tmp_path, archive_format="no-archive"))
    assert written == tmp_path / "toy"
    files = sorted(p.relative_to(written).as_posix() for p in written.rglob("*") if p.is_file())
    assert files == EXPECTED_FILES
    assert read_manifest(written).handler == "handler.py"


def test_no_temporary_files_are_left_behind(inputs: Path, tmp_path: Path) -> None:
    export = tmp_path / "out"
    export.mkdir()
    for archive_format in ArchiveFormat:
        build_archive(options(inputs, export, archive_format=archive_format, force=True))
    assert sorted(p.name for p in export.iterdir()) == ["toy", "toy.mar", "toy.tar.gz"]


def test_entries_are_sorted_after_the_manifest(inputs: Path, tmp_path: Path) -> None:
    written = build_archive(options(inputs, tmp_path))
    with zipfile.ZipFile(written) as archive:
        names = archive.namelist()
    assert names[0] == MANIFEST_PATH
    assert names[1:] == sorted(names[1:])


def test_extra_files_directory_is_copied_at_the_root(inputs: Path, tmp_path: Path) -> None:
    opts = options(inputs, tmp_path, extra_files=(str(inputs / "assets"),))
    names = zip_names(build_archive(opts))
    assert "labels.txt" in names
    assert "vocab/words.txt" in names
    assert not any("__pycache__" in name or name.startswith("assets") for name in names)


def test_same_file_twice_is_stored_once(inputs: Path, tmp_path: Path) -> None:
    opts = options(inputs, tmp_path, extra_files=(str(inputs / "handler.py"),))
    assert zip_names(build_archive(opts)).count("handler.py") == 1


def test_two_files_with_one_name_are_rejected(inputs: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.py").write_text("something else\n")
    opts = options(inputs, tmp_path, extra_files=(str(other / "model.py"),))
    with pytest.raises(ModelArchiverError, match=r"'model\.py'"):
        build_archive(opts)


def test_handler_function_suffix_is_kept(inputs: Path, tmp_path: Path) -> None:
    opts = options(inputs, tmp_path, handler=f"{inputs / 'handler.py'}:handle")
    written = build_archive(opts)
    assert read_manifest(written).handler == "handler.py:handle"
    assert "handler.py" in zip_names(written)


def test_builtin_handler_is_recorded_verbatim(inputs: Path, tmp_path: Path) -> None:
    written = build_archive(options(inputs, tmp_path, handler="image_classifier"))
    assert read_manifest(written).handler == "image_classifier"
    assert "handler.py" not in zip_names(written)


def test_missing_handler_file_is_an_error(inputs: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelArchiverError, match=r"handler file .*missing\.py does not exist"):
        build_archive(options(inputs, tmp_path, handler=str(inputs / "missing.py:handle")))


@pytest.mark.parametrize(("typo", "meant"), [
    ("image_clasifier", "image_classifier"), ("imageclassifier", "image_classifier"),
    ("Image_Classifier", "image_classifier"), ("object_detecter", "object_detector"),
    ("text_classifer", "text_classifier"), ("image_segmentor", "image_segmenter"),
    ("ts.torch_handler.image_classifier", "image_classifier"),
])
def test_a_misspelt_builtin_handler_is_refused_naming_the_builtins(
        inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, typo: str,
        meant: str) -> None:
    """As torch-model-archiver 0.12: a bare name that is no built-in is a file, and there is
    none; the message names the closest built-in and all of them, and nothing is written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelArchiverError) as refused:
        build_archive(options(inputs, tmp_path, handler=typo))
    message = str(refused.value)
    assert f"did you mean {meant}?" in message
    assert all(name in message for name in BUILTIN_HANDLERS)
    assert f"{typo}.py" in message
    assert not list(tmp_path.glob("toy*"))


@pytest.mark.parametrize(("handler", "message"), [
    ("module:fn", "no handler file module.py"),
    ("densenet_handler", "not a built-in handler"),  # a ts module, but not the archiver's
    ("image_classifier:handle", "a built-in handler takes no ':function'"),
    ("missing.py", "handler file missing.py does not exist"),
    ("missing.py:handle", "handler file missing.py does not exist"),
    ("no/such/dir/h", "handler file no/such/dir/h.py does not exist"),
    ("no/such/dir/h:fn", "handler file no/such/dir/h.py does not exist"),
    ("", "must not be empty"),
    ("  ", "must not be empty"),
])
def test_a_handler_that_is_neither_builtin_nor_file_is_refused(
        inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handler: str,
        message: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelArchiverError, match=re.escape(message)):
        build_archive(options(inputs, tmp_path, handler=handler))
    assert not list(tmp_path.glob("toy*"))


@pytest.mark.parametrize("name", sorted(BUILTIN_HANDLERS))
def test_every_builtin_handler_is_taken_by_name(inputs: Path, tmp_path: Path,
                                                name: str) -> None:
    written = build_archive(options(inputs, tmp_path, handler=name))
    assert read_manifest(written).handler == name
    assert "handler.py" not in zip_names(written)


@pytest.mark.parametrize(("handler", "recorded", "packed"), [
    ("h", "h", "h.py"), ("h:fn", "h:fn", "h.py"), ("h.py", "h.py", "h.py"),
    ("h.py:fn", "h.py:fn", "h.py"), ("./h.py", "h.py", "h.py"), ("sub/h2", "h2", "h2.py"),
    ("sub/h2:fn", "h2:fn", "h2.py"), ("sub/h2.py:fn", "h2.py:fn", "h2.py"),
    ("image_classifier", "image_classifier", None),  # the built-in, not ./image_classifier.py
])
def test_handler_files_are_found_as_torchserves_archiver_finds_them(
        inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handler: str,
        recorded: str, packed: str | None) -> None:
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    for file in ("h.py", "sub/h2.py", "image_classifier.py"):
        (work / file).write_text("def fn(data, context):\n    return data\n")
    monkeypatch.chdir(work)
    written = build_archive(options(inputs, tmp_path, handler=handler))
    assert read_manifest(written).handler == recorded
    files = {name for name in zip_names(written) if name.endswith(".py")} - {"model.py"}
    assert files == ({packed} if packed else set())


def test_the_archivers_builtins_are_handlers_the_worker_loads() -> None:
    """Every name the archiver takes as built-in is batchserve's own built-in or a module of
    the worker's ``ts.torch_handler`` (TorchServe's server resolves it there too), and each
    of batchserve's own built-ins is one the archiver takes."""
    from backend.handlers import BUILTIN_HANDLERS as WORKER_BUILTINS

    ts_handlers = ROOT / "backend" / "compat" / "ts" / "torch_handler"
    assert set(WORKER_BUILTINS) <= BUILTIN_HANDLERS
    for name in BUILTIN_HANDLERS - set(WORKER_BUILTINS):
        assert (ts_handlers / f"{name}.py").is_file(), name


@pytest.mark.parametrize("name", ["1model", "bad name", "a/b", "", "_x", "toy!", "x" * 129,
                                  "CON", "lpt1.model", "ends."])
def test_bad_model_name(inputs: Path, tmp_path: Path, name: str) -> None:
    with pytest.raises(ModelArchiverError, match="invalid model name"):
        build_archive(options(inputs, tmp_path, model_name=name))


@pytest.mark.parametrize("version", ["1.0 beta", "../1", "v" * 65, "nul", "1."])
def test_bad_version(inputs: Path, tmp_path: Path, version: str) -> None:
    with pytest.raises(ModelArchiverError, match="invalid model version"):
        build_archive(options(inputs, tmp_path, version=version))


@pytest.mark.parametrize("name", ["toy", "resnet-152", "bert.base_v2", "x" * 128, "console"])
def test_good_model_name(inputs: Path, tmp_path: Path, name: str) -> None:
    assert build_archive(options(inputs, tmp_path, model_name=name)).name == f"{name}.mar"


@pytest.mark.parametrize(
    ("field", "flag"),
    [
        ("serialized_file", "--serialized-file"),
        ("model_file", "--model-file"),
        ("requirements_file", "--requirements-file"),
        ("config_file", "--config-file"),
    ],
)
def test_missing_file_is_an_error(inputs: Path, tmp_path: Path, field: str, flag: str) -> None:
    missing = str(inputs / "missing.bin")
    with pytest.raises(ModelArchiverError, match=rf"{flag}: .*missing\.bin does not exist"):
        build_archive(options(inputs, tmp_path, **{field: missing}))


def test_missing_extra_file_is_an_error(inputs: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelArchiverError, match=r"--extra-files: .*nope\.txt does not exist"):
        build_archive(options(inputs, tmp_path, extra_files=(str(inputs / "nope.txt"),)))


def test_missing_export_path_is_an_error(inputs: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelArchiverError, match="export path"):
        build_archive(options(inputs, tmp_path / "nowhere"))


def test_unknown_archive_format_is_an_error(inputs: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelArchiverError, match="unknown archive format"):
        options(inputs, tmp_path, archive_format="rar")


def test_reserved_mar_inf_entry_is_an_error(inputs: Path, tmp_path: Path) -> None:
    extra = tmp_path / "extra"
    (extra / "MAR-INF").mkdir(parents=True)
    (extra / "MAR-INF" / "MANIFEST.json").write_text("{}")
    with pytest.raises(ModelArchiverError, match="reserved"):
        build_archive(options(inputs, tmp_path, extra_files=(str(extra),)))


@pytest.mark.parametrize("archive_format", list(ArchiveFormat))
def test_existing_output_needs_force(
    inputs: Path, tmp_path: Path, archive_format: ArchiveFormat
) -> None:
    first = build_archive(options(inputs, tmp_path, archive_format=archive_format))
    with pytest.raises(
        ModelArchiverError, match=rf"{re.escape(first.name)} already exists.*--force"
    ):
        build_archive(options(inputs, tmp_path, archive_format=archive_format, version="2.0"))
    assert read_manifest(first).model_version == "1.0"

    again = build_archive(
        options(inputs, tmp_path, archive_format=archive_format, version="2.0", force=True)
    )
    assert again == first
    assert read_manifest(again).model_version == "2.0"


def test_force_replaces_a_folder_completely(inputs: Path, tmp_path: Path) -> None:
    first = build_archive(options(inputs, tmp_path, archive_format="no-archive"))
    (first / "stale.txt").write_text("old")
    build_archive(options(inputs, tmp_path, archive_format="no-archive", force=True))
    assert not (first / "stale.txt").exists()


# The CLI, through click's runner.


def test_cli_builds_an_archive(inputs: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main,
        [
            "--model-name", "toy",
            "--version", "3.0",
            "--serialized-file", str(inputs / "weights" / "toy.pt"),
            "--model-file", str(inputs / "model.py"),
            "--handler", f"{inputs / 'handler.py'}:handle",
            "--extra-files", f"{inputs / 'index_to_name.json'}, {inputs / 'assets'}",
            "-r", str(inputs / "requirements.txt"),
            "-c", str(inputs / "model-config.yaml"),
            "--export-path", str(tmp_path),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    written = tmp_path / "toy.mar"
    assert result.stdout.strip() == str(written)
    manifest = read_manifest(written)
    assert manifest.handler == "handler.py:handle"
    assert manifest.model_version == "3.0"
    names = zip_names(written)
    assert {"index_to_name.json", "labels.txt", "vocab/words.txt"} <= set(names)


def test_cli_tgz_and_force(inputs: Path, tmp_path: Path) -> None:
    args = [
        "--model-name", "toy",
        "--handler", "image_classifier",
        "--serialized-file", str(inputs / "weights" / "toy.pt"),
        "--export-path", str(tmp_path),
        "--archive-format", "tgz",
    ]  # fmt: skip
    runner = CliRunner()
    assert runner.invoke(main, args).exit_code == 0

    refused = runner.invoke(main, args)
    assert refused.exit_code == 1
    assert refused.stderr.startswith("model-archiver: error: ")
    assert "already exists" in refused.stderr
    assert "--force" in refused.stderr
    assert refused.stdout == ""

    forced = runner.invoke(main, [*args, "-f"])
    assert forced.exit_code == 0, forced.output
    assert forced.stdout.strip() == str(tmp_path / "toy.tar.gz")
    manifest = json.loads(_tgz_member(tmp_path / "toy.tar.gz", f"toy/{MANIFEST_PATH}"))
    assert manifest["model"]["modelVersion"] == "1.0"  # the default --version


def _tgz_member(path: Path, name: str) -> bytes:
    with tarfile.open(path, "r:gz") as archive:
        member = archive.extractfile(name)
        assert member is not None
        return member.read()


def test_cli_reports_missing_file(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main,
        ["--model-name", "toy", "--handler", "image_classifier",
         "--serialized-file", str(tmp_path / "nope.pt"), "--export-path", str(tmp_path)],
    )  # fmt: skip
    assert result.exit_code == 1
    assert result.stderr == (
        f"model-archiver: error: --serialized-file: {tmp_path / 'nope.pt'} does not exist\n"
    )


def test_cli_reports_bad_name(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["--model-name", "bad name", "--handler", "h", "--export-path", str(tmp_path)]
    )
    assert result.exit_code == 1
    assert "model-archiver: error: invalid model name 'bad name'" in result.stderr


def test_cli_requires_model_name_and_handler() -> None:
    result = CliRunner().invoke(main, ["--handler", "image_classifier"])
    assert result.exit_code == 2
    assert "--model-name" in result.stderr
    result = CliRunner().invoke(main, ["--model-name", "toy"])
    assert result.exit_code == 2
    assert "--handler" in result.stderr


def test_cli_refuses_a_misspelt_builtin_handler(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["--model-name", "x", "--version", "1", "--handler",
                                       "image_clasifier", "--export-path", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith("model-archiver: error: --handler image_clasifier: ")
    assert "did you mean image_classifier?" in result.stderr
    assert "object_detector" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_cli_rejects_unknown_archive_format(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["--model-name", "toy", "--handler", "h", "--archive-format", "rar"]
    )
    assert result.exit_code == 2
    assert "rar" in result.stderr
