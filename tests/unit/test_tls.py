"""TLS settings and certificates (frontend/config/checks.py's rules, frontend/tls.py's reading):
TorchServe's keys, its defaults, and a clear refusal of what cannot be served.

Certificates are made here (tests/certificates.py); a context is proved by a real TLS
handshake in memory against a client that trusts only the test's CA.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from frontend.config import Address, ServerConfig, build_config
from frontend.errors import ConfigError
from frontend.tls import load_certificate
from tests.certificates import KEYSTORE_PASS, Certificates, make_certificates, weak_rsa_key
from tests.torchserve_sources import MISSING, torchserve_file


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


def _config(**keys: object) -> ServerConfig:
    config, unknown = build_config({key: str(value) for key, value in keys.items()})
    assert unknown == []
    return config


def _pem(certs: Certificates, **keys: object) -> ServerConfig:
    """An https inference address with ``certs``' PEM files (``keys`` override them)."""
    return _config(**{"inference_address": "https://127.0.0.1:8443",
                      "certificate_file": certs.cert, "private_key_file": certs.key, **keys})


def _handshake(server: ssl.SSLContext, ca: Path | None, host: str = "localhost") -> str:
    """Run a TLS handshake in memory between ``server`` and a client that trusts ``ca`` (no
    verification when None); the negotiated protocol version."""
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca is None:
        client.check_hostname = False
        client.verify_mode = ssl.CERT_NONE
    else:
        client.load_verify_locations(ca)
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client_side = client.wrap_bio(to_client, to_server, server_hostname=host)
    server_side = server.wrap_bio(to_server, to_client, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for name, side in (("client", client_side), ("server", server_side)):
            if not done[name]:
                try:
                    side.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        if all(done.values()):
            version = client_side.version()
            assert version is not None
            return version
    raise AssertionError("the handshake did not finish")


# -- config.properties keys ------------------------------------------------------------------


def test_https_addresses_take_torchserve_default_ports_per_key_and_scheme(
        certs: Certificates) -> None:
    """TorchServe's Connector: without a port, inference 443, management 8444, metrics 8445
    over https (80, 8081, 8082 over http); the scheme in any case."""
    config = _config(inference_address="https://127.0.0.1", management_address="HTTPS://[::1]",
                     metrics_address="https://0.0.0.0", certificate_file=certs.cert,
                     private_key_file=certs.key)
    assert config.inference_address == Address("127.0.0.1", 443, is_tls=True)
    assert config.management_address == Address("::1", 8444, is_tls=True)
    assert config.metrics_address == Address("0.0.0.0", 8445, is_tls=True)
    assert str(config.management_address) == "https://[::1]:8444"
    plain = _config(inference_address="http://127.0.0.1", management_address="127.0.0.1",
                    metrics_address="http://127.0.0.1:9000")
    assert (plain.inference_address, plain.management_address, plain.metrics_address) == (
        Address("127.0.0.1", 80), Address("127.0.0.1", 8081), Address("127.0.0.1", 9000))
    assert str(plain.metrics_address) == "http://127.0.0.1:9000"


def test_the_tls_keys_are_torchserves_and_the_password_is_not_shown(
        certs: Certificates) -> None:
    config = _config(inference_address="https://127.0.0.1:8443", keystore=certs.keystore,
                     keystore_pass="s3cret", keystore_type="pkcs12", enable_grpc_ssl="true",
                     certificate_file=certs.cert, private_key_file=certs.key)
    assert (config.keystore, config.keystore_pass, config.enable_grpc_ssl) == (
        certs.keystore, "s3cret", True)
    assert "s3cret" not in repr(config)
    assert _config().keystore_pass == "changeit" and not _config().enable_grpc_ssl


@pytest.mark.parametrize(("keys", "expected"), [
    ({"inference_address": "https://127.0.0.1:8443"},
     "inference_address=https://127.0.0.1:8443 asks for TLS, but no certificate is configured"),
    ({"metrics_address": "https://127.0.0.1:8445"}, "metrics_address=https://127.0.0.1:8445"),
    ({"enable_grpc_ssl": "true"}, "enable_grpc_ssl=true asks for TLS, but no certificate"),
    ({"management_address": "https://127.0.0.1:8444", "certificate_file": "cert.pem"},
     "certificate_file is set, but private_key_file is not"),
    ({"enable_grpc_ssl": "true", "private_key_file": "key.pem"},
     "private_key_file is set, but certificate_file is not"),
    ({"inference_address": "https://127.0.0.1:8443", "keystore": "keystore.jks",
      "keystore_type": "JKS"},
     "keytool -importkeystore -srckeystore keystore.jks -srcstoretype JKS -destkeystore "
     "keystore.p12 -deststoretype PKCS12"),
    ({"inference_address": "https://127.0.0.1:8443", "keystore": "k.bks",
      "keystore_type": "BKS"}, "keystore_type='BKS': expected PKCS12"),
    ({"inference_address": "https://127.0.0.1:8080", "management_address":
      "http://127.0.0.1:8080", "certificate_file": "c", "private_key_file": "k"},
     "are one listener: give them the same scheme"),
])
def test_what_asks_for_tls_without_a_usable_certificate_is_refused_by_name(
        keys: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError) as refused:
        build_config(keys)
    assert expected in str(refused.value)


def test_tls_keys_without_https_or_grpc_ssl_are_not_read(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    """As TorchServe: a certificate nothing uses is not read (nor refused when missing);
    enable_grpc_ssl means nothing while gRPC is off."""
    config = _config(certificate_file="/nonexistent/cert.pem", private_key_file="/none/key",
                     enable_grpc="false", enable_grpc_ssl="true")
    with caplog.at_level(logging.INFO, "frontend.tls"):
        assert load_certificate(config) is None
    assert "certificate_file, private_key_file set, but no address is https://" in caplog.text


# -- reading the certificate -------------------------------------------------------------------


def test_pem_files_serve_the_chain_a_client_verifies(certs: Certificates) -> None:
    certificate = load_certificate(_pem(certs))
    assert certificate is not None
    assert certificate.chain_pem.count(b"BEGIN CERTIFICATE") == 2
    assert certificate.key_pem.startswith(b"-----BEGIN PRIVATE KEY")
    assert "key_pem" not in repr(certificate)
    context = certificate.ssl_context()
    assert _handshake(context, certs.ca, "localhost") in ("TLSv1.2", "TLSv1.3")
    assert _handshake(context, certs.ca, "127.0.0.1") in ("TLSv1.2", "TLSv1.3")
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(context, certs.ca, "elsewhere.example")


def test_a_pkcs12_keystore_serves_and_wins_over_pem_files(certs: Certificates) -> None:
    certificate = load_certificate(_config(
        metrics_address="https://127.0.0.1:8445", keystore=certs.keystore,
        keystore_pass=KEYSTORE_PASS, certificate_file="/nonexistent.pem",
        private_key_file="/nonexistent.key"))
    assert certificate is not None and "(PKCS12)" in certificate.source
    assert _handshake(certificate.ssl_context(), certs.ca) in ("TLSv1.2", "TLSv1.3")


def test_a_wrong_keystore_password_or_a_keystore_without_a_key_is_named(
        certs: Certificates, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot open it as PKCS12 with keystore_pass"):
        load_certificate(_config(enable_grpc_ssl="true", keystore=certs.keystore,
                                 keystore_pass="wrong"))
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import pkcs12

    only_ca = tmp_path / "ca-only.p12"
    only_ca.write_bytes(pkcs12.serialize_key_and_certificates(
        None, None, None, [x509.load_pem_x509_certificate(certs.ca.read_bytes())],
        serialization.BestAvailableEncryption(b"changeit")))
    with pytest.raises(ConfigError, match="holds no private key entry"):
        load_certificate(_config(enable_grpc_ssl="true", keystore=only_ca))


def test_files_that_cannot_be_served_stop_the_start_naming_key_and_file(
        certs: Certificates, tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    with pytest.raises(ConfigError, match=f"certificate_file {missing}: cannot read it: No such"):
        load_certificate(_pem(certs, certificate_file=missing))
    not_pem = tmp_path / "notes.txt"
    not_pem.write_text("hello\n")
    with pytest.raises(ConfigError, match=f"certificate_file {not_pem}: not an X.509"):
        load_certificate(_pem(certs, certificate_file=not_pem))
    with pytest.raises(ConfigError, match=f"private_key_file {not_pem}: not a PEM private key"):
        load_certificate(_pem(certs, private_key_file=not_pem))
    encrypted = tmp_path / "encrypted.pem"
    key = serialization.load_pem_private_key(certs.key.read_bytes(), None)
    encrypted.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pass")))
    with pytest.raises(ConfigError, match=f"private_key_file {encrypted} is encrypted"):
        load_certificate(_pem(certs, private_key_file=encrypted))
    other = make_certificates(tmp_path / "other")
    with pytest.raises(ConfigError, match="the private key is not the key of the"):
        load_certificate(_pem(certs, private_key_file=other.key))


def test_a_der_certificate_is_read_as_torchserve_reads_it(certs: Certificates,
                                                          tmp_path: Path) -> None:
    from cryptography import x509

    der = tmp_path / "cert.der"
    der.write_bytes(x509.load_pem_x509_certificate(certs.cert.read_bytes()).public_bytes(
        serialization.Encoding.DER))
    certificate = load_certificate(_pem(certs, certificate_file=der))
    assert certificate is not None
    assert _handshake(certificate.ssl_context(), certs.ca) in ("TLSv1.2", "TLSv1.3")


def test_an_expired_certificate_is_served_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    expired = make_certificates(tmp_path, days=1, start_days=-3)
    with caplog.at_level(logging.WARNING, "frontend.tls"):
        certificate = load_certificate(_pem(expired))
    assert certificate is not None
    assert "the certificate is valid from" in caplog.text and "not now" in caplog.text
    with pytest.raises(ssl.SSLCertVerificationError, match="expired"):
        _handshake(certificate.ssl_context(), expired.ca)


def test_a_1024_bit_key_is_served_as_torchserve_serves_it_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """TorchServe's own test certificate has a 1024-bit RSA key, which OpenSSL's default
    security level refuses to load; Java serves it, so it is served, and said."""
    weak = make_certificates(tmp_path, server_key=weak_rsa_key())
    certificate = load_certificate(_pem(weak))
    assert certificate is not None
    with caplog.at_level(logging.WARNING, "frontend.tls"):
        context = certificate.ssl_context()
    assert "EE_KEY_TOO_SMALL" in caplog.text and "2048-bit" in caplog.text
    assert _handshake(context, None) in ("TLSv1.2", "TLSv1.3")


def test_torchserves_own_test_certificate_and_keystore_are_served(tmp_path: Path) -> None:
    """TorchServe's test resources (frontend/server/src/test/resources: certs.pem, key.pem,
    keystore.p12 with keystore_pass changeit), as its test config.properties names them."""
    resources = "frontend/server/src/test/resources"
    files = {name: torchserve_file(f"{resources}/{name}")
             for name in ("certs.pem", "key.pem", "keystore.p12")}
    for name, data in files.items():
        if data is None:
            pytest.skip(MISSING)
        (tmp_path / name).write_bytes(data)
    for keys in ({"certificate_file": tmp_path / "certs.pem",
                  "private_key_file": tmp_path / "key.pem"},
                 {"keystore": tmp_path / "keystore.p12", "keystore_pass": "changeit",
                  "keystore_type": "PKCS12"}):
        certificate = load_certificate(_config(inference_address="https://127.0.0.1:8443",
                                               **keys))
        assert certificate is not None
        assert _handshake(certificate.ssl_context(), None) in ("TLSv1.2", "TLSv1.3")
