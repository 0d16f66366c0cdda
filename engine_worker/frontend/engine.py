"""Starting vLLM's AsyncLLM, and the load figures it reports after every step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm.config import VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger, StatLoggerBase, StatLoggerFactory

from ..vllm_internals import IterationStats, SchedulerStats
from .default_model import DEFAULT_MODEL_NAME, ensure_default_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSnapshot:
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    kv_cache_usage: float = 0.0


class EngineProgress:
    """How long the engine has gone without finishing a step while it had requests to run.

    vLLM's EngineCore hands the front process an output after every step it runs (scheduler statistics
    at least: the worker's own stat logger makes vLLM send them), so the time since the last one is the
    time the current step has taken. A frozen or deadlocked EngineCore (or its executor's Worker) sends
    nothing, while the worker's gRPC server, in another process, goes on answering. Time with nothing to
    run is no stall: the clock restarts when the first request arrives at an idle engine."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.last_step = clock()

    def stepped(self) -> None:
        """An engine step finished (vLLM's output handler calls the stat logger on the event loop)."""
        self.last_step = self.clock()

    def submitting(self, unfinished: int) -> None:
        """A request is about to go to an engine that has `unfinished` requests already."""
        if unfinished == 0:
            self.last_step = self.clock()

    def stalled_seconds(self, unfinished: int) -> float:
        """Seconds since the engine last finished a step, while it has `unfinished` requests; else 0."""
        if unfinished == 0:
            return 0.0
        return max(0.0, self.clock() - self.last_step)


class LoadTracker:
    """One engine's latest scheduler counts, for GetLoad, and its progress (`progress`).

    vLLM builds its stat loggers itself, from factories it calls with (config, engine index);
    `stat_logger` is such a factory, so each logger it makes writes into this tracker and no state
    is shared between engines (or tests) through the class."""

    def __init__(self, progress: EngineProgress | None = None) -> None:
        self.latest = LoadSnapshot()
        self.progress = progress or EngineProgress()

    def stat_logger(self, vllm_config: VllmConfig, engine_index: int = 0) -> StatLoggerBase:
        return _LoadLogger(self, engine_index)


class _LoadLogger(StatLoggerBase):
    """vLLM calls `record` on the event loop after every engine step: it copies three numbers and stamps
    the engine's progress."""

    def __init__(self, tracker: LoadTracker, engine_index: int = 0):
        # StatLoggerBase declares (vllm_config, engine_index); vLLM never calls this class itself, only
        # LoadTracker.stat_logger does.
        self.tracker = tracker
        self.engine_index = engine_index

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: object = None, engine_idx: int = 0) -> None:
        self.tracker.progress.stepped()
        if scheduler_stats is not None:
            self.tracker.latest = LoadSnapshot(
                scheduler_stats.num_running_reqs,
                scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
                scheduler_stats.kv_cache_usage,
            )

    def log_engine_initialized(self) -> None:
        pass


def resolve_default_model(engine_args: AsyncEngineArgs) -> None:
    """Points the engine at the converted bundled model, served under its own name."""
    engine_args.model = str(ensure_default_model())
    if not engine_args.served_model_name:
        engine_args.served_model_name = [DEFAULT_MODEL_NAME]


def start_engine(engine_args: AsyncEngineArgs, load: LoadTracker, *, prometheus: bool = False) -> AsyncLLM:
    # Custom loggers replace vLLM's default ones; keep its periodic log line unless asked not to.
    loggers: list[StatLoggerFactory] = [load.stat_logger]
    if not engine_args.disable_log_stats:
        loggers.append(LoggingStatLogger)
    if prometheus:
        loggers.append(PrometheusStatLogger)
    return AsyncLLM.from_engine_args(engine_args, stat_loggers=loggers)
