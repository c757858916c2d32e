"""The GPU check's one comparable line (issue 33, item 7), from the runs it recorded.

Every served run of ``benchmarks/gpu_check.py`` is a row of ``results.json`` (its server,
model, precision, batch size, workers, img/s, latencies, how busy the GPU was; or its error).
The line takes the best of them::

    RESULT card=NVIDIA_H100_80GB_HBM3 resnet152_bf16_img_s=3120 resnet152_fp32_img_s=2514
      lone_p50_ms=7.4 resnet50_jpeg_img_s=8210 torchserve_resnet152_img_s=140 gpu_busy_pct=93

(one line). A figure the run could not measure is ``na``. The card's name has its spaces as
underscores, so that the line splits on spaces.

* ``resnet152_bf16_img_s``, ``resnet152_fp32_img_s``: the most images per second batchserve
  answered for ResNet-152 at that precision, whatever the batch size, workers or weight
  sharing (rows whose variant starts with ``bf16`` or ``fp32``);
* ``lone_p50_ms``: the p50 of one client sending one image at a time (batch size 1);
* ``resnet50_jpeg_img_s``: batchserve's best on ResNet-50 with the ImageNet-sized JPEGs;
* ``torchserve_resnet152_img_s``: TorchServe 0.12's best on ResNet-152, same card, same run;
* ``gpu_busy_pct``: how busy the GPU was (mean of its utilisation samples) during the run of
  the best ResNet-152 figure, bf16 or fp32.

    python -m benchmarks.gpu_result /tmp/gpu-out/results.json    # the table, then the line
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

RESULT_FIELDS = ("resnet152_bf16_img_s", "resnet152_fp32_img_s", "lone_p50_ms",
                 "resnet50_jpeg_img_s", "torchserve_resnet152_img_s", "gpu_busy_pct")
BATCHSERVE, TORCHSERVE = "batchserve", "torchserve"
RESNET152, RESNET50 = "resnet152", "resnet50"
#: Kinds of row: a closed loop at saturation, the lone client.
SATURATION, LONE = "saturation", "lone"

Row = Mapping[str, Any]


def _number(value: Any) -> float | None:
    """A finite number, or None (missing, NaN, not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def succeeded(row: Row) -> bool:
    """A run that answered: no error, some images per second."""
    rate = _number(row.get("img_s"))
    return not row.get("error") and rate is not None and rate > 0


def best(rows: Iterable[Row], *, server: str, model: str, precision: str | None = None,
         kind: str | None = None) -> Row | None:
    """The row of the most img/s among the successful ones that match (``precision``: the
    variant's first part, ``bf16`` of ``bf16-eager``)."""
    matching = [row for row in rows if succeeded(row) and row.get("server") == server
                and row.get("model") == model
                and (kind is None or row.get("kind", SATURATION) == kind)
                and (precision is None
                     or str(row.get("variant", "")).split("-")[0] == precision)]
    return max(matching, key=lambda row: float(row["img_s"]), default=None)


def figures(rows: Sequence[Row]) -> dict[str, float | None]:
    """The RESULT line's figures from a run's rows (None: not measured)."""
    served = [row for row in rows if row.get("kind", SATURATION) != LONE]
    bf16 = best(served, server=BATCHSERVE, model=RESNET152, precision="bf16")
    fp32 = best(served, server=BATCHSERVE, model=RESNET152, precision="fp32")
    resnet50 = best(served, server=BATCHSERVE, model=RESNET50)
    torchserve = best(served, server=TORCHSERVE, model=RESNET152)
    lone = [p50 for row in rows if row.get("kind") == LONE and not row.get("error")
            and (p50 := _number(row.get("p50_ms"))) is not None]
    fastest = max((row for row in (bf16, fp32) if row is not None),
                  key=lambda row: float(row["img_s"]), default=None)
    return {
        "resnet152_bf16_img_s": _number(bf16["img_s"]) if bf16 else None,
        "resnet152_fp32_img_s": _number(fp32["img_s"]) if fp32 else None,
        "lone_p50_ms": min(lone) if lone else None,
        "resnet50_jpeg_img_s": _number(resnet50["img_s"]) if resnet50 else None,
        "torchserve_resnet152_img_s": _number(torchserve["img_s"]) if torchserve else None,
        "gpu_busy_pct": _number(fastest.get("gpu_busy_pct")) if fastest else None,
    }


def _format(name: str, value: float | None) -> str:
    if value is None:
        return "na"
    return f"{value:.1f}" if name.endswith("_ms") else f"{value:.0f}"


def card_token(card: str | None) -> str:
    """The card's name as one token of the line (``na`` when unknown)."""
    words = (card or "").split()
    return "_".join(words) if words else "na"


def result_line(card: str | None, values: Mapping[str, float | None]) -> str:
    """``RESULT card=... resnet152_bf16_img_s=... ...``, every field in its order."""
    fields = " ".join(f"{name}={_format(name, values.get(name))}" for name in RESULT_FIELDS)
    return f"RESULT card={card_token(card)} {fields}"


def parse_result_line(line: str) -> dict[str, str]:
    """A RESULT line's fields (``card`` among them), as text. Raises ValueError."""
    words = line.split()
    if not words or words[0] != "RESULT":
        raise ValueError(f"not a RESULT line: {line!r}")
    fields = dict(word.split("=", 1) for word in words[1:] if "=" in word)
    missing = [name for name in ("card", *RESULT_FIELDS) if name not in fields]
    if missing or len(fields) != len(words) - 1:
        raise ValueError(f"a RESULT line has every field once, as name=value: {line!r}")
    return fields


def load_results(path: Path) -> dict[str, Any]:
    """``results.json`` (rows, card, notes), or an empty one where there is none yet."""
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"card": None, "rows": [], "notes": []}
    document.setdefault("rows", [])
    document.setdefault("notes", [])
    document.setdefault("card", None)
    return document  # type: ignore[no-any-return]


def table(rows: Sequence[Row]) -> str:
    """The rows as a markdown table."""
    lines = ["| server | model | variant | kind | batch | workers | clients | img/s | p50 ms "
             "| p99 ms | GPU busy % | GPU MiB | note |", "|" + "---|" * 13]
    for row in rows:
        cells = [row.get(key, "") for key in ("server", "model", "variant", "kind", "batch",
                                                "workers", "clients")]
        numbers = [_format(key, _number(row.get(key))) for key in
                   ("img_s", "p50_ms", "p99_ms", "gpu_busy_pct", "gpu_memory_mib")]
        note = str(row.get("error") or row.get("note") or "")[:100].replace("|", "/")
        lines.append("| " + " | ".join(str(cell) for cell in [*cells, *numbers, note]) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="the run's results.json")
    parser.add_argument("--card", help="the card's name (default: the one recorded)")
    args = parser.parse_args(argv)
    document = load_results(args.results)
    rows = document["rows"]
    if rows:
        print(table(rows))
    for note in document["notes"]:
        print(f"note: {note}")
    print(result_line(args.card or document["card"], figures(rows)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
