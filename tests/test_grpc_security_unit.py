"""taco_llm/grpc_security.py: start-up checks of the TLS flags, the key check, and TLS / mutual TLS on an
in-process grpc.aio server (the health service and an echo method). Certificates are made here."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from taco_llm import grpc_security
from taco_llm.cache_service import config as cache_config
from taco_llm.grpc_security import (
    CACHE_SERVICE_CLIENT_VAR,
    ApiKeyInterceptor,
    CacheServiceClient,
    ClientTls,
    SecurityConfigError,
    ServerTls,
)
from taco_llm.protos import rich_status
from taco_llm.protos.rich_status import Reason

from .certificates import Certificates, make_certificates

KEY = "unit-test-key"
ECHO = "/taco_llm.test.Echo/Echo"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


# --- start-up checks -----------------------------------------------------------------------------


def test_server_tls_checks_each_file_and_names_its_flag(certs: Certificates, tmp_path: Path) -> None:
    tls = grpc_security.server_tls(str(certs.server_cert), str(certs.server_key), str(certs.ca))
    assert tls == ServerTls(str(certs.server_cert), str(certs.server_key), str(certs.ca))
    assert grpc_security.server_tls(None, None, None) is None
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    unreadable = tmp_path / "unreadable.pem"
    unreadable.write_bytes(certs.ca.read_bytes())
    unreadable.chmod(0)
    cases = {
        "--grpc-tls-certfile": (str(tmp_path / "absent.pem"), str(certs.server_key), None),
        "--grpc-tls-keyfile": (str(certs.server_cert), str(tmp_path / "absent.key"), None),
        "--grpc-tls-client-ca": (str(certs.server_cert), str(certs.server_key), str(garbage)),
        "--grpc-tls-certfile/--grpc-tls-keyfile": (str(certs.server_cert), str(certs.stranger_key), None),
        "--grpc-tls-certfile and --grpc-tls-keyfile": (str(certs.server_cert), None, None),
        "--grpc-tls-client-ca needs": (None, None, str(certs.ca)),
    }
    if os.geteuid() != 0:  # root reads any file
        cases["--grpc-tls-client-ca " + str(unreadable)] = (str(certs.server_cert), str(certs.server_key),
                                                             str(unreadable))
    for flag, (certfile, keyfile, client_ca) in cases.items():
        with pytest.raises(SecurityConfigError) as error:
            grpc_security.server_tls(certfile, keyfile, client_ca)
        assert str(error.value).startswith(flag), (flag, str(error.value))


def test_client_tls_checks_its_files_and_pairs(certs: Certificates, tmp_path: Path) -> None:
    names = {"ca_flag": "--x-ca", "cert_flag": "--x-certfile", "key_flag": "--x-keyfile"}
    assert grpc_security.client_tls(None, None, None, **names) is None
    assert grpc_security.client_tls(str(certs.ca), None, None, **names) == ClientTls(str(certs.ca))
    with pytest.raises(SecurityConfigError, match=r"^--x-certfile and --x-keyfile go together"):
        grpc_security.client_tls(str(certs.ca), str(certs.client_cert), None, **names)
    with pytest.raises(SecurityConfigError, match=r"^--x-ca "):
        grpc_security.client_tls(str(tmp_path / "absent.pem"), None, None, **names)
    with pytest.raises(SecurityConfigError, match=r"^--x-certfile/--x-keyfile"):
        grpc_security.client_tls(str(certs.ca), str(certs.client_cert), str(certs.stranger_key), **names)


def test_cache_service_refuses_a_bad_tls_file_or_empty_key_naming_the_flag(
        certs: Certificates, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--memory", "1M", "--grpc-tls-certfile", str(tmp_path / "absent.pem"), "--grpc-tls-keyfile",
            str(certs.server_key)]
    with pytest.raises(SystemExit) as exited:
        cache_config.parse(argv)
    assert exited.value.code != 0
    assert "--grpc-tls-certfile" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cache_config.parse(["--memory", "1M", "--api-key", ""])
    assert "--api-key is empty" in capsys.readouterr().err
    config = cache_config.parse(["--memory", "1M", "--api-key", KEY, "--grpc-tls-certfile", str(certs.server_cert),
                                 "--grpc-tls-keyfile", str(certs.server_key)])
    assert config.grpc_tls is not None and config.grpc_tls.client_ca is None
    assert KEY not in repr(config), "the key must stay out of anything that logs the config"


def test_gateway_refuses_a_bad_engine_tls_file_naming_the_flag(
        certs: Certificates, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from taco_llm.gateway.__main__ import parse

    with pytest.raises(SystemExit) as exited:
        parse(["--engine", "127.0.0.1:1", "--engine-tls-ca", str(tmp_path / "absent.pem")])
    assert exited.value.code != 0
    assert "--engine-tls-ca" in capsys.readouterr().err
    settings = parse(["--engine", "127.0.0.1:1", "--engine-tls-ca", str(certs.ca), "--engine-tls-certfile",
                      str(certs.client_cert), "--engine-tls-keyfile", str(certs.client_key)])
    assert settings.engine_tls == ClientTls(str(certs.ca), str(certs.client_cert), str(certs.client_key))


# --- keys ----------------------------------------------------------------------------------------


def test_key_check() -> None:
    expected = [b"alpha", b"beta"]
    assert grpc_security.key_matches(b"beta", expected)
    assert not grpc_security.key_matches(b"bet", expected)
    assert not grpc_security.key_matches(None, expected)
    assert not grpc_security.key_matches(b"", expected)
    assert grpc_security.bearer_token([("authorization", "Bearer abc ")]) == b"abc"
    assert grpc_security.bearer_token([("authorization", "Basic abc")]) is None
    assert grpc_security.bearer_token([("x-other", "Bearer abc")]) is None
    with pytest.raises(ValueError, match="--api-key"):
        ApiKeyInterceptor("", flag="--api-key")


@pytest.fixture
def client_environment() -> Iterator[None]:
    saved = os.environ.pop(CACHE_SERVICE_CLIENT_VAR, None)
    yield
    os.environ.pop(CACHE_SERVICE_CLIENT_VAR, None)
    if saved is not None:
        os.environ[CACHE_SERVICE_CLIENT_VAR] = saved


def test_cache_service_client_crosses_the_environment_and_hides_its_key(
        certs: Certificates, client_environment: None) -> None:
    client = grpc_security.cache_service_client(KEY, str(certs.ca), str(certs.client_cert), str(certs.client_key))
    assert KEY not in repr(client)
    client.export()
    assert CacheServiceClient.from_environment() == client
    CacheServiceClient().export()
    assert CACHE_SERVICE_CLIENT_VAR not in os.environ, "a stale setting must not reach the engine"
    assert CacheServiceClient.from_environment() == CacheServiceClient()


# --- a real in-process server --------------------------------------------------------------------


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


@contextlib.asynccontextmanager
async def serving(tls: ServerTls | None, api_key: str | None = None) -> AsyncIterator[str]:
    interceptors = [ApiKeyInterceptor(api_key, flag="the test's --api-key")] if api_key else None
    server = grpc.aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "taco_llm.test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)})])
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = grpc_security.add_port(server, "127.0.0.1:0", tls)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)


async def _check(address: str, tls: ClientTls | None) -> grpc.StatusCode:
    async with grpc_security.aio_channel(address, tls) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def test_mutual_tls_lets_in_only_certificates_the_ca_signed(certs: Certificates) -> None:
    mutual = ServerTls(str(certs.server_cert), str(certs.server_key), str(certs.ca))
    async with serving(mutual) as address:
        assert await _check(address, ClientTls(str(certs.ca), str(certs.client_cert), str(certs.client_key))) \
            == grpc.StatusCode.OK
        for refused in (None, ClientTls(str(certs.ca)),
                        ClientTls(str(certs.ca), str(certs.stranger_cert), str(certs.stranger_key))):
            assert await _check(address, refused) == grpc.StatusCode.UNAVAILABLE, refused


async def test_tls_client_checks_the_servers_certificate(certs: Certificates) -> None:
    # A server whose certificate no CA we trust vouches for: the client refuses it.
    stranger = ServerTls(str(certs.stranger_cert), str(certs.stranger_key))
    async with serving(stranger) as address:
        assert await _check(address, ClientTls(str(certs.ca))) == grpc.StatusCode.UNAVAILABLE
    async with serving(ServerTls(str(certs.server_cert), str(certs.server_key))) as address:
        assert await _check(address, ClientTls(str(certs.ca))) == grpc.StatusCode.OK
        assert await _check(address, None) == grpc.StatusCode.UNAVAILABLE, "plain text to a TLS port"


async def test_key_is_required_but_by_the_health_service(certs: Certificates) -> None:
    tls = ClientTls(str(certs.ca))
    async with serving(ServerTls(str(certs.server_cert), str(certs.server_key)), KEY) as address:
        assert await _check(address, tls) == grpc.StatusCode.OK
        async with grpc_security.aio_channel(address, tls) as channel:
            echo = channel.unary_unary(ECHO)
            assert await echo(b"hi", metadata=grpc_security.bearer_metadata(KEY), timeout=5) == b"hi"
            for metadata in ((), grpc_security.bearer_metadata("wrong"), (("authorization", KEY),)):
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await echo(b"hi", metadata=metadata, timeout=5)
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
                details = rich_status.details_of(error.value)
                assert details.reason == Reason.Name(Reason.API_KEY_INVALID) and details.field == "authorization"
                assert "--api-key" in (error.value.details() or "") and KEY not in (error.value.details() or "")


def test_serve_gives_its_key_to_the_cache_service_it_starts_and_to_the_workers_as_its_client() -> None:
    from taco_llm.serve_args import parse as parse_serve

    args = parse_serve(["--enable-prefix-cache-offload", "--api-key", KEY])
    assert args.cache_service_argv is not None
    assert args.cache_service_argv[args.cache_service_argv.index("--api-key") + 1] == KEY
    assert args.worker_argv[args.worker_argv.index("--cache-service-api-key") + 1] == KEY
    assert cache_config.parse(["--memory", "1M", *args.cache_service_argv]).api_key == KEY
    # A cache service serve does not start has keys of its own: the workers get none of serve's for it.
    external = parse_serve(["--enable-prefix-cache-offload", "--api-key", KEY, "--cache-service", "10.0.0.1:50052"])
    assert "--cache-service-api-key" not in external.worker_argv


def test_cache_service_client_flags_need_a_cache_service(certs: Certificates) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-service", default=None)
    grpc_security.add_cache_service_client_args(parser)
    with pytest.raises(SecurityConfigError, match=r"^--cache-service-api-key: needs --cache-service"):
        grpc_security.cache_service_client_from_args(parser.parse_args(["--cache-service-api-key", KEY]))
    args = parser.parse_args(["--cache-service", "127.0.0.1:1", "--cache-service-api-key", KEY,
                              "--cache-service-tls-ca", str(certs.ca)])
    assert grpc_security.cache_service_client_from_args(args) == CacheServiceClient(KEY, ClientTls(str(certs.ca)))
    with pytest.raises(SecurityConfigError, match=r"^--cache-service-api-key is empty"):
        grpc_security.cache_service_client_from_args(parser.parse_args(
            ["--cache-service", "127.0.0.1:1", "--cache-service-api-key", ""]))


def test_an_encrypted_key_is_refused_at_once_not_prompted_for(certs: Certificates, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(certs.server_key.read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"secret")))
    with pytest.raises(SecurityConfigError, match=r"^--grpc-tls-keyfile .*encrypted"):
        grpc_security.server_tls(str(certs.server_cert), str(encrypted), None)


def test_serve_refuses_tls_flags_that_would_cut_its_own_plain_text_hops() -> None:
    from taco_llm.serve_args import ServeArgsError
    from taco_llm.serve_args import parse as parse_serve

    with pytest.raises(ServeArgsError, match=r"(?m)^--grpc-tls-certfile: serve's own gRPC hops"):
        parse_serve(["--grpc-tls-certfile=/c.pem", "--grpc-tls-keyfile", "/k.pem"])
    with pytest.raises(ServeArgsError, match=r"(?m)^--cache-service-tls-ca: the cache service serve starts"):
        parse_serve(["--enable-prefix-cache-offload", "--cache-service-tls-ca", "/ca.pem"])
    # A cache service of the user's own may run TLS: the workers get its flags.
    args = parse_serve(["--enable-prefix-cache-offload", "--cache-service", "10.0.0.1:50052",
                        "--cache-service-tls-ca", "/ca.pem"])
    assert args.worker_argv[args.worker_argv.index("--cache-service-tls-ca") + 1] == "/ca.pem"
