"""TLS with real clients: HTTPS on the inference, management and metrics ports, TLS on the gRPC
ports (``enable_grpc_ssl``), as TorchServe configures them, with a CA and a server certificate
made by the test (tests/certificates.py) for ``localhost`` and ``127.0.0.1``.

One server for most of the module (PEM files, every port over TLS); a second, without models,
serves a PKCS12 keystore; ``torchserve --start`` shows how a configuration that asks for TLS
without a usable certificate is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import requests
from google.protobuf import empty_pb2

from frontend.config import Address
from model_archiver.packaging import ArchiveOptions, build_archive
from protos import inference_pb2, inference_pb2_grpc, management_pb2, management_pb2_grpc
from tests.certificates import KEYSTORE_PASS, Certificates, make_certificates
from tests.conftest import HANDLERS, RunningServer, launch_server
from tests.torchserve_sources import MISSING, torchserve_file

HTTPS_ANY = Address("127.0.0.1", 0, is_tls=True)
REFUSAL = {"status": "This TorchServe instance only accepts HTTPS requests"}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("store")
    for name in ("echo", "echo2"):
        build_archive(ArchiveOptions(model_name=name, version="1.0",
                                     handler=str(HANDLERS / "echo.py"), export_path=store))
    return store


@pytest.fixture(scope="module")
def server(store: Path, certs: Certificates) -> Iterator[RunningServer]:
    running = launch_server(store, "echo.mar", inference_address=HTTPS_ANY,
                            management_address=HTTPS_ANY, metrics_address=HTTPS_ANY,
                            certificate_file=certs.cert, private_key_file=certs.key,
                            enable_grpc_ssl=True)
    try:
        yield running
    finally:
        running.stop()


def _on(url: str, host: str) -> str:
    """``url`` with its host replaced (the certificate names localhost and 127.0.0.1)."""
    return url.replace("127.0.0.1", host)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# -- HTTPS ------------------------------------------------------------------------------------


def test_every_http_port_answers_https_to_curl_with_the_ca(server: RunningServer,
                                                           certs: Certificates,
                                                           tmp_path: Path) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed (Debian: apt-get install curl)")
    body = tmp_path / "body.bin"
    body.write_bytes(b"over TLS\x00\xff")
    assert server.inference.startswith("https://") and server.metrics.startswith("https://")

    def get(url: str, *extra: str) -> tuple[str, str]:
        result = subprocess.run([curl, "-sS", "--cacert", str(certs.ca), "-w",
                                 "\n%{http_code} %{ssl_verify_result}", *extra, url],
                                capture_output=True, timeout=30, check=False)
        assert result.returncode == 0, result.stderr
        text, _, status = result.stdout.decode("latin-1").rpartition("\n")
        return text, status

    for host in ("localhost", "127.0.0.1"):
        text, status = get(_on(f"{server.inference}/ping", host))
        assert (status, json.loads(text)) == ("200 0", {"status": "Healthy"})
    # /predictions over TLS is the fast path's, as over plain HTTP.
    text, status = get(f"{_on(server.inference, 'localhost')}/predictions/echo", "-T", str(body),
                       "-H", "Content-Type: application/octet-stream")
    assert (status, text.encode("latin-1")) == ("200 0", body.read_bytes())
    text, status = get(f"{server.management}/models")
    assert status == "200 0" and json.loads(text)["models"][0]["modelName"] == "echo"
    text, status = get(f"{server.metrics}/metrics")
    assert status == "200 0" and "ts_inference_requests_total" in text
    # Without the CA, curl refuses the server (unknown issuer): the certificate is checked.
    untrusted = subprocess.run([curl, "-sS", f"{server.inference}/ping"], capture_output=True,
                               timeout=30, check=False)
    assert untrusted.returncode == 60, untrusted.stderr


def test_requests_verifies_the_server_and_keeps_its_connection(server: RunningServer,
                                                               certs: Certificates) -> None:
    ca = str(certs.ca)  # per request: REQUESTS_CA_BUNDLE would win over session.verify
    with requests.Session() as session:
        for index in range(20):  # one kept-alive TLS connection, the fast path each time
            answer = session.post(f"{server.inference}/predictions/echo",
                                  data=b"request %d" % index, timeout=30, verify=ca,
                                  headers={"Content-Type": "application/octet-stream"})
            assert (answer.status_code, answer.content) == (200, b"request %d" % index)
        described = session.get(f"{server.management}/models/echo", verify=ca, timeout=30)
        assert described.status_code == 200 and described.json()[0]["modelName"] == "echo"
        assert session.get(f"{server.inference}/api-description", verify=ca,
                           timeout=30).status_code == 200
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(f"{server.inference}/ping", timeout=30)  # the system's CAs: not trusted
    assert requests.get(f"{server.inference}/ping", verify=str(certs.ca),
                        timeout=30).status_code == 200


def test_plain_http_on_an_https_port_is_answered_403_and_the_server_stays_up(
        server: RunningServer, certs: Certificates) -> None:
    """As TorchServe answers it: 403 and its JSON, then the connection closes."""
    for url in (server.inference, server.management, server.metrics):
        plain = url.replace("https://", "http://")
        answer = requests.get(f"{plain}/ping", timeout=30)
        assert (answer.status_code, answer.json()) == (403, REFUSAL)
        answer = requests.post(f"{plain}/predictions/echo", data=b"x" * 100_000, timeout=30)
        assert answer.status_code == 403
    for garbage in (b"\x00\x01\x02\x03\r\n\r\n", b"", b"\x16\x03\x01\x00\x05hello"):
        with socket.create_connection(("127.0.0.1", _port(server.inference)), timeout=30) as raw:
            raw.sendall(garbage)
            raw.shutdown(socket.SHUT_WR)
            received = b""
            while chunk := raw.recv(65536):
                received += chunk
        # Not TLS: the 403; nothing (closed before a byte) or a broken handshake: closed.
        assert received.startswith(b"HTTP/1.1 403") if garbage[:1] == b"\x00" \
            else not received.startswith(b"HTTP/")
    assert requests.post(f"{server.inference}/predictions/echo", data=b"still here",
                         verify=str(certs.ca), timeout=30,
                         headers={"Content-Type": "application/octet-stream"}
                         ).content == b"still here"


# -- gRPC over TLS ------------------------------------------------------------------------------


def _credentials(certs: Certificates) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())


def test_grpc_secure_channels_reach_inference_and_management(server: RunningServer,
                                                             certs: Certificates) -> None:
    credentials = _credentials(certs)
    with grpc.secure_channel(f"localhost:{server.grpc_inference_port}", credentials) as channel:
        inference = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        answer = inference.Predictions(inference_pb2.PredictionsRequest(
            model_name="echo", input={"data": b"over gRPC and TLS"}), timeout=30)
        assert answer.prediction == b"over gRPC and TLS"
    with grpc.secure_channel(f"127.0.0.1:{server.grpc_management_port}",
                             credentials) as channel:
        management = management_pb2_grpc.ManagementAPIsServiceStub(channel)
        described = management.DescribeModel(management_pb2.DescribeModelRequest(
            model_name="echo"), timeout=30)
        assert json.loads(described.msg)[0]["modelName"] == "echo"
    # A plain channel, or one that trusts another CA, is refused; the server serves on.
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as channel:
        with pytest.raises(grpc.RpcError) as plain:
            inference_pb2_grpc.InferenceAPIsServiceStub(channel).Ping(
                empty_pb2.Empty(), timeout=10)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    other_ca = grpc.ssl_channel_credentials(root_certificates=(
        make_certificates(certs.ca.parent / "other").ca.read_bytes()))
    with grpc.secure_channel(f"localhost:{server.grpc_inference_port}", other_ca) as channel:
        with pytest.raises(grpc.RpcError) as untrusted:
            inference_pb2_grpc.InferenceAPIsServiceStub(channel).Ping(
                empty_pb2.Empty(), timeout=10)
        assert untrusted.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(f"localhost:{server.grpc_inference_port}", credentials) as channel:
        health = inference_pb2_grpc.InferenceAPIsServiceStub(channel).Ping(
            empty_pb2.Empty(), timeout=30)
        assert json.loads(health.health)["status"] == "Healthy"


CLIENT = "ts_scripts/torchserve_grpc_client.py"
PROTOS = "frontend/server/src/main/resources/proto"
#: Runs TorchServe's client unchanged but for its channel: the script opens
#: ``grpc.insecure_channel("localhost:7070")`` (7071 for management) and has no TLS option, so
#: its users swap in a secure channel to reach a server with enable_grpc_ssl, as done here (and
#: point it at this server's ports).
SECURE_CLIENT = """
import os, runpy, sys
import grpc
inference, management, ca, client, *argv = sys.argv[1:]
credentials = grpc.ssl_channel_credentials(root_certificates=open(ca, "rb").read())
ports = {"localhost:7070": inference, "localhost:7071": management}
def secure_channel(target, options=None, compression=None):
    return grpc.secure_channel("localhost:" + ports[target], credentials, options, compression)
grpc.insecure_channel = secure_channel
sys.argv = [client, *argv]
sys.path.insert(0, os.path.dirname(client))
runpy.run_path(client, run_name="__main__")
"""


def test_torchserves_grpc_client_over_tls(server: RunningServer, certs: Certificates,
                                          tmp_path: Path) -> None:
    """TorchServe's ts_scripts/torchserve_grpc_client.py (from TorchServe's sources, with
    stubs generated from TorchServe's .proto files as its docs say) registers, predicts and
    unregisters over TLS."""
    files = {name: torchserve_file(name) for name in (
        CLIENT, f"{PROTOS}/inference.proto", f"{PROTOS}/management.proto")}
    if any(data is None for data in files.values()):
        pytest.skip(MISSING)
    import google.rpc
    from grpc_tools import protoc

    for name, data in files.items():
        assert data is not None
        (tmp_path / Path(name).name).write_bytes(data)
    include = Path(protoc.__file__).parent / "_proto"
    rpc_include = Path(google.rpc.__path__[0]).parent.parent
    assert protoc.main(["protoc", f"-I{tmp_path}", f"-I{include}", f"-I{rpc_include}",
                        f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                        str(tmp_path / "inference.proto"),
                        str(tmp_path / "management.proto")]) == 0
    model_input = tmp_path / "input.txt"
    model_input.write_text("hello from TorchServe's client")

    def client(*argv: str) -> str:
        result = subprocess.run(
            [sys.executable, "-c", SECURE_CLIENT, str(server.grpc_inference_port),
             str(server.grpc_management_port), str(certs.ca),
             str(tmp_path / "torchserve_grpc_client.py"), *argv],
            capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    assert "Model echo2 registered successfully" in client("register", "echo2", "echo2.mar")
    assert "hello from TorchServe's client" in client("infer", "echo2", str(model_input))
    assert "Model echo2 unregistered successfully" in client("unregister", "echo2")


# -- a keystore, and refusals at start ----------------------------------------------------------


def test_a_pkcs12_keystore_serves_https(store: Path, certs: Certificates) -> None:
    running = launch_server(store, inference_address=HTTPS_ANY, keystore=certs.keystore,
                            keystore_pass=KEYSTORE_PASS, keystore_type="PKCS12",
                            enable_grpc=False)
    try:
        answer = requests.get(f"{_on(running.inference, 'localhost')}/ping",
                              verify=str(certs.ca), timeout=30)
        assert (answer.status_code, answer.json()) == (200, {"status": "Healthy"})
        assert running.management.startswith("http://")  # only the https:// address is TLS
        assert requests.get(f"{running.management}/models", timeout=30).status_code == 200
    finally:
        running.stop()


def _start(tmp_path: Path, store: Path, config: dict[str, object]
           ) -> subprocess.CompletedProcess[str]:
    """``torchserve --start --foreground`` with an https inference address and ``config``."""
    properties = tmp_path / "config.properties"
    properties.write_text("".join(f"{key}={value}\n" for key, value in {
        "inference_address": "https://127.0.0.1:0", "management_address": "http://127.0.0.1:0",
        "metrics_address": "http://127.0.0.1:0", "enable_grpc": "false",
        "log_location": tmp_path / "logs", **config}.items()))
    return subprocess.run(
        [str(Path(sys.executable).parent / "torchserve"), "--start", "--foreground",
         "--model-store", str(store), "--ts-config", str(properties), "--disable-token-auth"],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "BATCHSERVE_STATE_DIR": str(tmp_path / "state")})


def test_https_without_a_certificate_or_with_a_missing_one_refuses_to_start(
        tmp_path: Path, store: Path, certs: Certificates) -> None:
    """Both are configuration errors (exit code 2), said in one line naming the key."""
    none = _start(tmp_path, store, {})
    assert none.returncode == 2, none.stdout + none.stderr
    assert ("inference_address=https://127.0.0.1:0 asks for TLS, but no certificate is "
            "configured: set certificate_file and private_key_file") in none.stderr
    missing = tmp_path / "no-such-cert.pem"
    gone = _start(tmp_path, store, {"certificate_file": missing,
                                    "private_key_file": certs.key})
    assert gone.returncode == 2, gone.stdout + gone.stderr
    assert f"certificate_file {missing}: cannot read it: No such file" in gone.stdout
