"""``model-archiver``: the command line, with torch-model-archiver's flags."""

from __future__ import annotations

from pathlib import Path

import click

from model_archiver.errors import ModelArchiverError
from model_archiver.handlers import BUILTIN_HANDLERS
from model_archiver.packaging import ArchiveFormat, ArchiveOptions, build_archive
from model_archiver.pt2 import pt2_note

__all__ = ["main"]

# torch-model-archiver accepts these three and treats them all as Python 3.
_RUNTIMES = ("python", "python2", "python3")


def _split_extra_files(value: str | None) -> tuple[str, ...]:
    if not value:
        return ()
    return tuple(part.strip() for part in value.split(",") if part.strip())


@click.command(
    name="model-archiver",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option("--model-name", required=True, help="Model name; the archive is <name>.mar.")
@click.option("-v", "--version", default="1.0", show_default=True, help="Model version.")
@click.option("--model-file", help="Python file with the model class (eager mode).")
@click.option("--serialized-file",
              help="Weights: a .pt/.pth state dict, a .safetensors file or a TorchScript file.")
@click.option(
    "--handler",
    required=True,
    help="A built-in handler (" + ", ".join(sorted(BUILTIN_HANDLERS)) + ") or a handler "
    "file, path/to/handler[.py][:function].",
)
@click.option("--extra-files", help="Comma-separated files or folders to add to the archive.")
@click.option(
    "--runtime",
    type=click.Choice(_RUNTIMES),
    default="python",
    show_default=True,
    help="Language the handler runs in.",
)
@click.option(
    "--export-path",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="Existing directory to write the archive to.",
)
@click.option(
    "--archive-format",
    type=click.Choice([f.value for f in ArchiveFormat]),
    default=ArchiveFormat.DEFAULT.value,
    show_default=True,
    help="default: <name>.mar (zip); zip-store: uncompressed .mar; "
    "tgz: <name>.tar.gz; no-archive: a <name>/ folder.",
)
@click.option("-f", "--force", is_flag=True, help="Overwrite an existing archive.")
@click.option("-r", "--requirements-file", help="requirements.txt with model-specific packages.")
@click.option("-c", "--config-file", help="YAML model configuration (batch size, ...).")
def main(
    model_name: str,
    version: str,
    model_file: str | None,
    serialized_file: str | None,
    handler: str,
    extra_files: str | None,
    runtime: str,
    export_path: Path,
    archive_format: str,
    force: bool,
    requirements_file: str | None,
    config_file: str | None,
) -> None:
    """Package model files into a model archive that batchserve and TorchServe can serve."""
    options = ArchiveOptions(
        model_name=model_name,
        version=version,
        handler=handler,
        serialized_file=serialized_file,
        model_file=model_file,
        extra_files=_split_extra_files(extra_files),
        requirements_file=requirements_file,
        config_file=config_file,
        export_path=export_path,
        archive_format=ArchiveFormat(archive_format),
        force=force,
        runtime=runtime,
    )
    try:
        written = build_archive(options)
    except ModelArchiverError as exc:
        click.echo(f"model-archiver: error: {exc}", err=True)
        raise click.exceptions.Exit(1) from None
    note = pt2_note(serialized_file)
    if note is not None:  # on stderr: stdout is the archive's path, which scripts read
        click.echo(f"model-archiver: {note}", err=True)
    click.echo(str(written))
