"""`taco_llm worker`: start the engine, then serve it over gRPC until SIGTERM or SIGINT, then drain.

A start-up that cannot work ends in one line, last, that names the flag or path and says why
(taco_llm/preflight.py checks what it can before vLLM is even imported); its traceback is shown only
with VLLM_LOGGING_LEVEL=DEBUG. The same line goes to `taco_llm serve`'s supervisor, which prints it last.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from taco_llm.preflight import check_engine_flags, check_model, report_exit_reason

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


def _fail(text: str) -> int:
    line = " ".join(text.split())  # one line, whatever the message's own layout
    report_exit_reason(line)
    print(f"taco_llm worker: error: {line}", file=sys.stderr, flush=True)
    return 1


def _debug() -> bool:
    return os.environ.get("VLLM_LOGGING_LEVEL", "").upper() == "DEBUG"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    problem = check_environment()
    if problem:
        return _fail(problem)
    problems = check_engine_flags(argv)
    if problems:  # before vLLM is imported: seconds, not the engine's minute
        return _fail("; ".join(problems))
    # vLLM is imported only now: a broken environment gets the message above, not a traceback.
    import pydantic

    from .frontend.args import parse
    from .frontend.default_model import DefaultModelError
    from .frontend.server import WorkerStartError

    args = parse(argv)
    flag = "--model" if any(a.startswith("--model") for a in argv) else "model"
    if not args.uses_default_model and (problem := check_model(
            args.engine.model, flag, download_dir=args.engine.download_dir, revision=args.engine.revision)):
        return _fail(problem)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s worker: %(message)s")
    try:
        return asyncio.run(_run(args))
    except (DefaultModelError, WorkerStartError) as error:
        return _fail(str(error))
    except pydantic.ValidationError as error:  # vLLM's config classes refused a combination of flags
        if _debug():
            logging.getLogger(__name__).exception("vLLM refused the configuration")
        return _fail(f"vLLM refused the engine's configuration: {'; '.join(e['msg'] for e in error.errors())}")
    except Exception as error:
        # vLLM has logged the cause above (from the engine's own processes, where it happened).
        if _debug():
            logging.getLogger(__name__).exception("the worker failed")
        first = (str(error).strip().splitlines() or [""])[0]
        return _fail(f"the engine failed ({type(error).__name__}: {first}); vLLM's log above says why "
                     "(VLLM_LOGGING_LEVEL=DEBUG shows the traceback)")


if __name__ == "__main__":
    sys.exit(main())
