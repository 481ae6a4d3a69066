"""Certificates the tests make (the `cryptography` package): a CA, a server certificate for localhost and
127.0.0.1 signed by it, client certificates, and the files layerserve and the clients read."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Authority:
    """A CA that signs certificates: its own certificate's file, and what it signs with."""

    name: str
    cert_file: Path
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    def issue(self, folder: Path, name: str, *, client: bool = False, password: bytes | None = None) -> Issued:
        """A certificate for `name` (a server's for localhost and 127.0.0.1, or a client's), signed by this CA."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if not client:
            names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        issued = Issued(folder / f"{name}.crt", folder / f"{name}.key")
        issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        issued.key.write_bytes(_key_pem(key, password))
        return issued

    def client_context(self, client: Issued | None = None) -> ssl.SSLContext:
        """A client's context that trusts this CA (and presents `client`'s certificate)."""
        context = ssl.create_default_context(cafile=str(self.cert_file))
        if client is not None:
            context.load_cert_chain(client.cert, client.key)
        return context


_CA_USAGE = x509.KeyUsage(
    digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
    key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
)  # fmt: skip


def make_authority(folder: Path, name: str = "test-ca") -> Authority:
    """A self-signed CA whose certificate is written to `folder/<name>.crt`."""
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_file = folder / f"{name}.crt"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Authority(name, cert_file, key, cert)


def _key_pem(key: ec.EllipticCurvePrivateKey, password: bytes | None) -> bytes:
    encryption = (
        serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    )  # fmt: skip
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
