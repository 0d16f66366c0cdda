"""Starting vLLM's AsyncLLM, and the load figures it reports after every step."""

from __future__ import annotations

import logging
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


class LoadTracker:
    """One engine's latest scheduler counts, for GetLoad.

    vLLM builds its stat loggers itself, from factories it calls with (config, engine index);
    `stat_logger` is such a factory, so each logger it makes writes into this tracker and no state
    is shared between engines (or tests) through the class."""

    def __init__(self) -> None:
        self.latest = LoadSnapshot()

    def stat_logger(self, vllm_config: VllmConfig, engine_index: int = 0) -> StatLoggerBase:
        return _LoadLogger(self, engine_index)


class _LoadLogger(StatLoggerBase):
    """vLLM calls `record` on the event loop after every engine step: it only copies three numbers."""

    def __init__(self, tracker: LoadTracker, engine_index: int = 0):
        # StatLoggerBase declares (vllm_config, engine_index); vLLM never calls this class itself, only
        # LoadTracker.stat_logger does.
        self.tracker = tracker
        self.engine_index = engine_index

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: object = None, engine_idx: int = 0) -> None:
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
