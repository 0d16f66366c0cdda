"""`taco_llm worker`: start the engine, then serve it over gRPC until SIGTERM or SIGINT, then drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .frontend.environment import check_environment

if TYPE_CHECKING:
    from .frontend.args import WorkerArgs


async def _run(args: WorkerArgs) -> int:
    from .frontend.server import serve

    stop = asyncio.Event()
    hurry = asyncio.Event()

    def on_signal() -> None:
        # The first signal drains (--shutdown-timeout); a second one stops waiting for the streams.
        (hurry if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, on_signal)
    return await serve(args, stop, hurry=hurry)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    problem = check_environment()
    if problem:
        print(f"taco_llm worker: {problem}", file=sys.stderr)
        return 1
    # vLLM is imported only now: a broken environment gets the message above, not a traceback.
    from .frontend.args import parse
    from .frontend.default_model import DefaultModelError

    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s worker: %(message)s")
    try:
        return asyncio.run(_run(args))
    except DefaultModelError as error:
        print(f"taco_llm worker: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
