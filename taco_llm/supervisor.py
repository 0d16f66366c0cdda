"""`taco_llm serve`'s processes: engine workers, the gateway and the cache service, each a child process,
started together, watched, restarted or stopped.

What the supervisor runs is a list of ChildSpec: cli.py builds the real ones, tests give it stand-ins.
- A worker is ready once its health service says SERVING and the process answering is the worker serve
  started: a port held by another process (another serve's worker) answers too, and must not pass for it.
- A worker that dies once it has served is restarted with backoff on its own port; the gateway
  health-checks that address, so the worker rejoins by itself. A worker that exits before it ever
  served (a bad flag, a port in use, a model that does not load) would only fail again: serve stops.
- The gateway dying stops serve; the cache service is restarted with the workers' backoff (losing it
  costs no request), and stops serve when it keeps failing quickly.
- On SIGTERM or SIGINT: the gateway first (it finishes its streams), then the workers (they drain),
  then the cache service; each process group is killed once its leader is gone, so nothing is left.
  A second signal hurries the stop: the children being stopped, and those stopped after them, are told
  to stop now (the workers stop draining).
- When serve stops on a failure, its last line, printed once every child has stopped (after the
  gateway's own shutdown lines), says which process failed and why: the reason the child wrote to
  its EXIT_REASON_ENV file (preflight.report_exit_reason), when it wrote one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Literal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .preflight import EXIT_REASON_ENV

# How long a child has to stop after SIGTERM before SIGKILL; workers get their drain time on top.
STOP_GRACE_SECONDS = 20.0
PROBE_TIMEOUT_SECONDS = 1.0
POLL_SECONDS = 0.25
STOP_POLL_SECONDS = 0.05
# What hurries a child already stopping. The worker takes any second signal as "stop draining now", but
# uvicorn (the gateway) takes only a second SIGINT as "exit now"; SIGINT is both.
HURRY_SIGNAL = signal.SIGINT
# The hurry goes this long after the SIGTERM that starts a child's stop: two signals pending at once reach a
# process lowest number first (SIGINT before SIGTERM), and uvicorn would take that SIGINT for the first.
HURRY_AFTER_SECONDS = 0.2

Role = Literal["cache", "worker", "gateway"]
# Stopped in this order.
STOP_ORDER: tuple[Role, ...] = ("gateway", "worker", "cache")


@dataclass(frozen=True)
class ChildSpec:
    name: str  # as messages say it: "the {name} exited ..."
    role: Role
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # on top of the supervisor's own environment
    # Workers: HOST:PORT of the gRPC health service whose SERVING says the worker is ready.
    health_address: str | None = None


@dataclass(frozen=True)
class RestartPolicy:
    """A restarted worker or cache service waits first_delay, doubling on each quick failure up to
    max_delay; one that ran healthily for healthy_after seconds (a worker: from its SERVING) starts over
    from first_delay. A cache service that fails quickly max_cache_restarts times in a row stops serve:
    it would only fail again. A worker has no such limit, as it has served."""

    first_delay: float = 1.0
    max_delay: float = 30.0
    healthy_after: float = 60.0
    max_cache_restarts: int = 10


@dataclass
class Child:
    spec: ChildSpec
    process: subprocess.Popen[bytes] | None = None  # None: exited, and its group killed
    started: float = 0.0
    ready_at: float | None = None  # when this run answered SERVING
    ever_ready: bool = False
    restarts: int = 0
    quick_restarts: int = 0  # in a row, each after a run shorter than RestartPolicy.healthy_after
    delay: float = 0.0  # the last restart's wait
    restart_at: float | None = None
    # Said once per run: the health probe was answered by a process other than this child.
    told_of_other_listener: bool = False


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux for SIGTERM when the supervisor dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _kill_group(pgid: int) -> None:
    """What is left of a child's session (an engine core its leader started): nothing may outlive serve,
    or hold a GPU or a port a restarted worker needs."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


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


def gateway_model(base_url: str, api_key: str | None = None, ssl_context: ssl.SSLContext | None = None) -> str | None:
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


def listens_on(pid: int, port: int) -> bool | None:
    """Whether the process pid, or one of its descendants, holds a listening TCP socket on port; None
    when the system will not say (no psutil, or /proc hidden from us)."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return None
    for process in family:
        try:
            connections = process.net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue  # an engine process that has just ended holds nothing
        except psutil.AccessDenied:
            return None
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in connections):
            return True
    return False


def grpc_serving(address: str, timeout: float = PROBE_TIMEOUT_SECONDS) -> bool:
    """Whether the gRPC health service at address says SERVING: a worker says so once its engine runs.
    Asked of the worker itself, not through the gateway, which may route around a worker it finds down."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


class Supervisor:
    def __init__(self, specs: Sequence[ChildSpec], *, stop_grace: float = STOP_GRACE_SECONDS,
                 restart: RestartPolicy | None = None):
        self.children = [Child(spec) for spec in specs]
        self.stop_grace = stop_grace
        self.restart = restart or RestartPolicy()
        # SIGTERM and SIGINT as they came; the handler only records them (printing from a handler could
        # interrupt a print of the main code on the same stream), and the loops act on them.
        self.signals: list[int] = []
        self.signals_told = 0
        # Why serve stops, when it stops on a failure: printed last, once everything has stopped.
        self.failure: str | None = None
        self.reasons = tempfile.mkdtemp(prefix="taco_llm_serve_")

    @property
    def stopping(self) -> bool:
        return bool(self.signals)

    @property
    def hurried(self) -> bool:
        """A second signal came: what is being stopped is to stop now."""
        return len(self.signals) > 1

    def _on_signal(self, signum: int, _: FrameType | None) -> None:
        self.signals.append(signum)

    def tell_signals(self) -> None:
        """Says what the signals received so far do, once each for the first two."""
        for signum in self.signals[self.signals_told:2]:
            name = signal.Signals(signum).name
            if self.signals_told == 0:
                print(f"taco_llm: {name} received, shutting down (a second one stops without waiting for "
                      "streams)", flush=True)
            else:
                print(f"taco_llm: {name} received again: hurrying the stop (the gateway and the workers stop "
                      "without finishing their streams)", flush=True)
            self.signals_told += 1

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def start(self) -> None:
        for child in self.children:
            self._launch(child)

    def _reason_file(self, child: Child) -> str:
        return os.path.join(self.reasons, f"{self.children.index(child)}.txt")

    def _reason(self, child: Child) -> str:
        """The one line the child wrote about why it failed, if it wrote one."""
        try:
            with open(self._reason_file(child)) as file:
                return file.readline().strip()
        except OSError:
            return ""

    def _launch(self, child: Child) -> int:
        """Starts the child's process; its pid."""
        reason_file = self._reason_file(child)
        with contextlib.suppress(FileNotFoundError):
            os.remove(reason_file)  # a restarted child's reason is its own
        env = {**os.environ, **child.spec.env, EXIT_REASON_ENV: reason_file}
        # Own session: a Ctrl-C reaches only the supervisor, which then stops the children in order.
        process = subprocess.Popen(child.spec.argv, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        child.process = process
        child.started = time.monotonic()
        child.ready_at = None
        child.restart_at = None
        child.told_of_other_listener = False
        return process.pid

    def describe(self) -> str:
        return ", ".join(f"the {c.spec.name} (pid {c.process.pid})" for c in self.children if c.process)

    def workers_ready(self) -> bool:
        return all(c.ready_at is not None for c in self.children if c.spec.role == "worker")

    def check(self) -> int | None:
        """One look at every child: readiness, deaths, restarts due. The exit code serve stops with, or None."""
        for child in self.children:
            if child.process is None:
                if child.restart_at is not None and time.monotonic() >= child.restart_at:
                    pid = self._launch(child)
                    print(f"taco_llm: restarted the {child.spec.name} (pid {pid})", flush=True)
                continue
            code = child.process.poll()
            if code is None:
                self._probe(child)
                continue
            _kill_group(child.process.pid)
            child.process = None
            failure = self._exited(child, code)
            if failure is not None:
                return failure
        return None

    def _probe(self, child: Child) -> None:
        address = child.spec.health_address
        if child.ready_at is not None or address is None or child.process is None or not grpc_serving(address):
            return
        # SERVING from whoever holds the port is not enough: another serve's worker there answers too, while
        # this one (still loading its engine) has yet to find that it cannot bind. The listener must be ours.
        # (Workers bind without SO_REUSEPORT, so no other process can share the port with ours.)
        port = int(address.rsplit(":", 1)[1])
        if listens_on(child.process.pid, port) is False:
            if not child.told_of_other_listener:
                child.told_of_other_listener = True
                print(f"taco_llm: {address} answers SERVING, but not from the {child.spec.name} (pid "
                      f"{child.process.pid}): another process holds its port", flush=True)
            return
        child.ready_at = time.monotonic()
        again = " again" if child.ever_ready else ""
        child.ever_ready = True
        print(f"taco_llm: the {child.spec.name} is ready{again} at {address} "
              f"({child.ready_at - child.started:.1f}s)", flush=True)

    def _exited(self, child: Child, code: int) -> int | None:
        now = time.monotonic()
        name, how = child.spec.name, _exit_text(code)
        failure = code if code > 0 else 1
        reason = self._reason(child)
        why = f": {reason}" if reason else ""
        policy = self.restart
        if child.spec.role == "worker":
            if not child.ever_ready:
                self.failure = f"the {name} exited with {how} before it ever became ready{why}"
                return failure
            healthy_since = child.ready_at
        elif child.spec.role == "cache":
            # Losing the cache service costs no request (workers recompute and reconnect): it is restarted,
            # empty, rather than taking serve down; it has no readiness probe, so its health is its uptime.
            healthy_since = child.started
        else:
            self.failure = f"the {name} exited with {how}{why}"
            return failure
        served_long = healthy_since is not None and now - healthy_since >= policy.healthy_after
        child.quick_restarts = 0 if served_long else child.quick_restarts + 1
        if child.spec.role == "cache" and child.quick_restarts > policy.max_cache_restarts:
            self.failure = (f"the {name} exited with {how}{why} (restarted {policy.max_cache_restarts} times in a "
                            f"row, each run shorter than {policy.healthy_after:g}s)")
            return failure
        child.delay = policy.first_delay if served_long or not child.delay else min(child.delay * 2, policy.max_delay)
        child.restarts += 1
        child.restart_at = now + child.delay
        print(f"taco_llm: the {name} exited with {how}{why} after {now - child.started:.0f}s; restarting it in "
              f"{child.delay:g}s (restart {child.restarts})", flush=True)
        return None

    def stop(self) -> None:
        """Role by role (STOP_ORDER): SIGTERM to each, the grace period, then SIGKILL to what is left."""
        for role in STOP_ORDER:
            self._stop([c for c in self.children if c.spec.role == role])

    def _stop(self, children: list[Child]) -> None:
        processes = [(c, c.process) for c in children if c.process is not None]
        for _, process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        deadline = signalled + self.stop_grace
        hurried: set[int] = set()
        while True:
            self.tell_signals()
            running = [process for _, process in processes if process.poll() is None]
            now = time.monotonic()
            if not running or now >= deadline:
                break
            if self.hurried and now - signalled >= HURRY_AFTER_SECONDS:
                for process in running:
                    if process.pid not in hurried:
                        hurried.add(process.pid)
                        process.send_signal(HURRY_SIGNAL)
            time.sleep(STOP_POLL_SECONDS)
        for child, process in processes:
            if process.poll() is None:
                print(f"taco_llm: the {child.spec.name} did not stop in {self.stop_grace:.0f}s; killing it",
                      flush=True)
            _kill_group(process.pid)
            process.wait()
            child.process = None
            child.restart_at = None


def serve(specs: Sequence[ChildSpec], *, gateway_ready: Callable[[], str | None], base_url: str,
          ready_timeout: float, stop_grace: float = STOP_GRACE_SECONDS, restart: RestartPolicy | None = None) -> int:
    """Runs the children until a signal or a failure; the exit code. gateway_ready: the model the gateway
    serves once it answers, asked once every worker is ready."""
    supervisor = Supervisor(specs, stop_grace=stop_grace, restart=restart)
    supervisor.install_signal_handlers()
    code = 0
    try:
        supervisor.start()
        print(f"taco_llm: starting {supervisor.describe()}; the API will be at {base_url}", flush=True)
        started = time.monotonic()
        ready = False
        while not supervisor.stopping:
            failure = supervisor.check()
            if failure is not None:
                code = failure
                break
            if not ready and supervisor.workers_ready():
                model = gateway_ready()
                if model is not None:
                    ready = True
                    print(f"taco_llm: ready in {time.monotonic() - started:.1f}s, serving {model!r} at "
                          f"{base_url}/v1", flush=True)
            if not ready and time.monotonic() - started > ready_timeout:
                supervisor.failure = f"not ready after {ready_timeout:.0f}s (--ready-timeout)"
                code = 1
                break
            time.sleep(POLL_SECONDS)
    finally:
        supervisor.tell_signals()
        supervisor.stop()
        shutil.rmtree(supervisor.reasons, ignore_errors=True)
    if supervisor.failure is not None:
        # On stdout, where the supervisor's other lines go, so that it is the last of them.
        print(f"taco_llm serve: error: {supervisor.failure}; stopped", flush=True)
    return code
