"""The study runner: every missing cell of a study, each in a spawned worker process.

    run_cells(work, tasks, jobs=J)   ->   [work(task) for task in tasks]   (in completion order)

with W = min(J, len(tasks), CPU count) worker processes (spawned, so a worker inherits no
state of the parent, and with the BLAS/OpenMP pools at one thread, so every sum is taken in the
same order on every run).  ``isolate=True`` gives every task a fresh process (its peak memory
is its own).  With W = 1 and no isolation the tasks run in this process.  A worker that dies
(killed, out of memory) stops the study with an error that says a rerun resumes it: the cells
already stored are kept, because each task writes its own cell atomically (``seco_lab.store``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from multiprocessing import get_context

from tqdm.auto import tqdm

__all__ = ["KILL_HOOK", "SINGLE_THREAD_ENV", "Terminated", "WorkerDied", "run_cells", "terminate_as_interrupt",
           "usable_cores", "worker_count"]

# BLAS/OpenMP pools of worker processes: one thread each, so every sum is taken in the same order on every run
SINGLE_THREAD_ENV = {v: "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


class WorkerDied(RuntimeError):
    """A worker process ended without returning (killed, out of memory)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what ``kill``, ``timeout`` and cluster schedulers send first), raised like Ctrl-C so that the same
    handler stops the workers: no process of the study outlives the command (campaign 24 F1).  Exit 143."""


@contextmanager
def terminate_as_interrupt():
    """Within: SIGTERM or SIGHUP raises :class:`Terminated` in the main thread (off it, nothing is changed)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    # SIGTERM (kill, timeout, schedulers) and SIGHUP (the terminal closed; campaign 25 N2), not a SIGHUP the study
    # was started to ignore (``nohup``: campaign 26)
    hup = getattr(signal, "SIGHUP", None)
    stops = [s for s in (signal.SIGTERM, hup)
             if s is not None and not (s == hup and signal.getsignal(s) == signal.SIG_IGN)]
    previous = {s: signal.signal(s, handler) for s in stops}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


#: for tests of resuming: SIGKILL the study's process group once this many cells are done in this session
KILL_HOOK = "SECO_LAB_STUDY_KILL_AFTER_CELLS"


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. under taskset or a cgroup), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def worker_count(jobs: int, tasks: int) -> int:
    """min(jobs, tasks, usable cores), at least 1: ``--jobs 1000`` for 8 cells on 2 cores starts 2 workers."""
    return max(1, min(int(jobs), int(tasks), usable_cores()))


def _kill_hook(done: int) -> None:
    """A deterministic crash point (``SECO_LAB_STUDY_KILL_AFTER_CELLS=N``): a kill no machine load can move."""
    at = os.environ.get(KILL_HOOK)
    if at and done >= int(at):
        import signal

        os.killpg(os.getpgid(0), signal.SIGKILL)


#: seconds between a worker's looks at its parent (:func:`_exit_with_parent`)
PARENT_POLL_S = 0.5


def _exit_with_parent(parent: int, poll: float = PARENT_POLL_S) -> None:
    """A worker's watchdog thread: end the worker at once when ``parent`` (the study's process) is gone.  A parent
    stopped by SIGKILL (``kill -9``, the OOM killer) runs no handler that could stop its workers, which otherwise
    go on storing cells, then wait for ever (campaign 26 ST31b).  Gone: its pid no longer exists, or this
    process's parent pid changed (it was re-parented to init or a subreaper).  ``os._exit``: no cleanup, like the
    SIGTERM a live parent sends; the cell in flight is not stored (each cell's files are written atomically), and
    none after it."""
    import time

    start = os.getppid()  # ``parent`` itself under spawn; a fork server under forkserver
    while os.getppid() == start and _exists(parent):
        time.sleep(poll)
    os._exit(128 + 9)  # as if SIGKILLed with the parent


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. not ours to signal: it exists
        pass
    return True


def _worker_init() -> None:
    """A worker's initializer: Ctrl-C is the parent's to handle (one message, not a traceback per worker); and
    tqdm's write lock is a thread lock, not its default multiprocessing one, whose semaphore a worker stopped on
    Ctrl-C never releases (the "resource_tracker: ... leaked semaphore objects" warning at exit).  A daemon thread
    ends the worker once its parent is gone, however the parent ended (:func:`_exit_with_parent`)."""
    import multiprocessing
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's terminate() ends a worker at once
    tqdm.set_lock(threading.RLock())
    # the study's process, as multiprocessing recorded it: also right when it died before this worker got here
    parent = getattr(multiprocessing.parent_process(), "pid", None) or os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), name="seco-lab-parent-watchdog", daemon=True).start()


@contextmanager
def _single_threaded_children():
    saved = {k: os.environ.get(k) for k in SINGLE_THREAD_ENV}
    os.environ.update(SINGLE_THREAD_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_cells(work: Callable, tasks: Iterable, jobs: int = 1, isolate: bool = False, progress: bool = True,
              desc: str = "cells", done: int = 0, on_result: Callable | None = None) -> list:
    """``work(task)`` for every task (``work`` a module-level function, tasks picklable); returns the
    results in completion order.  ``done`` cells already stored start the progress bar; ``on_result``
    is called with each result as it arrives (e.g. to name the cell just finished)."""
    tasks = list(tasks)
    bar = tqdm(total=done + len(tasks), initial=done, desc=desc, unit="cell", disable=not progress)
    results = []

    def finished(result):
        results.append(result)
        if on_result is not None:
            on_result(result)
        bar.update()
        _kill_hook(len(results))

    try:
        workers = worker_count(jobs, len(tasks))
        if workers == 1 and not isolate:
            for task in tasks:
                finished(work(task))
            return results
        with terminate_as_interrupt(), _single_threaded_children(), ProcessPoolExecutor(
                workers, mp_context=get_context("spawn"), max_tasks_per_child=1 if isolate else None,
                initializer=_worker_init) as pool:
            futures = [pool.submit(work, task) for task in tasks]
            try:
                for future in as_completed(futures):
                    finished(future.result())
            except BrokenProcessPool:
                raise WorkerDied(f"a worker process of {desc!r} died (killed, or out of memory?); the cells "
                                 "finished so far are stored: rerun the same command to resume") from None
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM (Terminated): stop the workers (a cell's files are written
                # atomically, so a stopped cell is simply not done).  No future is cancelled: the pool fails the
                # pending ones itself once its workers are gone (cancelling them first makes it raise)
                for process in list((getattr(pool, "_processes", None) or {}).values()):
                    process.terminate()
                raise
            except BaseException:  # a failing cell: start nothing more
                for future in futures:
                    future.cancel()
                raise
        return results
    finally:
        bar.close()
