"""`taco_llm serve`: one engine worker and the gateway as child processes, watched and stopped together."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

STOP_GRACE_SECONDS = 20.0
CACHE_SERVICE_RESTARTS = 10


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux for SIGTERM when the supervisor dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _start(name: str, argv: list[str]) -> Child:
    # Own session: a Ctrl-C reaches only the supervisor, which then stops the children in order.
    return Child(name, subprocess.Popen(argv, start_new_session=True, preexec_fn=_die_with_parent))


def probe_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def probe_ssl_context(certfile: str, keyfile: str | None) -> ssl.SSLContext:
    """TLS for probing our own gateway child on this host: its certificate is not checked (it need not
    name the probe address), and it is shown as the client certificate in case the gateway asks for one
    (--ssl-cert-reqs), which works when the server's certificate chains to --ssl-ca-certs."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.load_cert_chain(certfile, keyfile)
    return context


def _ready_model(base_url: str, api_key: str | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> str | None:
    """The first served model once the gateway answers /health with 200, else None."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2, context=ssl_context) as reply:
            if reply.status != 200:
                return None
        models_request = urllib.request.Request(f"{base_url}/v1/models", headers=headers)
        with urllib.request.urlopen(models_request, timeout=5, context=ssl_context) as reply:
            models = json.load(reply)["data"]
            return str(models[0]["id"]) if models else None
    except (OSError, urllib.error.URLError, ValueError, KeyError):
        return None


class Supervisor:
    def __init__(self, children: Sequence[Child]):
        self.children = list(children)
        self.stopping = False

    def _on_signal(self, signum: int, _: FrameType | None) -> None:
        if not self.stopping:
            print(f"taco_llm: {signal.Signals(signum).name} received, shutting down", flush=True)
        self.stopping = True

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def exited(self) -> Child | None:
        for child in self.children:
            if child.process.poll() is not None:
                return child
        return None

    def stop(self) -> None:
        """Gateway first (no new requests), then the worker; each gets a grace period, then SIGKILL."""
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
                try:
                    child.process.wait(STOP_GRACE_SECONDS)
                except subprocess.TimeoutExpired:
                    print(f"taco_llm: {child.name} did not stop in {STOP_GRACE_SECONDS:.0f}s; killing it",
                          flush=True)
                    os.killpg(child.process.pid, signal.SIGKILL)
                    child.process.wait()


def serve(worker_argv: list[str], gateway_argv: list[str], base_url: str, ready_timeout: float,
          api_key: str | None = None, ssl_context: ssl.SSLContext | None = None,
          cache_service_argv: list[str] | None = None, single_process: bool = False) -> int:
    python = sys.executable
    # The cache service first and stopped last: the worker reconnects to it with backoff meanwhile.
    cache_argv = [python, "-m", "taco_llm.cache_service", *(cache_service_argv or [])]
    cache = [_start("cache service", cache_argv)] if cache_service_argv is not None else []
    cache_restarts = 0
    if single_process:
        one = _start("engine worker and gateway", [python, "-m", "taco_llm.single_process",
                                                   json.dumps({"worker": worker_argv, "gateway": gateway_argv})])
        children = [one]
        what = f"the engine worker and the gateway in one process (pid {one.process.pid})"
    else:
        worker = _start("engine worker", [python, "-m", "taco_llm.engine_worker", *worker_argv])
        gateway = _start("gateway", [python, "-m", "taco_llm.gateway", *gateway_argv])
        children = [worker, gateway]
        what = f"the engine worker (pid {worker.process.pid}) and the gateway (pid {gateway.process.pid})"
    supervisor = Supervisor([*cache, *children])
    supervisor.install_signal_handlers()
    print(f"taco_llm: starting {what}; the API will be at {base_url}", flush=True)
    started = time.monotonic()
    ready = False
    code = 0
    try:
        while not supervisor.stopping:
            dead = supervisor.exited()
            if dead is not None and cache and dead is cache[0] and cache_restarts < CACHE_SERVICE_RESTARTS:
                # Losing the cache service costs no request (the worker recomputes and reconnects), so
                # it is restarted, empty, rather than taking serve down.
                cache_restarts += 1
                print(f"taco_llm: the cache service exited with code {dead.process.returncode}; restarting it",
                      flush=True)
                dead.process = _start(dead.name, cache_argv).process
                continue
            if dead is not None:
                code = dead.process.returncode or 1
                print(f"taco_llm: the {dead.name} exited with code {dead.process.returncode}; stopping",
                      flush=True)
                break
            if not ready:
                model = _ready_model(base_url, api_key, ssl_context)
                if model is not None:
                    ready = True
                    print(f"taco_llm: ready in {time.monotonic() - started:.1f}s, serving {model!r} at "
                          f"{base_url}/v1", flush=True)
                elif time.monotonic() - started > ready_timeout:
                    print(f"taco_llm: not ready after {ready_timeout:.0f}s (--ready-timeout); stopping",
                          flush=True)
                    code = 1
                    break
            time.sleep(0.5)
    finally:
        supervisor.stop()
    return code
