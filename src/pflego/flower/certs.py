"""Certificates and SuperNode keys for a local deployment (TLS and node authentication).

For local use and tests only: a self-signed CA, a server certificate for ``localhost`` and
``127.0.0.1`` signed by it, and one EC P-384 key pair per SuperNode in OpenSSH format (the form
``flwr supernode register`` and ``flower-supernode --auth-supernode-private-key`` expect).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Credentials:
    """Paths of the files a secure local deployment uses."""

    directory: Path

    ca_cert = property(lambda self: self.directory / "ca.crt")
    server_cert = property(lambda self: self.directory / "server.pem")
    server_key = property(lambda self: self.directory / "server.key")

    def node_key(self, k: int) -> Path:
        """SuperNode k's private key (its public key is the same path plus ``.pub``)."""
        return self.directory / f"node{k}"

    def node_public_key(self, k: int) -> Path:
        return self.directory / f"node{k}.pub"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_private(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


def generate_tls(directory: str | Path, days: int = 30) -> Credentials:
    """A CA and a server certificate (SAN ``localhost``, ``IP:127.0.0.1``) in ``directory``."""
    creds = Credentials(Path(directory))
    creds.directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    valid_from, valid_to = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("pflego local CA"))
        .issuer_name(_name("pflego local CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid_from)
        .not_valid_after(valid_to)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca_cert.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid_from)
        .not_valid_after(valid_to)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    creds.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    creds.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(
        creds.server_key,
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        ),
    )
    return creds


def generate_node_keys(directory: str | Path, nodes: int) -> Credentials:
    """EC P-384 key pairs ``node0 .. node{nodes-1}`` (OpenSSH format) in ``directory``."""
    creds = Credentials(Path(directory))
    creds.directory.mkdir(parents=True, exist_ok=True)
    for k in range(nodes):
        key = ec.generate_private_key(ec.SECP384R1())
        _write_private(
            creds.node_key(k),
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.OpenSSH,
                serialization.NoEncryption(),
            ),
        )
        creds.node_public_key(k).write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            )
            + b"\n"
        )
    return creds


def generate(directory: str | Path, nodes: int, days: int = 30) -> Credentials:
    """TLS files and ``nodes`` SuperNode key pairs in ``directory``."""
    generate_tls(directory, days)
    return generate_node_keys(directory, nodes)
