"""The GPU check's pure parts (issue 33, item 7): the RESULT line from a run's rows, the
worker profile's summary and verdict, the load's split over processes, GPU memory per extra
worker, the ImageNet-sized JPEGs, and TorchServe detected or skipped saying why."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from benchmarks import gpu_result, torchserve
from benchmarks.gpu_load import per_extra_worker, shares
from benchmarks.jpegs import natural_jpegs
from benchmarks.profile_summary import launch_bound, parse_raw, summarise


def _row(**fields: Any) -> dict[str, Any]:
    return {"server": "batchserve", "model": "resnet152", "variant": "bf16",
            "kind": "saturation", "img_s": 100.0, "gpu_busy_pct": 50.0, **fields}


ROWS = [
    _row(kind="lone", variant="fp32", batch=1, img_s=60.0, p50_ms=7.44),
    _row(kind="lone", variant="fp32", batch=1, img_s=50.0, p50_ms=9.0),
    _row(variant="bf16", img_s=3120.4, gpu_busy_pct=93.2),
    _row(variant="bf16-eager", img_s=1400.0, gpu_busy_pct=25.0),
    _row(variant="bf16", img_s=9999.0, error="registration failed"),  # not counted
    _row(variant="fp32", img_s=2514.0, gpu_busy_pct=88.0),
    _row(variant="fp32-ipc", kind="ipc", img_s=2600.0, gpu_busy_pct=89.0),
    _row(model="resnet50", img_s=8210.0),
    _row(server="torchserve", variant="fp32", img_s=140.0),
    _row(server="torchserve", variant="fp32", img_s=float("nan")),
]


def test_the_result_line_takes_the_best_served_figure_of_each() -> None:
    line = gpu_result.result_line("NVIDIA H100 80GB HBM3", gpu_result.figures(ROWS))
    assert line == ("RESULT card=NVIDIA_H100_80GB_HBM3 resnet152_bf16_img_s=3120 "
                    "resnet152_fp32_img_s=2600 lone_p50_ms=7.4 resnet50_jpeg_img_s=8210 "
                    "torchserve_resnet152_img_s=140 gpu_busy_pct=93")
    assert gpu_result.parse_result_line(line)["resnet152_fp32_img_s"] == "2600"


def test_what_a_run_did_not_measure_is_na() -> None:
    line = gpu_result.result_line(None, gpu_result.figures([_row(model="resnet50")]))
    fields = gpu_result.parse_result_line(line)
    assert fields["card"] == "na" and fields["resnet50_jpeg_img_s"] == "100"
    assert {fields[name] for name in gpu_result.RESULT_FIELDS
            if name != "resnet50_jpeg_img_s"} == {"na"}


@pytest.mark.parametrize("line", ["", "RESULT card=x", "RESULTS card=x",
                                  "RESULT card=x resnet152_bf16_img_s=1 resnet152_bf16_img_s=2"])
def test_a_line_without_every_field_once_is_refused(line: str) -> None:
    with pytest.raises(ValueError):
        gpu_result.parse_result_line(line)


def test_the_result_command_prints_the_table_the_notes_then_the_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"card": "cpu", "rows": ROWS[:3], "notes": ["a note"]}))
    assert gpu_result.main([str(results)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| server | model |") and "note: a note" in out
    assert out[-1].startswith("RESULT card=cpu resnet152_bf16_img_s=3120 ")
    assert gpu_result.main([str(tmp_path / "none.json")]) == 0  # no run yet: all na
    assert capsys.readouterr().out.strip().endswith("gpu_busy_pct=na")


PROFILE = """\
thread (1): MainThread;_run (worker.py:180);forward (torch/nn/modules/conv.py:550) 70
thread (1): MainThread;_run (worker.py:180);replay (handlers/graphs.py:120) 10
thread (1): MainThread;recv_into (socket.py:700) 20
thread (2): frame-reader;load (handlers/images.py:240);read (handlers/jpeg_markers.py:90) 30
thread (2): frame-reader;wait (threading.py:320) 70
thread (3): image-decode_0;_worker (concurrent/futures/thread.py:80) 50
thread (4): image-decode_1;_worker (concurrent/futures/thread.py:80) 50
garbage line
"""


def test_a_profile_is_summed_per_thread_and_category() -> None:
    threads = parse_raw(PROFILE)
    assert set(threads) == {"MainThread", "frame-reader", "image-decode"}
    main = threads["MainThread"]
    assert main.samples == 100
    assert (main.share("forward pass"), main.share("graph replay"), main.share("waiting")) == \
        (0.7, 0.1, 0.2)
    assert threads["frame-reader"].share("image pipeline") == 0.3
    assert threads["image-decode"].samples == 100  # the pool's threads together
    assert launch_bound(threads) is True
    text = summarise(threads, title="worker")
    assert text.splitlines()[1].startswith("  MainThread (100 samples): forward pass 70%")
    assert text.splitlines()[-1].startswith("  verdict: launch-bound (the main thread spends "
                                            "70% of its time in an eager forward pass")


def test_a_worker_replaying_graphs_is_not_launch_bound() -> None:
    threads = parse_raw(PROFILE.replace("forward (torch/nn/modules/conv.py:550) 70",
                                        "replay (torch/cuda/graphs.py:90) 70"))
    assert launch_bound(threads) is False
    assert "verdict: not launch-bound" in summarise(threads)
    assert launch_bound(parse_raw("")) is None


def test_the_clients_are_split_over_processes_and_extra_workers_priced() -> None:
    assert shares(10, 4) == [3, 3, 2, 2] and shares(2, 8) == [1, 1] and shares(5, 1) == [5]
    assert per_extra_worker({1: 1000.0, 2: 1300.0, 4: 1900.0}) == 300.0
    assert per_extra_worker({1: None, 2: 1300.0}) is None
    assert per_extra_worker({1: 1000.0}) is None


def test_the_made_jpegs_are_imagenet_sized_and_the_same_every_time() -> None:
    made = natural_jpegs(3)
    assert [Image.open(io.BytesIO(data)).size for data in made] == \
        [(500, 375), (375, 500), (500, 333)]
    assert all(80_000 <= len(data) <= 200_000 for data in made), [len(d) for d in made]
    assert natural_jpegs(1) == made[:1]


def test_torchserve_is_skipped_saying_why_where_it_cannot_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchserve.importlib.util, "find_spec", lambda name: None)
    install, why = torchserve.find_install(tmp_path, sources=())
    assert install is None and "captum is not installed" in why
    monkeypatch.undo()
    monkeypatch.setattr(torchserve.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torchserve, "VENV", tmp_path / "no-venv")
    monkeypatch.setattr(torchserve, "ROOT", tmp_path)
    monkeypatch.delenv("TS_HOME", raising=False)
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-java"))
    install, why = torchserve.find_install(tmp_path / "work", sources=(tmp_path,))
    assert install is None and why.startswith("no TorchServe: no TS_HOME")


def test_torchserve_is_found_from_a_folder_holding_ts_and_a_java_runtime(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, jre = tmp_path / "ts-home", tmp_path / "jre"
    (home / "ts").mkdir(parents=True)
    (jre / "bin").mkdir(parents=True)
    java = jre / "bin" / "java"
    java.write_text("#!/bin/sh\nexit 0\n")
    java.chmod(0o755)
    monkeypatch.setattr(torchserve.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setenv("TS_HOME", str(home))
    monkeypatch.setenv("JAVA_HOME", str(jre))
    install, why = torchserve.find_install(tmp_path / "work", sources=())
    assert install is not None and why == f"ts from {home}, Java from {jre}"
    assert install.env == {"PYTHONPATH": str(home), "JAVA_HOME": str(jre)}
    java.write_text("#!/bin/sh\nexit 1\n")  # a runtime that does not run
    assert torchserve.find_install(tmp_path / "work", sources=())[0] is None
