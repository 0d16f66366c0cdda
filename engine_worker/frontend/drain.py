"""Draining on SIGTERM: the worker stops taking streams, lets running ones finish until
--shutdown-timeout, and cuts the rest with WORKER_DRAINING so that gateways continue them elsewhere.

The order matters to a fleet: gateways must stop sending here (health NOT_SERVING, the registry key
gone) before the streams already here are waited for, and a cut stream must end with a status that
says "resume me" rather than a normal finish.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from grpc_health.v1 import health, health_pb2

from taco_llm.protos.engine_limits import ENGINE_SERVICE

from .registry import Registrar

logger = logging.getLogger(__name__)

# Cut streams get this long to send their status before the server stops under them.
CUT_GRACE_SECONDS = 2.0


class StreamGate:
    """Admits Generate calls until the worker drains, and counts those still running."""

    def __init__(self) -> None:
        self.draining = False
        # Set at the drain's deadline: every stream still running ends with WORKER_DRAINING.
        self.cut = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def admit(self) -> bool:
        if self.draining:
            return False
        self.active += 1
        self._idle.clear()
        return True

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float | None, hurry: asyncio.Event | None = None) -> bool:
        """True once no stream runs; False when `timeout` (None: no limit) passes or `hurry` is set first."""
        if self._idle.is_set():
            return True
        waits = [asyncio.create_task(self._idle.wait())]
        if hurry is not None:
            waits.append(asyncio.create_task(hurry.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return self._idle.is_set()


async def drain(gate: StreamGate, cut_streams: Callable[[], Awaitable[None]], health_service: health.aio.HealthServicer,
                registrar: Registrar | None, *, timeout: float, hurry: asyncio.Event | None = None) -> None:
    """Takes the worker out of service, then waits up to `timeout` seconds (or until `hurry` is set) for
    its streams before cutting them."""
    gate.draining = True
    # Probes and gateways see it at once; enter_graceful_shutdown also keeps any later set() from undoing it.
    for name in ("", ENGINE_SERVICE):
        await health_service.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await health_service.enter_graceful_shutdown()
    if registrar is not None:
        await registrar.stop()
    if gate.active:
        logger.info("draining: %d stream(s) running; waiting up to %gs (--shutdown-timeout; a second signal "
                    "stops waiting)", gate.active, timeout)
    if await gate.wait_idle(timeout, hurry):
        return
    logger.info("draining: cutting %d stream(s) still running; their gateways continue them elsewhere",
                gate.active)
    gate.cut = True
    await cut_streams()
    await gate.wait_idle(CUT_GRACE_SECONDS)
