"""The server's TLS certificate, read once at start as TorchServe reads it.

From ``certificate_file`` (an X.509 chain, PEM or DER, the server's own certificate first) and
``private_key_file`` (PEM, unencrypted), or from ``keystore`` (PKCS12, opened with
``keystore_pass``; it wins when both are given, as in TorchServe). Every problem is a
``ConfigError`` naming the key and the file, raised before anything listens.

The certificate serves the ``https://`` HTTP listeners (``ssl_context``: TLS 1.2 or 1.3, the
ciphers of this Python's OpenSSL; TorchServe allows TLS 1.2 with two ciphers only) and the
gRPC listeners under ``enable_grpc_ssl`` (``key_pem``/``chain_pem``, which grpc takes as
bytes).
"""

from __future__ import annotations

import datetime
import logging
import secrets
import ssl
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from cryptography.hazmat.primitives.serialization import pkcs12

from frontend.config import ServerConfig, check_tls, tls_users
from frontend.errors import ConfigError

logger = logging.getLogger(__name__)

#: What HTTP is spoken over TLS (ALPN): HTTP/1.1 only, as on the plain ports.
ALPN = ["http/1.1"]
_PEM = serialization.Encoding.PEM


@dataclass(frozen=True, slots=True)
class ServerCertificate:
    """A private key and its certificate chain, in memory."""

    #: The key, PKCS8 PEM, unencrypted: it never leaves this process unencrypted.
    key_pem: bytes = field(repr=False)
    #: The chain, PEM, the server's own certificate first.
    chain_pem: bytes
    #: Where it was read from, for messages ("certificate_file x.pem, private_key_file ...").
    source: str

    def ssl_context(self) -> ssl.SSLContext:
        """A server-side context for the HTTPS listeners."""
        # OpenSSL reads a certificate and key only from files: they are written to a private
        # folder for the moment of loading, the key encrypted with a one-time passphrase.
        passphrase = secrets.token_bytes(32)
        key = serialization.load_pem_private_key(self.key_pem, password=None)
        encrypted = key.private_bytes(_PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.BestAvailableEncryption(passphrase))
        with tempfile.TemporaryDirectory(prefix="batchserve-tls-") as folder:
            chain_path, key_path = Path(folder) / "chain.pem", Path(folder) / "key.pem"
            chain_path.write_bytes(self.chain_pem)
            key_path.write_bytes(encrypted)
            context = _server_context()
            try:
                context.load_cert_chain(chain_path, key_path, password=passphrase)
            except ssl.SSLError as exc:
                if exc.reason not in ("EE_KEY_TOO_SMALL", "CA_KEY_TOO_SMALL", "CA_MD_TOO_WEAK"):
                    raise ConfigError(f"{self.source}: OpenSSL refuses it: {exc}") from None
                # A key (or signature) that OpenSSL's default security level calls too weak,
                # such as TorchServe's own 1024-bit test certificate: Java serves it, so it is
                # served here too, at the level that admits it, with a warning.
                logger.warning("TLS: %s: OpenSSL's default security level refuses it as too "
                               "weak (%s); served at security level 1, as TorchServe serves "
                               "it; clients may refuse it too: replace it with a 2048-bit RSA "
                               "or an EC key", self.source, exc.reason)
                context = _server_context(security_level=1)
                try:
                    context.load_cert_chain(chain_path, key_path, password=passphrase)
                except ssl.SSLError as again:
                    raise ConfigError(f"{self.source}: OpenSSL refuses it: {again}") from None
        return context


def _server_context(security_level: int | None = None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(ALPN)
    if security_level is not None:
        context.set_ciphers(f"DEFAULT:@SECLEVEL={security_level}")
    return context


def load_certificate(config: ServerConfig) -> ServerCertificate | None:
    """The certificate the configuration asks for, read and checked; None when nothing asks
    for TLS. Raises ConfigError naming the key and file that are wrong."""
    check_tls(config)
    if not tls_users(config):
        unused = [key for key in ("certificate_file", "private_key_file", "keystore")
                  if getattr(config, key) is not None]
        if unused:
            logger.info("TLS: %s set, but no address is https:// and enable_grpc_ssl is not "
                        "true: not used", ", ".join(unused))
        return None
    if config.keystore is not None:
        if config.certificate_file is not None or config.private_key_file is not None:
            logger.info("TLS: keystore is set: certificate_file and private_key_file are not "
                        "used (as TorchServe)")
        certificate = _from_keystore(config.keystore, config.keystore_pass)
    else:
        assert config.certificate_file is not None and config.private_key_file is not None
        certificate = _from_pem_files(config.certificate_file, config.private_key_file)
    logger.info("TLS on %s: %s", ", ".join(tls_users(config)), certificate.source)
    return certificate


def _read(key: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{key} {path}: cannot read it: {exc.strerror}") from None


def _from_pem_files(certificate_file: Path, private_key_file: Path) -> ServerCertificate:
    data = _read("certificate_file", certificate_file)
    try:
        chain = x509.load_pem_x509_certificates(data)
    except ValueError:
        try:
            chain = [x509.load_der_x509_certificate(data)]
        except ValueError:
            raise ConfigError(f"certificate_file {certificate_file}: not an X.509 certificate "
                              "(PEM or DER)") from None
    key_data = _read("private_key_file", private_key_file)
    try:
        key = serialization.load_pem_private_key(key_data, password=None)
    except TypeError:
        raise ConfigError(
            f"private_key_file {private_key_file} is encrypted; give the key unencrypted, as "
            f"TorchServe reads it (openssl pkey -in {private_key_file} -out key.pem asks for "
            "its passphrase once), and keep the file readable by this user only") from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"private_key_file {private_key_file}: not a PEM private key this "
                          f"server can use ({exc})") from None
    source = f"certificate_file {certificate_file}, private_key_file {private_key_file}"
    return _certificate(key, chain, source)


def _from_keystore(path: Path, password: str) -> ServerCertificate:
    data = _read("keystore", path)
    try:
        key, certificate, extra = pkcs12.load_key_and_certificates(data, password.encode())
    except ValueError:
        raise ConfigError(f"keystore {path}: cannot open it as PKCS12 with keystore_pass (a "
                          "wrong password, or not a PKCS12 file)") from None
    if key is None:
        raise ConfigError(f"keystore {path} holds no private key entry")
    if certificate is None:
        raise ConfigError(f"keystore {path} holds no certificate for its private key")
    return _certificate(key, [certificate, *extra], f"keystore {path} (PKCS12)")


def _certificate(key: PrivateKeyTypes, chain: list[x509.Certificate], source: str
                 ) -> ServerCertificate:
    """Check that ``key`` is the first certificate's, say when that certificate is out of
    its validity period (served all the same, as TorchServe does), and keep both as PEM."""
    leaf = chain[0]
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    if key.public_key().public_bytes(der, spki) != leaf.public_key().public_bytes(der, spki):
        raise ConfigError(f"{source}: the private key is not the key of the (first) "
                          f"certificate, {leaf.subject.rfc4514_string()}")
    now = datetime.datetime.now(datetime.timezone.utc)
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        logger.warning("TLS: %s: the certificate is valid from %s to %s, not now: clients "
                       "will refuse it", source, leaf.not_valid_before_utc,
                       leaf.not_valid_after_utc)
    key_pem = key.private_bytes(_PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return ServerCertificate(key_pem, b"".join(c.public_bytes(_PEM) for c in chain), source)
