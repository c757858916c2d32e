"""``$$NAME$$`` references in config.properties, against the real server started as a user
starts it: a variable's value is its key's, never split into keys as a glued line of the file
is (issue 31, item 8). ``FLAG='trueallowed_urls=.*'`` once made ``enable_model_api=$$FLAG$$``
two keys, and then a model from outside the model store registered."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import requests

from tests.conftest import spawn_server

TORCHSERVE = str(Path(sys.executable).parent / "torchserve")


def _register(management: str, url: str, name: str) -> requests.Response:
    return requests.post(f"{management}/models", timeout=120, params={
        "url": url, "model_name": name, "initial_workers": "0", "synchronous": "true"})


def test_a_variable_holding_a_second_key_stops_the_start_naming_its_key(
        build_mar, model_store: Path, tmp_path: Path) -> None:
    build_mar("echo", "echo")
    properties = tmp_path / "config.properties"
    properties.write_text("inference_address=http://127.0.0.1:0\n"
                          "management_address=http://127.0.0.1:0\n"
                          "metrics_address=http://127.0.0.1:0\n"
                          "grpc_inference_port=0\ngrpc_management_port=0\n"
                          f"log_location={tmp_path / 'logs'}\n"
                          "enable_model_api=$$FLAG$$\n")
    state = tmp_path / "state"
    env = {**os.environ, "BATCHSERVE_STATE_DIR": str(state), "FLAG": "trueallowed_urls=.*"}
    for mode in (["--foreground"], []):  # the server itself, and a background start
        started = subprocess.run(
            [TORCHSERVE, "--start", *mode, "--disable-token-auth", "--model-store",
             str(model_store), "--ts-config", str(properties), "--models", "echo=echo.mar"],
            cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=120)
        assert started.returncode == 2, (mode, started.stdout, started.stderr)
        # A configuration error naming the key and the value it got, before anything runs.
        assert "config key enable_model_api='trueallowed_urls=.*'" in started.stderr
        assert "expected true or false" in started.stderr
        assert "reads as two lines" not in started.stdout + started.stderr
        assert not (state / "server.json").exists()


def test_the_model_api_is_as_the_variable_says_and_the_store_stays_closed(
        build_mar, model_store: Path, tmp_path: Path) -> None:
    build_mar("echo", "echo")
    outside = tmp_path / "outside"
    outside.mkdir()
    build_mar("elsewhere", "echo").rename(outside / "elsewhere.mar")
    # A line glued in the file's own text is still split, around its references.
    glued = {"enable_model_api": "$$FLAG$$default_response_timeout=$$TIMEOUT$$"}
    (tmp_path / "on").mkdir()
    server = spawn_server(tmp_path / "on", model_store, config=glued,
                          env={"FLAG": "true", "TIMEOUT": "77"})
    try:
        registered = _register(server.management, "echo.mar", "echo")
        assert registered.status_code == 200, registered.text
        for url in (str(outside / "elsewhere.mar"), f"file://{outside}/elsewhere.mar"):
            refused = _register(server.management, url, "elsewhere")
            assert refused.status_code == 403, refused.text
            assert "allowed_urls" in refused.json()["message"]
        names = [m["modelName"] for m in
                 requests.get(f"{server.management}/models", timeout=30).json()["models"]]
        assert names == ["echo"]
        assert not (model_store / "elsewhere.mar").exists()
    finally:
        assert server.stop() == 0

    (tmp_path / "off").mkdir()
    server = spawn_server(tmp_path / "off", model_store, config=glued,
                          env={"FLAG": "false", "TIMEOUT": "77"})
    try:
        refused = _register(server.management, "echo.mar", "echo")
        assert refused.status_code == 405, refused.text  # the model API is off, as said
    finally:
        assert server.stop() == 0
