"""Keys and TLS on the gRPC hops between the gateway, the engine workers and the cache service.

One module for all three services (it imports neither torch nor vLLM):
- ServerTls / ClientTls: TLS or mutual TLS from PEM files, checked at start-up so that a bad file is named
  by its flag, not met at the first handshake;
- add_port: listen with TLS when it is configured, in plain text otherwise;
- ApiKeyInterceptor: a server's `--api-key`, compared in constant time and never logged;
- CacheServiceClient: how a worker reaches the cache service (key and TLS). vLLM builds the cache
  service's clients inside its own engine processes, which inherit only the environment, so the front
  process exports these settings as JSON in CACHE_SERVICE_CLIENT_VAR (a key must not go into vLLM's
  config, which vLLM logs).

A client checks the server's certificate against the address it dials: a certificate must carry that
address (the worker's --grpc-host or its registry advertise address, the cache service's host) as a
subject alternative name; no target-name override is offered.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import ssl
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from taco_llm.protos import rich_status
from taco_llm.protos.rich_status import Reason

API_KEY_METADATA = "authorization"
# Probes and load balancers ask the health service without a key.
OPEN_SERVICE_PREFIXES = ("/grpc.health.v1.Health/",)
CACHE_SERVICE_CLIENT_VAR = "TACO_LLM_CACHE_SERVICE_CLIENT"


class SecurityConfigError(ValueError):
    """A key or TLS flag that cannot be used; the message names the flag."""


def _read(flag: str, path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as error:
        raise SecurityConfigError(f"{flag} {path}: cannot read it ({error.strerror})") from None


def _no_password() -> str:
    # Without this OpenSSL would prompt on the terminal, and a service start would hang there.
    raise SecurityConfigError("the private key is encrypted; give an unencrypted key")


def _check_pair(cert_flag: str, certfile: str, key_flag: str, keyfile: str) -> None:
    """The certificate and its private key load, and belong together (OpenSSL checks that)."""
    _read(cert_flag, certfile)
    _read(key_flag, keyfile)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(certfile, keyfile, _no_password)
    except SecurityConfigError as error:
        raise SecurityConfigError(f"{key_flag} {keyfile}: {error}") from None
    except (ssl.SSLError, OSError) as error:
        raise SecurityConfigError(f"{cert_flag}/{key_flag}: not a PEM certificate and the private key that "
                                  f"belongs to it ({error})") from None


def _check_ca(flag: str, path: str) -> None:
    _read(flag, path)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except (ssl.SSLError, OSError) as error:
        raise SecurityConfigError(f"{flag} {path}: not PEM CA certificates ({error})") from None


@dataclass(frozen=True)
class ServerTls:
    """A server's TLS: its certificate chain and key; with client_ca, mutual TLS (clients must present a
    certificate that CA signed)."""

    certfile: str
    keyfile: str
    client_ca: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        client_ca = _read("client CA", self.client_ca) if self.client_ca else None
        return grpc.ssl_server_credentials([(_read("key", self.keyfile), _read("certificate", self.certfile))],
                                           root_certificates=client_ca, require_client_auth=client_ca is not None)


@dataclass(frozen=True)
class ClientTls:
    """A client's TLS: the CA the server's certificate must chain to (None: the system's roots), and
    the client's own certificate and key, for a server that requires one."""

    ca: str | None = None
    certfile: str | None = None
    keyfile: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        def optional(path: str | None) -> bytes | None:
            return _read("TLS file", path) if path else None

        return grpc.ssl_channel_credentials(root_certificates=optional(self.ca), private_key=optional(self.keyfile),
                                            certificate_chain=optional(self.certfile))


def server_tls(certfile: str | None, keyfile: str | None, client_ca: str | None, *,
               prefix: str = "--grpc-tls") -> ServerTls | None:
    """ServerTls from `{prefix}-certfile`, `-keyfile` and `-client-ca`, each file checked now; None: plain text."""
    cert_flag, key_flag, ca_flag = f"{prefix}-certfile", f"{prefix}-keyfile", f"{prefix}-client-ca"
    if certfile is None and keyfile is None:
        if client_ca is not None:
            raise SecurityConfigError(f"{ca_flag} needs {cert_flag} and {key_flag} (mutual TLS is TLS first)")
        return None
    if certfile is None or keyfile is None:
        raise SecurityConfigError(f"{cert_flag} and {key_flag} go together: give both, or neither")
    _check_pair(cert_flag, certfile, key_flag, keyfile)
    if client_ca is not None:
        _check_ca(ca_flag, client_ca)
    return ServerTls(certfile, keyfile, client_ca)


def client_tls(ca: str | None, certfile: str | None, keyfile: str | None, *, ca_flag: str, cert_flag: str,
               key_flag: str) -> ClientTls | None:
    """ClientTls from its three flags, each file checked now; None when none is given (plain text)."""
    if (certfile is None) != (keyfile is None):
        raise SecurityConfigError(f"{cert_flag} and {key_flag} go together: give both, or neither")
    if ca is None and certfile is None:
        return None
    if ca is not None:
        _check_ca(ca_flag, ca)
    if certfile is not None and keyfile is not None:
        _check_pair(cert_flag, certfile, key_flag, keyfile)
    return ClientTls(ca, certfile, keyfile)


SERVER_TLS_FLAGS = ("--grpc-tls-certfile", "--grpc-tls-keyfile", "--grpc-tls-client-ca")
CACHE_SERVICE_CLIENT_FLAGS = ("--cache-service-api-key", "--cache-service-tls-ca", "--cache-service-tls-certfile",
                              "--cache-service-tls-keyfile")


def serve_refusals(worker_flags: Sequence[str], *, starts_cache_service: bool) -> list[str]:
    """`taco_llm serve` hands flags it does not know to its workers; these would cut its own plain-text hops
    on 127.0.0.1 (its gateway and its health probe dial the workers without TLS; the cache service it starts
    has no TLS and gets serve's key)."""
    given = {arg.split("=", 1)[0] for arg in worker_flags}
    refusals = [f"{flag}: serve's own gRPC hops run on 127.0.0.1 without TLS; for TLS between the services "
                "start taco_llm worker, gateway and cache-service yourself (docs/grpc.md)"
                for flag in SERVER_TLS_FLAGS if flag in given]
    if starts_cache_service:
        refusals += [f"{flag}: the cache service serve starts runs without TLS and takes serve's --api-key; "
                     "name a cache service of your own with --cache-service HOST:PORT"
                     for flag in CACHE_SERVICE_CLIENT_FLAGS if flag in given]
    return refusals


def add_server_tls_args(parser: argparse.ArgumentParser, service: str) -> None:
    """--grpc-tls-certfile, --grpc-tls-keyfile and --grpc-tls-client-ca of a gRPC server (`service` names it
    in the help)."""
    group = parser.add_argument_group(f"TLS on the {service}'s gRPC port")
    group.add_argument("--grpc-tls-certfile", default=None, metavar="PEM",
                       help="serve gRPC over TLS with this certificate (chain); it must name the address "
                       "clients dial (as a subject alternative name) (default: none, plain text)")
    group.add_argument("--grpc-tls-keyfile", default=None, metavar="PEM",
                       help="the unencrypted private key of --grpc-tls-certfile (default: none)")
    group.add_argument("--grpc-tls-client-ca", default=None, metavar="PEM",
                       help="mutual TLS: clients must present a certificate signed by this CA (default: none, "
                       "no client certificate asked for)")


def server_tls_from_args(args: argparse.Namespace) -> ServerTls | None:
    return server_tls(args.grpc_tls_certfile, args.grpc_tls_keyfile, args.grpc_tls_client_ca)


def add_port(server: grpc.aio.Server, address: str, tls: ServerTls | None) -> int:
    """Listens on address, with TLS when it is configured; the bound port (RuntimeError: cannot bind)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.credentials())


def aio_channel(address: str, tls: ClientTls | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.credentials(), options=list(options))


# --- API keys ------------------------------------------------------------------------------------


def bearer_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends for a server's --api-key (nothing without one)."""
    return ((API_KEY_METADATA, f"Bearer {api_key}"),) if api_key else ()


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes | None:
    for key, value in metadata or ():
        if key == API_KEY_METADATA:
            raw = value if isinstance(value, bytes) else value.encode()
            scheme, _, token = raw.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


def key_matches(token: bytes | None, expected: Sequence[bytes]) -> bool:
    """Whether token is one of the expected keys. Every key is compared, each with compare_digest, so the
    time taken tells neither how much of a guess was right nor which key it came close to."""
    if token is None:
        return False
    # Digests of equal length: compare_digest on the raw keys would return at once for a guess of another
    # length, which tells the key's length.
    guess = hashlib.sha256(token).digest()
    found = False
    for key in expected:
        found |= hmac.compare_digest(guess, hashlib.sha256(key).digest())
    return found


def _denying(handler: grpc.RpcMethodHandler, deny: Callable[[Any, grpc.aio.ServicerContext], Awaitable[None]],
             ) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call before the servicer runs."""
    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    return grpc.stream_stream_rpc_method_handler(deny, **kwargs)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every call but the health service's must carry `authorization: Bearer KEY`; else UNAUTHENTICATED,
    naming the metadata field and the flag (never the key)."""

    def __init__(self, api_keys: str | Sequence[str], *, flag: str):
        keys = [api_keys] if isinstance(api_keys, str) else list(api_keys)
        if not keys or not all(keys):
            raise ValueError(f"{flag}: an empty key would let everyone in")
        self.expected = [key.encode() for key in keys]
        self.denied = (f"missing or invalid API key: send metadata '{API_KEY_METADATA}: Bearer <key>' "
                       f"({flag})")

    def allows(self, details: grpc.HandlerCallDetails) -> bool:
        if details.method.startswith(OPEN_SERVICE_PREFIXES):
            return True
        return key_matches(bearer_token(details.invocation_metadata), self.expected)

    async def _deny(self, _request: Any, context: grpc.aio.ServicerContext) -> None:
        await rich_status.abort(context, grpc.StatusCode.UNAUTHENTICATED, self.denied, Reason.API_KEY_INVALID,
                                API_KEY_METADATA)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or self.allows(handler_call_details):
            return handler
        return _denying(handler, self._deny)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str]]):
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class _KeyClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                            grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the key to every call of a synchronous channel (the cache service's clients are synchronous:
    they run on vLLM's engine-core threads)."""

    def __init__(self, api_key: str):
        self._metadata = bearer_metadata(api_key)

    def _with_key(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details, [*(details.metadata or ()), *self._metadata])

    def intercept_unary_unary(self, continuation: Any, client_call_details: grpc.ClientCallDetails,
                              request: Any) -> Any:
        return continuation(self._with_key(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: grpc.ClientCallDetails,
                               request: Any) -> Any:
        return continuation(self._with_key(client_call_details), request)

    def intercept_stream_unary(self, continuation: Any, client_call_details: grpc.ClientCallDetails,
                               request_iterator: Any) -> Any:
        return continuation(self._with_key(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, client_call_details: grpc.ClientCallDetails,
                                request_iterator: Any) -> Any:
        return continuation(self._with_key(client_call_details), request_iterator)


# --- the worker as the cache service's client --------------------------------------------------


@dataclass(frozen=True)
class CacheServiceClient:
    """How a worker reaches the cache service: --cache-service-api-key and --cache-service-tls-*."""

    api_key: str | None = None
    tls: ClientTls | None = None

    def __repr__(self) -> str:  # never the key, wherever this ends up printed
        return f"CacheServiceClient(api_key={'set' if self.api_key else None}, tls={self.tls!r})"

    def export(self) -> None:
        """Hands the settings to vLLM's engine processes, which the front process starts later."""
        if self.api_key is None and self.tls is None:
            os.environ.pop(CACHE_SERVICE_CLIENT_VAR, None)
            return
        os.environ[CACHE_SERVICE_CLIENT_VAR] = json.dumps(
            {"api_key": self.api_key, "tls": asdict(self.tls) if self.tls else None})

    @classmethod
    def from_environment(cls) -> CacheServiceClient:
        text = os.environ.get(CACHE_SERVICE_CLIENT_VAR)
        if not text:
            return cls()
        settings = json.loads(text)
        tls = settings.get("tls")
        return cls(settings.get("api_key"), ClientTls(**tls) if tls else None)

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A synchronous channel to the cache service, with TLS and the key as configured."""
        if self.tls is None:
            channel = grpc.insecure_channel(address, options=list(options))
        else:
            channel = grpc.secure_channel(address, self.tls.credentials(), options=list(options))
        if self.api_key:
            return grpc.intercept_channel(channel, _KeyClientInterceptor(self.api_key))
        return channel


def add_cache_service_client_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the worker as the cache service's client: key and TLS")
    group.add_argument("--cache-service-api-key", default=None, metavar="KEY",
                       help="sent as 'authorization: Bearer KEY' to a cache service started with --api-key "
                       "(default: none)")
    group.add_argument("--cache-service-tls-ca", default=None, metavar="PEM",
                       help="reach the cache service over TLS, checking its certificate against this CA "
                       "(default: none, plain text)")
    group.add_argument("--cache-service-tls-certfile", default=None, metavar="PEM",
                       help="the worker's client certificate, for a cache service that requires one "
                       "(--grpc-tls-client-ca there) (default: none)")
    group.add_argument("--cache-service-tls-keyfile", default=None, metavar="PEM",
                       help="the unencrypted private key of --cache-service-tls-certfile (default: none)")


def cache_service_client_from_args(args: argparse.Namespace) -> CacheServiceClient:
    given = [f"--{name.replace('_', '-')}" for name in ("cache_service_api_key", "cache_service_tls_ca",
                                                        "cache_service_tls_certfile", "cache_service_tls_keyfile")
             if getattr(args, name) is not None]
    if given and getattr(args, "cache_service", None) is None:
        raise SecurityConfigError(f"{', '.join(given)}: needs --cache-service HOST:PORT (the cache service "
                                  "these settings reach)")
    return cache_service_client(args.cache_service_api_key, args.cache_service_tls_ca,
                                args.cache_service_tls_certfile, args.cache_service_tls_keyfile)


def cache_service_client(api_key: str | None, ca: str | None, certfile: str | None,
                         keyfile: str | None) -> CacheServiceClient:
    """From the worker's --cache-service-api-key and --cache-service-tls-{ca,certfile,keyfile}."""
    if api_key is not None and not api_key:
        raise SecurityConfigError("--cache-service-api-key is empty")
    tls = client_tls(ca, certfile, keyfile, ca_flag="--cache-service-tls-ca",
                     cert_flag="--cache-service-tls-certfile", key_flag="--cache-service-tls-keyfile")
    return CacheServiceClient(api_key, tls)
