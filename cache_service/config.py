"""The cache service's settings, parsed once from its command line and handed to every servicer."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from taco_llm import grpc_security
from taco_llm.protos.kv_cache_limits import SHM_DIR

DEFAULT_MEMORY_UTILIZATION = 0.3  # TACO-LLM's documented default for --cpu-prefill-memory-utilization
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


@dataclass(frozen=True)
class CacheServiceConfig:
    grpc_host: str
    grpc_port: int
    kv_budget_bytes: int
    redis_url: str | None  # for the lookahead index; None: not configured
    min_access_threshold: int
    count_hits: bool
    # --api-key: calls but the health service's must carry it; kept out of repr, so out of any log line.
    api_key: str | None = field(default=None, repr=False)
    grpc_tls: grpc_security.ServerTls | None = None  # --grpc-tls-*: None serves plain text
    shm_dir: str = SHM_DIR  # where workers' window files are, as this process sees them


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_size(text: str) -> int:
    """'1073741824', '1G', '512MiB' -> bytes (powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 1073741824, 512M or 4G, got {text!r}")
    unit = (match.group(2) or "").lower()[:1]
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"the size must be positive, got {text!r}")
    return size


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="taco_llm cache-service",
        description="The cache service: prefix-KV blocks in host memory, shared by every engine worker "
        "(protos/kv_cache.proto), with the gRPC health service and reflection.",
    )
    parser.add_argument("--grpc-host", default="127.0.0.1", help="address the gRPC service listens on")
    parser.add_argument("--grpc-port", type=int, default=50052, help="port the gRPC service listens on")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--memory", type=parse_size, default=None,
                        help="bytes the KV blocks may use (suffixes K, M, G, T: powers of 1024)")
    memory.add_argument("--cpu-prefill-memory-utilization", type=float, default=None,
                        help="fraction of host memory the KV blocks may use (default "
                        f"{DEFAULT_MEMORY_UTILIZATION})")
    parser.add_argument("--redis-url", default=None,
                        help="Redis for the lookahead n-gram index, e.g. redis://127.0.0.1:6379/0")
    parser.add_argument("--apc-offload-min-access-threshold", type=int, default=1,
                        help="keep a block only once it has been used (looked up) this many times")
    parser.add_argument("--apc-offload-enable-hit-cnt", action="store_true",
                        help="count hits per block: reported by Stats, and the least-hit of the least "
                        "recent blocks is evicted first")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="require 'authorization: Bearer KEY' in the metadata of every gRPC call but the "
                        "health service's (workers send it with --cache-service-api-key) (default: none, "
                        "no key asked for)")
    parser.add_argument("--shm-dir", default=SHM_DIR, metavar="DIR",
                        help="the tmpfs folder in which workers make their shared-memory windows, as this "
                        "service sees it: each worker's --apc-offload-shm-dir (default %(default)s)")
    grpc_security.add_server_tls_args(parser, "cache service")
    return parser


def parse(argv: Sequence[str]) -> CacheServiceConfig:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    if not 0 < args.grpc_port < 65536:
        parser.error(f"--grpc-port {args.grpc_port} is not a TCP port")
    if args.apc_offload_min_access_threshold < 1:
        parser.error(f"--apc-offload-min-access-threshold must be at least 1, got "
                     f"{args.apc_offload_min_access_threshold}")
    if args.memory is not None:
        budget = args.memory
    else:
        fraction = args.cpu_prefill_memory_utilization
        fraction = DEFAULT_MEMORY_UTILIZATION if fraction is None else fraction
        if not 0 < fraction <= 1:
            parser.error(f"--cpu-prefill-memory-utilization must be in (0, 1], got {fraction}")
        budget = int(host_memory_bytes() * fraction)
    if args.redis_url is not None and not args.redis_url.startswith(("redis://", "rediss://", "unix://")):
        parser.error(f"--redis-url must start with redis://, rediss:// or unix://, got {args.redis_url!r}")
    if args.api_key is not None and not args.api_key:
        parser.error("--api-key is empty: an empty key would let everyone in")
    if not os.path.isabs(args.shm_dir) or not os.path.isdir(args.shm_dir):
        parser.error(f"--shm-dir {args.shm_dir!r} is not an absolute path to a folder")
    try:
        grpc_tls = grpc_security.server_tls_from_args(args)
    except grpc_security.SecurityConfigError as error:
        parser.error(str(error))
    return CacheServiceConfig(args.grpc_host, args.grpc_port, budget, args.redis_url,
                              args.apc_offload_min_access_threshold, args.apc_offload_enable_hit_cnt,
                              api_key=args.api_key, grpc_tls=grpc_tls, shm_dir=args.shm_dir)
