"""The gateway's serving options end to end: API keys (HTTP and gRPC), CORS, TLS, --middleware, log levels,
served model names, --max-logprobs, and `taco_llm serve --config`.

Gateway-only options run as cheap `taco_llm gateway` processes (no torch, ~2 s to start) in front of the
shared stack's worker. One more engine starts, as `taco_llm serve` with a YAML config file, an API key and
HTTPS: it is the worker that wants the key over gRPC, and the supervisor must probe it over HTTPS with it.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc

from taco_llm.protos import engine_pb2, engine_pb2_grpc, rich_status

from .certificates import Certificates, make_certificates
from .conftest import ENGINE_FLAGS
from .support import ROOT, START_TIMEOUT, Process, Stack, free_port, wait_until

pytestmark = pytest.mark.e2e

SERVE_KEY = "serve-key-from-the-command-line"
FILE_KEY = "serve-key-from-the-config-file"
GATEWAY_KEY = "gateway-key"
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8,
        "temperature": 0}


def _start(name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Process:
    log = log_dir / f"{name}.log"
    popen = subprocess.Popen([sys.executable, "-m", "taco_llm.cli", *args], stdout=log.open("wb"),
                             stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                             env={**os.environ, **(env or {})})
    return Process(name, popen, log)


def _answers(url: str, verify: ssl.SSLContext | bool = True) -> bool:
    try:
        return httpx.get(url, verify=verify, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _tls(certs: Certificates, client: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if client is not None:
        context.load_cert_chain(str(client[0]), str(client[1]))
    return context


@dataclass
class Gateway:
    process: Process
    base_url: str


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def gateway(stack: Stack, log_dir: Path) -> Iterator[Callable[..., Gateway]]:
    """Starts `taco_llm gateway --engine WORKER` with extra flags; every one is stopped at the end."""
    started: list[Process] = []

    def start_gateway(name: str, *flags: str, engine: str | None = None, env: dict[str, str] | None = None,
                      verify: ssl.SSLContext | None = None) -> Gateway:
        port = free_port()
        process = _start(name, ["gateway", "--engine", engine or stack.grpc_address, "--port", str(port), *flags],
                         log_dir, env)
        started.append(process)
        base_url = f"{'https' if verify else 'http'}://127.0.0.1:{port}"
        wait_until(process, lambda: _answers(f"{base_url}/health", verify or True), timeout=120)
        return Gateway(process, base_url)

    yield start_gateway
    for process in started:
        # uvicorn shuts down gracefully, then re-raises SIGTERM: -15 is its clean exit.
        assert process.stop() in (0, -15), process.tail()


def _refused(*args: str) -> subprocess.CompletedProcess[str]:
    run = subprocess.run([sys.executable, "-m", "taco_llm.cli", *args], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    return run


def _openai(base_url: str, key: str = "unused", verify: ssl.SSLContext | bool = True) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=120,
                         http_client=openai.DefaultHttpxClient(verify=verify))


# --- the API key on a gateway alone -------------------------------------------------------------------


def test_api_key_guards_every_route_but_health(gateway: Callable[..., Gateway], client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    guarded = gateway("gateway-api-key", "--api-key", GATEWAY_KEY)
    with pytest.raises(openai.AuthenticationError) as excinfo:
        _openai(guarded.base_url, "wrong-key").chat.completions.create(model=model, **CHAT)
    error = excinfo.value.body
    assert isinstance(error, dict) and error["code"] == "invalid_api_key" and "--api-key" in error["message"]
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
                         ("GET", "/version"), ("GET", "/metrics"), ("GET", "/no/such/route")]:
        reply = httpx.request(method, f"{guarded.base_url}{path}", json={"prompt": "hi", "model": model})
        assert reply.status_code == 401, (path, reply.text)
        assert reply.json()["error"]["type"] == "authentication_error"
        assert reply.headers["www-authenticate"] == "Bearer"
        almost = httpx.request(method, f"{guarded.base_url}{path}", headers={"Authorization": f"Bearer {GATEWAY_KEY}x"})
        assert almost.status_code == 401
    assert httpx.get(f"{guarded.base_url}/health").status_code == 200
    answer = _openai(guarded.base_url, GATEWAY_KEY).chat.completions.create(model=model, **CHAT)
    assert "Paris" in (answer.choices[0].message.content or "")
    metrics = httpx.get(f"{guarded.base_url}/metrics", headers={"Authorization": f"Bearer {GATEWAY_KEY}"})
    assert metrics.status_code == 200


def test_api_key_from_vllm_api_key_and_the_flag_wins(gateway: Callable[..., Gateway]) -> None:
    from_env = gateway("gateway-env-key", env={"VLLM_API_KEY": "env-key"})
    models = f"{from_env.base_url}/v1/models"
    assert httpx.get(models).status_code == 401
    assert httpx.get(models, headers={"Authorization": "Bearer env-key"}).status_code == 200
    both = gateway("gateway-flag-over-env", "--api-key", "flag-key", env={"VLLM_API_KEY": "env-key"})
    models = f"{both.base_url}/v1/models"
    assert httpx.get(models, headers={"Authorization": "Bearer env-key"}).status_code == 401
    assert httpx.get(models, headers={"Authorization": "Bearer flag-key"}).status_code == 200


# --- CORS ---------------------------------------------------------------------------------------------


def _preflight(base_url: str, origin: str, method: str = "POST") -> httpx.Response:
    return httpx.options(f"{base_url}/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_options(gateway: Callable[..., Gateway], stack: Stack) -> None:
    app = "https://app.example"
    cors = gateway("gateway-cors", "--allowed-origins", json.dumps([app]), "--allowed-methods", '["GET", "POST"]',
                   "--allowed-headers", '["Authorization", "Content-Type"]', "--allow-credentials",
                   "--api-key", GATEWAY_KEY)
    allowed = _preflight(cors.base_url, app)
    assert allowed.status_code == 200, allowed.text
    assert allowed.headers["access-control-allow-origin"] == app
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert set(allowed.headers["access-control-allow-methods"].replace(" ", "").split(",")) == {"GET", "POST"}
    other_origin = _preflight(cors.base_url, "https://evil.example")
    assert other_origin.status_code == 400 and "access-control-allow-origin" not in other_origin.headers
    assert _preflight(cors.base_url, app, "DELETE").status_code == 400
    # A refusal still carries the CORS headers, so that a browser app can read why.
    refused = httpx.get(f"{cors.base_url}/v1/models", headers={"Origin": app})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == app
    ok = httpx.get(f"{cors.base_url}/v1/models", headers={"Origin": app, "Authorization": f"Bearer {GATEWAY_KEY}"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == app
    # By default (as vLLM 0.32) no origin is allowed.
    default = _preflight(stack.base_url, app)
    assert "access-control-allow-origin" not in default.headers


def test_cors_flags_must_be_json_lists() -> None:
    run = _refused("gateway", "--engine", "127.0.0.1:1", "--allowed-origins", "https://app.example")
    assert "--allowed-origins" in run.stderr and "JSON list" in run.stderr
    run = _refused("gateway", "--engine", "127.0.0.1:1", "--allowed-methods", '{"GET": 1}')
    assert "--allowed-methods" in run.stderr


# --- TLS ----------------------------------------------------------------------------------------------


def test_https(gateway: Callable[..., Gateway], certs: Certificates, client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    tls = gateway("gateway-tls", "--ssl-certfile", str(certs.server_cert), "--ssl-keyfile", str(certs.server_key),
                  verify=_tls(certs))
    assert tls.base_url.startswith("https://")
    answer = _openai(tls.base_url, verify=_tls(certs)).chat.completions.create(model=model, **CHAT)
    assert "Paris" in (answer.choices[0].message.content or "")
    with pytest.raises(httpx.HTTPError):
        httpx.get(tls.base_url.replace("https://", "http://") + "/health", timeout=5)
    with pytest.raises(httpx.ConnectError):  # a client that does not trust the test CA refuses the server
        httpx.get(f"{tls.base_url}/health", timeout=5)
    assert "https://127.0.0.1" in tls.process.tail()


def test_client_certificates_required(gateway: Callable[..., Gateway], certs: Certificates) -> None:
    client_pair = (certs.client_cert, certs.client_key)
    mtls = gateway("gateway-mtls", "--ssl-certfile", str(certs.server_cert), "--ssl-keyfile", str(certs.server_key),
                   "--ssl-ca-certs", str(certs.ca), "--ssl-cert-reqs", "2", verify=_tls(certs, client_pair))
    health = f"{mtls.base_url}/health"
    assert httpx.get(health, verify=_tls(certs, client_pair), timeout=5).status_code == 200
    for verify in (_tls(certs), _tls(certs, (certs.stranger_cert, certs.stranger_key))):
        with pytest.raises(httpx.HTTPError):  # no client certificate, or one the CA did not sign
            httpx.get(health, verify=verify, timeout=5).raise_for_status()


def test_bad_tls_files_are_named(tmp_path: Path, certs: Certificates) -> None:
    base = ["gateway", "--engine", "127.0.0.1:1"]
    missing = _refused(*base, "--ssl-certfile", str(tmp_path / "nope.pem"), "--ssl-keyfile", str(certs.server_key))
    assert "--ssl-certfile" in missing.stderr and "no such file" in missing.stderr
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    bad = _refused(*base, "--ssl-certfile", str(garbage), "--ssl-keyfile", str(certs.server_key))
    assert "--ssl-certfile/--ssl-keyfile" in bad.stderr and "cannot load" in bad.stderr
    wrong_key = _refused(*base, "--ssl-certfile", str(certs.server_cert), "--ssl-keyfile", str(certs.client_key))
    assert "--ssl-certfile/--ssl-keyfile" in wrong_key.stderr
    no_ca = _refused(*base, "--ssl-certfile", str(certs.server_cert), "--ssl-keyfile", str(certs.server_key),
                     "--ssl-cert-reqs", "2")
    assert "--ssl-cert-reqs 2 needs --ssl-ca-certs" in no_ca.stderr
    bad_ca = _refused(*base, "--ssl-certfile", str(certs.server_cert), "--ssl-keyfile", str(certs.server_key),
                      "--ssl-ca-certs", str(garbage))
    assert "--ssl-ca-certs" in bad_ca.stderr
    encrypted = tmp_path / "encrypted.key"
    key = serialization.load_pem_private_key(certs.server_key.read_bytes(), None)
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"secret")))
    locked = _refused(*base, "--ssl-certfile", str(certs.server_cert), "--ssl-keyfile", str(encrypted))
    assert "--ssl-keyfile" in locked.stderr and "encrypted" in locked.stderr
    bad_reqs = _refused(*base, "--ssl-cert-reqs", "always")
    assert "--ssl-cert-reqs" in bad_reqs.stderr
    # taco_llm serve checks them before it starts the engine (so this returns at once).
    serve = _refused("serve", "--ssl-certfile", str(tmp_path / "nope.pem"))
    assert "--ssl-certfile" in serve.stderr and "no such file" in serve.stderr


# --- --middleware and --uvicorn-log-level -------------------------------------------------------------


def test_middleware_function_and_class(gateway: Callable[..., Gateway]) -> None:
    extended = gateway("gateway-middleware", "--middleware", "tests.sample_middleware.mark_function",
                       "--middleware", "tests.sample_middleware.MarkClass")
    reply = httpx.get(f"{extended.base_url}/v1/models")
    assert reply.status_code == 200
    assert reply.headers["x-sample-function"] == "/v1/models"
    assert reply.headers["x-sample-class"] == "yes"


@pytest.mark.parametrize(("path", "says"), [
    ("tests.no_such_module.thing", "cannot import tests.no_such_module"),
    ("tests.sample_middleware.missing", "has no attribute 'missing'"),
    ("tests.sample_middleware.NOT_MIDDLEWARE", "must be a class"),
    ("nodots", "expected an import path"),
])
def test_bad_middleware_is_refused_at_start(path: str, says: str) -> None:
    run = _refused("gateway", "--engine", "127.0.0.1:1", "--middleware", path)
    assert f"--middleware {path}" in run.stderr or f"--middleware '{path}'" in run.stderr
    assert says in run.stderr


def test_bad_middleware_stops_serve_before_the_engine_starts() -> None:
    started = time.monotonic()
    run = _refused("serve", "--middleware", "tests.sample_middleware.missing")
    assert "--middleware tests.sample_middleware.missing" in run.stderr
    assert time.monotonic() - started < 60


def test_uvicorn_log_level(gateway: Callable[..., Gateway]) -> None:
    chatty = gateway("gateway-debug-log", "--uvicorn-log-level", "debug")
    quiet = gateway("gateway-warning-log", "--uvicorn-log-level", "warning")
    for running in (chatty, quiet):
        assert httpx.get(f"{running.base_url}/v1/models").status_code == 200
    time.sleep(0.5)
    assert '"GET /v1/models HTTP/1.1" 200' in chatty.process.tail(400)
    quiet_log = quiet.process.tail(400)
    assert "GET /v1/models" not in quiet_log and "Uvicorn running on" not in quiet_log
    assert "Uvicorn running on" in chatty.process.tail(400)


# --- `taco_llm serve --config FILE --api-key KEY` over HTTPS, in one process: one more engine ----------


@dataclass
class Secured:
    stack: Stack
    verify: ssl.SSLContext


@pytest.fixture(scope="module")
def secured(model_dir: Path, log_dir: Path, certs: Certificates, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Secured]:
    config = tmp_path_factory.mktemp("config") / "serve.yaml"
    # snake and kebab case; the file's api_key is overridden by the command line's.
    config.write_text(f"api_key: {FILE_KEY}\nserved_model_name: [alpha, beta]\nmax-logprobs: 3\n"
                      "disable_log_stats: true\nmax-log-len: 100\nlog-stats-interval: 1\n")
    port, grpc_port = free_port(), free_port()
    # --disable-frontend-multiprocessing too: every option here works the same with the gateway and the
    # worker on one event loop, and the suite starts one engine fewer.
    process = _start("serve-secured", ["serve", "--config", str(config), "--port", str(port), "--grpc-port",
                                       str(grpc_port), "--api-key", SERVE_KEY, "--ssl-certfile",
                                       str(certs.server_cert), "--ssl-keyfile", str(certs.server_key),
                                       "--disable-frontend-multiprocessing", *ENGINE_FLAGS], log_dir)
    # The supervisor says "ready" only once its probe got /v1/models over HTTPS with the key.
    wait_until(process, lambda: "taco_llm: ready in" in process.log.read_text(errors="replace"), START_TIMEOUT)
    yield Secured(Stack(process, f"https://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"), _tls(certs))
    code = process.stop()
    assert code == 0, f"taco_llm serve exited with {code} on SIGTERM:\n{process.tail()}"


def test_serve_probe_and_url_use_https_and_the_key(secured: Secured) -> None:
    log = secured.stack.process.log.read_text(errors="replace")
    assert f"serving 'alpha' at {secured.stack.base_url}/v1" in log


def test_serve_command_line_key_wins_over_the_config_file(secured: Secured) -> None:
    url = f"{secured.stack.base_url}/v1/models"
    for key, status in [(FILE_KEY, 401), (None, 401), (SERVE_KEY, 200)]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert httpx.get(url, headers=headers, verify=secured.verify).status_code == status, key
    assert httpx.get(f"{secured.stack.base_url}/health", verify=secured.verify).status_code == 200


def _grpc_call(address: str, call: Callable[[engine_pb2_grpc.EngineStub], Any]) -> Any:
    with grpc.insecure_channel(address) as channel:
        return call(engine_pb2_grpc.EngineStub(channel))


def test_worker_wants_the_key_over_grpc(secured: Secured) -> None:
    address = secured.stack.grpc_address
    generate = engine_pb2.GenerateRequest(text="The capital of France is",
                                          sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=4))
    for metadata in [(), (("authorization", f"Bearer {FILE_KEY}"),), (("authorization", SERVE_KEY),)]:
        with pytest.raises(grpc.RpcError) as excinfo:
            _grpc_call(address, lambda s, m=metadata: s.GetModelInfo(engine_pb2.GetModelInfoRequest(), metadata=m))
        assert excinfo.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "--api-key" in excinfo.value.details()
        refusal = rich_status.details_of(excinfo.value)
        assert (refusal.reason, refusal.field) == ("API_KEY_INVALID", "authorization")
        with pytest.raises(grpc.RpcError) as excinfo:
            _grpc_call(address, lambda s, m=metadata: list(s.Generate(generate, metadata=m)))
        assert excinfo.value.code() == grpc.StatusCode.UNAUTHENTICATED
    key = (("authorization", f"Bearer {SERVE_KEY}"),)
    info = _grpc_call(address, lambda s: s.GetModelInfo(engine_pb2.GetModelInfoRequest(), metadata=key))
    assert list(info.served_model_names) == ["alpha", "beta"]
    text = "".join(c.text for m in _grpc_call(address, lambda s: list(s.Generate(generate, metadata=key)))
                   for c in m.delta.choices)
    assert "Paris" in text
    with grpc.insecure_channel(address) as channel:  # health probes need no key
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_gateway_without_the_engine_key_is_not_ready(gateway: Callable[..., Gateway], log_dir: Path,
                                                     secured: Secured) -> None:
    port = free_port()
    keyless = _start("gateway-keyless", ["gateway", "--engine", secured.stack.grpc_address, "--port", str(port)],
                     log_dir)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(keyless, lambda: _status(f"{base}/health") == 503, timeout=60)
        reply = httpx.get(f"{base}/v1/models")
        # The client learns the gateway cannot serve; why (the worker refused its key) is the operator's to
        # read in the gateway's log, since the client is not the one who can fix it.
        assert reply.status_code == 503, reply.text
        assert "UNAUTHENTICATED" not in reply.text and secured.stack.grpc_address not in reply.text, reply.text
        assert "UNAUTHENTICATED" in keyless.tail(200)
    finally:
        assert keyless.stop() in (0, -15)


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def test_served_model_names(secured: Secured) -> None:
    api = _openai(secured.stack.base_url, SERVE_KEY, secured.verify)
    assert [m.id for m in api.models.list().data] == ["alpha", "beta"]
    for name in ("alpha", "beta"):
        answer = api.chat.completions.create(model=name, **CHAT)
        assert answer.model == "alpha", "responses carry the first served name, as vLLM's"
        assert "Paris" in (answer.choices[0].message.content or "")
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="SmolLM2-135M-Instruct", **CHAT)


def test_max_logprobs_is_enforced(secured: Secured) -> None:
    api = _openai(secured.stack.base_url, SERVE_KEY, secured.verify)
    ok = api.chat.completions.create(model="alpha", logprobs=True, top_logprobs=3, **CHAT)
    assert ok.choices[0].logprobs is not None and len(ok.choices[0].logprobs.content[0].top_logprobs) == 3
    with pytest.raises(openai.BadRequestError) as excinfo:
        api.chat.completions.create(model="alpha", logprobs=True, top_logprobs=4, **CHAT)
    assert "logprobs" in str(excinfo.value.body)
    with pytest.raises(openai.BadRequestError) as excinfo:
        api.completions.create(model="alpha", prompt="Paris is", max_tokens=2, logprobs=5)
    assert "logprobs" in str(excinfo.value.body)


def test_disable_log_stats_and_max_log_len_warning(secured: Secured, stack: Stack, client: openai.OpenAI) -> None:
    api = _openai(secured.stack.base_url, SERVE_KEY, secured.verify)
    api.chat.completions.create(model="alpha", **CHAT)
    client.chat.completions.create(model=client.models.list().data[0].id, **CHAT)
    # The shared stack logs statistics every 10 s after activity; the secured one (every 1 s, but
    # --disable-log-stats from its config file) never does.
    deadline = time.monotonic() + 25
    while "Avg prompt throughput" not in stack.process.tail(2000) and time.monotonic() < deadline:
        time.sleep(1)
    assert "Avg prompt throughput" in stack.process.tail(2000), "control: the default stack logs statistics"
    log = secured.stack.process.log.read_text(errors="replace")
    assert "Avg prompt throughput" not in log
    warnings = [line for line in log.splitlines() if "warning: --max-log-len" in line]
    assert len(warnings) == 1, log[-3000:]


# --- --disable-frontend-multiprocessing (the secured stack runs that way) ----------------------------


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of each child process of pid, read from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                child = int(stat.parent.name)
                found.append((child, (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
    return found


def test_disable_frontend_multiprocessing(secured: Secured, client: openai.OpenAI) -> None:
    process = secured.stack.process
    children = _children(process.popen.pid)
    assert len(children) == 1 and "taco_llm.single_process" in children[0][1], children
    # vLLM's own EngineCore is the one process below it.
    assert len(_children(children[0][0])) >= 1
    api = _openai(secured.stack.base_url, SERVE_KEY, secured.verify)
    answer = api.chat.completions.create(model="alpha", **CHAT)
    reference = client.chat.completions.create(model=client.models.list().data[0].id, **CHAT)
    assert answer.choices[0].message.content == reference.choices[0].message.content
    # The gRPC hop is kept: the worker answers on its port, and wants the key there too (as
    # test_worker_wants_the_key_over_grpc shows in detail).
    with pytest.raises(grpc.RpcError) as excinfo:
        _grpc_call(secured.stack.grpc_address, lambda s: s.GetModelInfo(engine_pb2.GetModelInfoRequest()))
    assert excinfo.value.code() == grpc.StatusCode.UNAUTHENTICATED
