"""``workflow-archiver`` (also ``torch-workflow-archiver``): the command line, with
torch-workflow-archiver 0.2.x's flags."""

from __future__ import annotations

from pathlib import Path

import click

from workflow_archiver.errors import WorkflowArchiverError
from workflow_archiver.packaging import WorkflowOptions, build_workflow_archive

__all__ = ["main"]


class _PrefixCommand(click.Command):
    """Takes a long option by any unique prefix (``--spec`` for ``--spec-file``), as
    torch-workflow-archiver's argparse parser does, so scripts written for it run unchanged."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        longs = [name for param in self.get_params(ctx) for name in param.opts
                 if name.startswith("--")]
        expanded: list[str] = []
        for arg in args:
            if arg == "--":
                expanded.extend(args[len(expanded):])
                break
            flag, eq, value = arg.partition("=")
            if flag.startswith("--") and flag not in longs:
                matches = [name for name in longs if name.startswith(flag)]
                if len(matches) == 1:
                    arg = f"{matches[0]}{eq}{value}"
                elif matches:
                    raise click.UsageError(
                        f"ambiguous option: {flag} could match {', '.join(matches)}", ctx)
            expanded.append(arg)
        return super().parse_args(ctx, expanded)


def _split(value: str | None) -> tuple[str, ...]:
    if not value:
        return ()
    return tuple(part.strip() for part in value.split(",") if part.strip())


@click.command(
    cls=_PrefixCommand,
    name="workflow-archiver",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option("--workflow-name", required=True,
              help="Workflow name; the archive is <name>.war.")
@click.option("--spec-file", required=True,
              help="The workflow's spec: a YAML file with its 'models' and its 'dag'.")
@click.option("--handler", required=True,
              help="Python file with the functions the DAG names (its pre- and post-processing).")
@click.option("--export-path", type=click.Path(file_okay=False, path_type=Path),
              default=Path("."), show_default=True,
              help="Existing directory to write the archive to.")
@click.option("--extra-files", help="Comma-separated files or folders to add to the archive.")
@click.option("-f", "--force", is_flag=True, help="Overwrite an existing archive.")
def main(workflow_name: str, spec_file: str, handler: str, export_path: Path,
         extra_files: str | None, force: bool) -> None:
    """Package a workflow (its spec, handler and extra files) into a workflow archive that
    batchserve and TorchServe can serve."""
    options = WorkflowOptions(workflow_name=workflow_name, spec_file=spec_file,
                              handler=handler, export_path=export_path,
                              extra_files=_split(extra_files), force=force)
    try:
        built = build_workflow_archive(options)
    except WorkflowArchiverError as exc:
        click.echo(f"workflow-archiver: error: {exc}", err=True)
        raise click.exceptions.Exit(1) from None
    for warning in built.spec.warnings:
        click.echo(f"workflow-archiver: warning: {warning}", err=True)
    click.echo(str(built.path))
