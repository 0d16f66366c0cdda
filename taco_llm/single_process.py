"""`taco_llm serve --disable-frontend-multiprocessing`: the engine worker and the gateway in one process.

Both run on one asyncio loop: the worker's grpc.aio server and the gateway's uvicorn server. The
gateway still reaches the worker over gRPC, on loopback, so that everything the gateway relies on
(health, GetModelInfo, the API key, cancellation) works exactly as with two processes; what is saved is
a process and its start-up, not the hop. vLLM's EngineCore still runs in the child process vLLM starts.

Run by the supervisor as `python -m taco_llm.single_process '{"worker": [...], "gateway": [...]}'`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    from taco_llm.engine_worker.frontend.args import WorkerArgs
    from taco_llm.gateway.app import GatewaySettings


class _GatewayServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The loop's own handlers stop both servers; uvicorn's would stop only itself, then re-raise.
        yield


async def _serve_gateway(server: uvicorn.Server) -> bool:
    """False when uvicorn gives up at start-up (it calls sys.exit, say when its port is taken)."""
    try:
        await server.serve()
    except SystemExit:
        return False
    return True


async def _run(worker_args: WorkerArgs, settings: GatewaySettings) -> int:
    from taco_llm.engine_worker.frontend.server import serve as serve_worker
    from taco_llm.gateway.app import create_app

    stop = asyncio.Event()
    # A second signal cuts the worker's drain short, as it does for a worker process of its own.
    hurry = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lambda: (hurry if stop.is_set() else stop).set())
    tls = settings.tls.uvicorn_kwargs() if settings.tls else {}
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            log_level=settings.uvicorn_log_level,
                            access_log=settings.uvicorn_log_level in ("debug", "trace"),
                            timeout_graceful_shutdown=settings.shutdown_timeout, **tls)  # type: ignore[arg-type]
    gateway = _GatewayServer(config)
    worker_task = asyncio.create_task(serve_worker(worker_args, stop, hurry=hurry), name="engine-worker")
    gateway_task = asyncio.create_task(_serve_gateway(gateway), name="gateway")
    print(f"taco_llm: engine worker and gateway in one process; the gateway listens on "
          f"{settings.scheme}://{settings.host}:{settings.port}", flush=True)
    stop_wait = asyncio.create_task(stop.wait())
    await asyncio.wait({worker_task, gateway_task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    # Whichever ends first ends both: the gateway stops taking requests, then the worker stops.
    gateway_failed = gateway_task.done() and not stop.is_set()
    gateway.should_exit = True
    gateway_failed = not await gateway_task or gateway_failed
    stop.set()
    stop_wait.cancel()
    code = await worker_task
    return code or (1 if gateway_failed else 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parts = json.loads(argv[0])
    from taco_llm.engine_worker.frontend.environment import check_environment

    problem = check_environment()
    if problem:
        print(f"taco_llm serve: {problem}", file=sys.stderr)
        return 1
    from taco_llm.engine_worker.frontend.args import parse as parse_worker
    from taco_llm.engine_worker.frontend.default_model import DefaultModelError
    from taco_llm.gateway.__main__ import parse as parse_gateway

    worker_args = parse_worker(parts["worker"])
    settings = parse_gateway(parts["gateway"])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s serve: %(message)s")
    try:
        return asyncio.run(_run(worker_args, settings))
    except DefaultModelError as error:
        print(f"taco_llm serve: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
