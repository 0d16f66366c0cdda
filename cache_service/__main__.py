"""`taco_llm cache-service` (or `python -m cache_service`): serve until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

from .config import CacheServiceConfig, parse


async def _run(config: CacheServiceConfig) -> int:
    from .server import serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stop.set)
    return await serve(config, stop)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s cache-service: %(message)s")
    return asyncio.run(_run(config))


if __name__ == "__main__":
    sys.exit(main())
