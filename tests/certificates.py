"""Certificates made at test time: a CA, a server certificate for 127.0.0.1, and client certificates."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path  # signed by the CA
    client_key: Path
    stranger_cert: Path  # self-signed: no CA vouches for it
    stranger_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def _issue(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, issuer_key: ec.EllipticCurvePrivateKey,
           *, ca: bool = False, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_certificates(folder: Path) -> Certificates:
    def pem(cert: x509.Certificate, name: str) -> Path:
        path = folder / name
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("taco-llm test CA")
    ca = _issue("taco-llm test CA", ca_key, ca_name, ca_key, ca=True)
    server_key, client_key, stranger_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    # The server's certificate is signed by the CA too, so that it also passes as a client certificate:
    # `taco_llm serve` shows it to its own gateway when probing one that requires client certificates.
    server = _issue("127.0.0.1", server_key, ca_name, ca_key, server=True)
    client = _issue("client", client_key, ca_name, ca_key)
    stranger = _issue("stranger", stranger_key, _name("stranger"), stranger_key)
    return Certificates(
        ca=pem(ca, "ca.pem"),
        server_cert=pem(server, "server.pem"), server_key=_write_key(server_key, folder / "server.key"),
        client_cert=pem(client, "client.pem"), client_key=_write_key(client_key, folder / "client.key"),
        stranger_cert=pem(stranger, "stranger.pem"), stranger_key=_write_key(stranger_key, folder / "stranger.key"),
    )
