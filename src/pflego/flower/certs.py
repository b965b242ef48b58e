"""Certificates and SuperNode keys for a local deployment (TLS and node authentication).

A self-signed CA, a server certificate signed by it for the names the nodes reach the SuperLink
by (``localhost`` and ``127.0.0.1`` by default; a deployment's host name or address with
``pflego flower certs --server-name``), and one EC P-384 key pair per SuperNode in OpenSSH format (the form
``flwr supernode register`` and ``flower-supernode --auth-supernode-private-key`` expect).
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def _write_private(path: Path, key: Any, private_format: serialization.PrivateFormat) -> None:
    """Write a private key unencrypted, readable by its owner only."""
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, private_format, serialization.NoEncryption())
    )
    path.chmod(0o600)


#: The names a local server certificate is valid for.
LOCAL_NAMES = ("localhost", "127.0.0.1")


def subject_names(names: Sequence[str]) -> list[x509.GeneralName]:
    """SAN entries: an IP address where a name parses as one, else a DNS name."""
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return entries


def generate(
    directory: str | Path, nodes: int, days: int = 30, names: Sequence[str] = LOCAL_NAMES
) -> Credentials:
    """A CA, a server certificate for ``names`` (host names or IP addresses the nodes use to
    reach the SuperLink; default ``localhost`` and ``127.0.0.1``) and ``nodes`` SuperNode key
    pairs ``node0 .. node{nodes-1}`` (EC P-384, OpenSSH format) in ``directory``."""
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
        .subject_name(_name(names[0]))
        .issuer_name(ca_cert.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid_from)
        .not_valid_after(valid_to)
        .add_extension(
            x509.SubjectAlternativeName(subject_names(names)),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    creds.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    creds.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(creds.server_key, server_key, serialization.PrivateFormat.TraditionalOpenSSL)
    for k in range(nodes):
        key = ec.generate_private_key(ec.SECP384R1())
        _write_private(creds.node_key(k), key, serialization.PrivateFormat.OpenSSH)
        creds.node_public_key(k).write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            )
            + b"\n"
        )
    return creds
