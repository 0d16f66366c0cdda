"""The worker's prefix-KV offload flags, and the vLLM kv_transfer_config they turn into."""

from __future__ import annotations

import argparse
import logging
import os

from vllm.config import KVTransferConfig
from vllm.platforms import current_platform

from taco_llm.protos.kv_cache_limits import SHM_DIR

from ..handoff import CONNECTOR_CLASS, CONNECTOR_MODULE, DEFAULT_LOOKUP_TIMEOUT, OFFLOAD_TRANSPORTS
from ..vllm_internals import CPU_RESERVED_CORES_VAR, cpu_cores_reserved_without_kv_connector

logger = logging.getLogger(__name__)


def add_offload_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cache service and prefix-KV offload")
    group.add_argument("--cache-service", default=None, metavar="HOST:PORT",
                       help="the cache service (taco_llm cache-service) this worker shares prefix-KV blocks "
                       "and the lookahead index through")
    group.add_argument("--enable-prefix-cache-offload", action="store_true",
                       help="keep prefix-KV blocks in the cache service's host memory and load them back on a "
                       "later hit instead of recomputing them (needs --cache-service)")
    group.add_argument("--apc-offload-not-lazy", action="store_true",
                       help="load offloaded blocks completely before the forward pass, instead of layer by "
                       "layer while it runs")
    group.add_argument("--apc-offload-gpu-evictor-limit", type=int, default=None,
                       help="accepted for TACO-LLM compatibility; vLLM's V1 engine has no separate evictor "
                       "table to bound (see docs/flags.md)")
    group.add_argument("--apc-offload-lookup-timeout", type=float, default=DEFAULT_LOOKUP_TIMEOUT,
                       help="seconds the scheduler waits for the cache service's answer on a prefix-cache "
                       "miss before recomputing (default %(default)s)")
    group.add_argument("--apc-offload-transport", choices=OFFLOAD_TRANSPORTS, default="auto",
                       help="how block bytes travel to and from the cache service: 'auto' (the default) uses "
                       "shared memory (/dev/shm) when the service can reach it (the same host, or containers "
                       "sharing an IPC namespace) and gRPC messages otherwise; 'grpc' always uses gRPC "
                       "messages (taco-llm's own flag, not TACO-LLM's)")
    group.add_argument("--apc-offload-shm-dir", default=SHM_DIR, metavar="DIR",
                       help="the tmpfs folder this worker makes its shared-memory windows in, which the cache "
                       "service must see as its --shm-dir (default %(default)s; on Kubernetes, a folder of the "
                       "node's /dev/shm mounted in both pods: docs/deploy.md) (taco-llm's own flag)")


def _check_address(address: str, parser: argparse.ArgumentParser) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        parser.error(f"--cache-service {address!r}: expected HOST:PORT")


def apply_offload_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """Checks the flags; with offload on, sets vLLM's kv_transfer_config. Returns --cache-service."""
    address: str | None = args.cache_service
    if address is not None:
        _check_address(address, parser)
    if args.apc_offload_gpu_evictor_limit is not None:
        logger.warning("--apc-offload-gpu-evictor-limit has no effect: vLLM's V1 engine keeps every free "
                       "block in one free queue, with no separate evictor table to bound")
    if not args.enable_prefix_cache_offload:
        if args.apc_offload_not_lazy:
            parser.error("--apc-offload-not-lazy needs --enable-prefix-cache-offload")
        if args.apc_offload_transport != "auto":
            parser.error("--apc-offload-transport needs --enable-prefix-cache-offload")
        if args.apc_offload_shm_dir != SHM_DIR:
            parser.error("--apc-offload-shm-dir needs --enable-prefix-cache-offload")
        return address
    if address is None:
        parser.error("--enable-prefix-cache-offload needs --cache-service HOST:PORT (taco_llm serve starts "
                     "one itself)")
    if getattr(args, "kv_transfer_config", None) is not None:
        parser.error("--enable-prefix-cache-offload sets vLLM's KV connector; drop --kv-transfer-config")
    if not os.path.isabs(args.apc_offload_shm_dir):
        parser.error(f"--apc-offload-shm-dir must be an absolute path, got {args.apc_offload_shm_dir!r}")
    if args.apc_offload_lookup_timeout <= 0:
        parser.error(f"--apc-offload-lookup-timeout must be positive, got {args.apc_offload_lookup_timeout}")
    args.kv_transfer_config = KVTransferConfig(
        kv_connector=CONNECTOR_CLASS,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        # A block that fails to load (service gone, evicted, corrupt) is recomputed, never an error.
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "cache_service": address,
            "lazy": not args.apc_offload_not_lazy,
            "lookup_timeout": args.apc_offload_lookup_timeout,
            "transport": args.apc_offload_transport,
            "shm_dir": args.apc_offload_shm_dir,
        },
    )
    keep_engine_threads(args)
    return address


def keep_engine_threads(args: argparse.Namespace) -> None:
    """On CPU, keeps the engine's OpenMP thread count what it is without offload.

    vLLM reserves one more core per rank from its OpenMP threads whenever a KV connector is configured
    (vllm_internals.CPU_RESERVED_CORES_VAR says where). Fewer threads split the arithmetic differently,
    and in bfloat16 that changed greedy output with offload on, even where nothing was loaded. Our
    connector's threads only wait on the network and copy memory; they need no core of their own. The
    engine's processes inherit the variable. One the user set is left as it is."""
    if not current_platform.is_cpu() or CPU_RESERVED_CORES_VAR in os.environ:
        return
    ranks = (getattr(args, "tensor_parallel_size", 1) * getattr(args, "pipeline_parallel_size", 1)
             * getattr(args, "prefill_context_parallel_size", 1))
    local_ranks = max(1, ranks // max(1, getattr(args, "nnodes", 1)))
    reserved = cpu_cores_reserved_without_kv_connector(local_ranks)
    os.environ[CPU_RESERVED_CORES_VAR] = str(reserved)
    logger.info("prefix-KV offload: %s=%d, the cores vLLM reserves without a KV connector, so that offload "
                "leaves the engine's OpenMP threads (and its bfloat16 rounding) as they are without it",
                CPU_RESERVED_CORES_VAR, reserved)
