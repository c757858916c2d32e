"""A whole metrics page checked as Prometheus reads it: prometheus_client's parser, and
Prometheus' own promtool where it is installed (``tests/unit/queries.py`` finds it)."""

from __future__ import annotations

import re
import subprocess

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.unit import queries

_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$", re.M)


def parsed_page(text: str) -> dict[str, list[Sample]]:
    """The samples of each family of ``text``, by the family's name as Prometheus' parser reads
    it; fails the test if the page does not parse, holds a family twice (two ``# TYPE`` lines
    of a name, or two that the parser reads as one), or a sample names a label twice."""
    types = _TYPE.findall(text)
    names = [name for name, _ in types]
    assert len(names) == len(set(names)), f"a family written twice: {_repeated(names)}"
    families = list(text_string_to_metric_families(text))
    read_as = [family.name for family in families]
    assert len(read_as) == len(set(read_as)), f"families read as one: {_repeated(read_as)}"
    assert len(families) == len(types)
    for family in families:
        for sample in family.samples:
            assert sample.name.startswith(family.name), (family.name, sample.name)
    tool = queries.promtool()
    if tool is not None:
        checked = subprocess.run([tool, "check", "metrics"], input=text.encode(),
                                 capture_output=True, timeout=60, check=False)
        said = (checked.stdout + checked.stderr).decode(errors="replace")
        # 3: lint warnings (TorchServe's names: camel case, counters without _total), which
        # are TorchServe's page as it is; 1: the page does not parse.
        assert checked.returncode in (0, 3) and "error while linting" not in said, said[-3000:]
    return {family.name: family.samples for family in families}


def _repeated(names: list[str]) -> list[str]:
    return sorted({name for name in names if names.count(name) > 1})
