"""Every engine process dies with its parent, however the parent dies (SIGKILL included).

vLLM's AsyncLLM starts an EngineCore process, which starts its executor's Worker process(es). They watch
their parent only in ways a SIGKILL skips: a worker killed with `kill -9` left its EngineCore (0.75 GB)
and Worker (3.4 GB) running as orphans, and a worker restarted after each crash would pile them up.

Linux can send a signal to a process when its parent dies (prctl PR_SET_PDEATHSIG). vLLM runs every
`vllm.general_plugins` entry point (pyproject.toml) first thing in the EngineCore process and in each
executor worker process (EngineCore.__init__, WorkerWrapperBase.init_worker), so `register` below asks
for SIGKILL there. Only where our worker said so (`arm()` before it starts the engine: the variable
DIE_WITH_PARENT_ENV holds the pid the process's parent must have), so that vLLM used on its own by
anyone else is untouched.

It checks itself: a parent that died before prctl was called would send no signal, so the process then
checks that its parent is still the one it was started by, and kills itself if that one is gone. Each
armed process then names itself as the expected parent of the processes it starts. A child made by
fork() (vLLM's default start method off CPU) inherits vLLM's "plugins loaded" flag and would skip the
plugin, so armed processes also register an at-fork hook that does the same in the child.

The signal follows the thread that started the process, not the whole process: our worker and vLLM's
EngineCore start their children from their main thread, which lives as long as the process.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)

DIE_WITH_PARENT_ENV = "TACO_LLM_DIE_WITH_PARENT"
PLUGIN_NAME = "taco_llm_die_with_parent"  # its name in pyproject.toml's vllm.general_plugins
_PR_SET_PDEATHSIG = 1
_PR_GET_PDEATHSIG = 2
# This process's pid once it has armed its children (a forked child sees its parent's).
_armed_pid: int | None = None


def arm() -> None:
    """In the worker, before the engine starts: the engine processes it starts will die with it."""
    _arm_children()
    # VLLM_PLUGINS, when set, is the list of general plugins vLLM loads; without ours there, orphans again.
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        os.environ["VLLM_PLUGINS"] = ",".join(filter(None, [*allowed.split(","), PLUGIN_NAME]))
        logger.info("VLLM_PLUGINS: added %s, so that the engine's processes die with this worker", PLUGIN_NAME)


def _arm_children() -> None:
    """Whatever this process starts next dies with it: spawned children through the plugin (they read
    the variable), forked ones through the fork hook (they inherit vLLM's "plugins loaded" flag, so the
    plugin would not run in them)."""
    global _armed_pid
    os.environ[DIE_WITH_PARENT_ENV] = str(os.getpid())
    if _armed_pid is None:
        os.register_at_fork(after_in_child=_after_fork)
    _armed_pid = os.getpid()


def _after_fork() -> None:
    if _armed_pid is not None:
        _die_with(_armed_pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Resolved once, at import: a child forked from a threaded process must not dlopen (it may take a lock
# another thread held at the fork).
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _set_death_signal() -> bool:
    """Asks Linux for SIGKILL when this process's parent dies; whether it took."""
    libc = _LIBC
    if libc is None:
        return False
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d)", ctypes.get_errno())
        return False
    current = ctypes.c_int(0)
    libc.prctl(_PR_GET_PDEATHSIG, ctypes.byref(current), 0, 0, 0)
    return current.value == signal.SIGKILL


def _die_with(parent: int) -> None:
    if not sys.platform.startswith("linux"):
        logger.info("engine process %d: no parent-death signal on %s; it may outlive a killed worker",
                    os.getpid(), sys.platform)
        return
    if not _set_death_signal():
        logger.warning("engine process %d will not die with its parent %d", os.getpid(), parent)
        return
    if os.getppid() != parent:
        if not _alive(parent):
            # The parent died before prctl took effect: no signal will come.
            os.kill(os.getpid(), signal.SIGKILL)
        # Started through an intermediate process: the signal follows that one.
        logger.warning("engine process %d: its parent is %d, not %d; it dies with %d", os.getpid(), os.getppid(),
                       parent, os.getppid())
    _arm_children()


def register() -> None:
    """vLLM's general-plugin hook, run in each of its processes (our worker's own included)."""
    expected = os.environ.get(DIE_WITH_PARENT_ENV)
    if not expected or not expected.isdigit() or int(expected) == os.getpid():
        return  # not armed, or the worker itself (vLLM loads general plugins there too)
    _die_with(int(expected))
