"""Certificates made by the tests with the ``cryptography`` library: a CA, and a server
certificate it signed for ``localhost`` and ``127.0.0.1`` (subjectAltName), as files a
config.properties names (PEM, a PKCS12 keystore)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

PEM = serialization.Encoding.PEM
KEYSTORE_PASS = "changeit"  # TorchServe's documented (and default) keystore_pass


@dataclass(frozen=True)
class Certificates:
    """The files: ``ca`` (the CA's certificate, what clients trust), ``cert`` (the server's
    certificate then the CA's: a chain), ``key`` (its key, PKCS8 PEM), ``keystore`` (both,
    PKCS12, password ``KEYSTORE_PASS``)."""

    ca: Path
    cert: Path
    key: Path
    keystore: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: str, issuer: x509.Name, public_key: object, days: float,
             start_days: float) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(public_key)  # type: ignore[arg-type]
            .serial_number(x509.random_serial_number())
            .not_valid_before(now + datetime.timedelta(days=start_days))
            .not_valid_after(now + datetime.timedelta(days=start_days + days)))


def make_certificates(folder: Path, *, days: float = 2, start_days: float = -1,
                      server_key: CertificateIssuerPrivateKeyTypes | None = None
                      ) -> Certificates:
    """A CA and a server certificate (valid ``start_days`` from now for ``days``) in
    ``folder``; ``server_key`` instead of a fresh EC P-256 key."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (_builder("batchserve test CA", _name("batchserve test CA"), ca_key.public_key(),
                   days + 1, start_days - 1)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(
              digital_signature=True, key_cert_sign=True, crl_sign=True,
              content_commitment=False, key_encipherment=False, data_encipherment=False,
              key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = server_key if server_key is not None else ec.generate_private_key(ec.SECP256R1())
    cert = (_builder("localhost", ca.subject, key.public_key(), days, start_days)
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = Certificates(folder / "ca.pem", folder / "cert.pem", folder / "key.pem",
                         folder / "keystore.p12")
    files.ca.write_bytes(ca.public_bytes(PEM))
    files.cert.write_bytes(cert.public_bytes(PEM) + ca.public_bytes(PEM))
    files.key.write_bytes(key.private_bytes(PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))
    files.keystore.write_bytes(pkcs12.serialize_key_and_certificates(
        b"ts", key, cert, [ca],  # type: ignore[arg-type]
        serialization.BestAvailableEncryption(KEYSTORE_PASS.encode())))
    return files


def weak_rsa_key() -> rsa.RSAPrivateKey:
    """A 1024-bit RSA key, as in TorchServe's own test certificate (key.pem, certs.pem)."""
    return rsa.generate_private_key(public_exponent=65537, key_size=1024)
