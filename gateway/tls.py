"""`--ssl-*`: HTTPS on the gateway, checked before uvicorn starts so that a bad file is named, not traced."""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass


class TlsError(ValueError):
    """A TLS flag that cannot be used; the message names the flag."""


@dataclass(frozen=True)
class TlsOptions:
    certfile: str
    keyfile: str | None
    ca_certs: str | None
    cert_reqs: int

    def uvicorn_kwargs(self) -> dict[str, object]:
        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile, "ssl_ca_certs": self.ca_certs,
                "ssl_cert_reqs": self.cert_reqs}


def _readable(flag: str, path: str) -> None:
    if not os.path.isfile(path):
        raise TlsError(f"{flag} {path}: no such file")
    if not os.access(path, os.R_OK):
        raise TlsError(f"{flag} {path}: not readable")


def tls_options(certfile: str | None, keyfile: str | None, ca_certs: str | None, cert_reqs: int) -> TlsOptions | None:
    """The TLS settings, loaded once here exactly as uvicorn will load them; None for plain HTTP."""
    if certfile is None:
        for flag, value in (("--ssl-keyfile", keyfile), ("--ssl-ca-certs", ca_certs)):
            if value is not None:
                raise TlsError(f"{flag} needs --ssl-certfile (the server's certificate)")
        if cert_reqs:
            raise TlsError("--ssl-cert-reqs needs --ssl-certfile and --ssl-ca-certs")
        return None
    _readable("--ssl-certfile", certfile)
    if keyfile is not None:
        _readable("--ssl-keyfile", keyfile)
    if ca_certs is not None:
        _readable("--ssl-ca-certs", ca_certs)
    elif cert_reqs:
        raise TlsError(f"--ssl-cert-reqs {cert_reqs} needs --ssl-ca-certs to verify client certificates against")
    def no_password() -> str:
        # Without this OpenSSL would prompt on the terminal, and a service start would hang there.
        raise TlsError(f"--ssl-keyfile {keyfile or certfile}: the private key is encrypted; give an "
                       "unencrypted key (there is no flag for its password)")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile, no_password)
    except (ssl.SSLError, OSError) as error:
        flags = "--ssl-certfile/--ssl-keyfile" if keyfile else "--ssl-certfile (no --ssl-keyfile given)"
        raise TlsError(f"{flags}: cannot load the certificate and its private key: {error}") from None
    if ca_certs is not None:
        try:
            context.load_verify_locations(ca_certs)
        except (ssl.SSLError, OSError) as error:
            raise TlsError(f"--ssl-ca-certs {ca_certs}: cannot load CA certificates: {error}") from None
    return TlsOptions(certfile, keyfile, ca_certs, cert_reqs)
