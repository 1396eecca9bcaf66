"""The training process around the loop: its process group and its stop signals.

* :func:`init_distributed_from_env` -- ``torch.distributed`` initialised from torchrun's environment
  (NCCL on GPU, gloo on CPU); nothing to do in a single process.
* :func:`leave_process_group` -- the last act of a distributed process: every rank done (a barrier, on
  success), the process group destroyed, output flushed, then ``os._exit`` -- skipping the interpreter's
  teardown, where a gloo worker thread still alive at C++ static destruction aborts a finished rank with
  "terminate called without an active exception" (SIGABRT, exit -6; seen twice on a loaded 2-core machine,
  once under torchrun and once under ``torch.multiprocessing.spawn``, both after the work was done).
* :func:`catch_stop_signals` -- the first SIGINT or SIGTERM (what schedulers send before killing a job)
  becomes a callback (the trainer's "stop after this step"); later ones are ignored, with one line saying so,
  while the step and its checkpoint are finished (SIGQUIT, Ctrl-\\, or SIGKILL end the process at once).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["STOP_SIGNALS", "catch_stop_signals", "stop_signals", "init_distributed_from_env", "leave_process_group",
           "leaving_process_group"]

#: what stops a run at the end of its step, with a checkpoint: Ctrl-C, SIGTERM (kill, timeout, schedulers) and SIGHUP
#: (the terminal or SSH session closed: campaign 26 SG20) -- unless the process was started with SIGHUP ignored
#: (``nohup``), which is kept (:func:`catch_stop_signals`)
STOP_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


def stop_signals() -> list[int]:
    """:data:`STOP_SIGNALS` less SIGHUP where it is ignored (``nohup``: the user asked the run to outlive the
    terminal)."""
    hup = getattr(signal, "SIGHUP", None)
    return [s for s in STOP_SIGNALS if not (s == hup and signal.getsignal(s) == signal.SIG_IGN)]


def init_distributed_from_env() -> bool:
    """Initialise torch.distributed when launched by torchrun (WORLD_SIZE > 1)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    return True


def leave_process_group(code: int = 0):
    """End this process with ``code`` (never returns): on success wait for every rank (so none closes its
    connections while another still talks), destroy the process group, flush stdout and stderr, and
    ``os._exit(code)``.  Without a process group it only flushes and exits.  Atexit handlers do not run:
    call it when everything the process writes is written."""
    if dist.is_initialized():
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def leaving_process_group():
    """Run the block, then :func:`leave_process_group` (exit 0).  An exception in the block destroys the process
    group and propagates (so ``torch.multiprocessing.spawn`` or torchrun reports it with its traceback)."""
    try:
        yield
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    leave_process_group(0)


def catch_stop_signals(on_stop: Callable[[int], None]) -> Callable[[], None]:
    """Turn the first SIGINT, SIGTERM or SIGHUP (:func:`stop_signals`) into ``on_stop(signum)``; later ones are
    ignored while the trainer finishes the step and its checkpoint (a second Ctrl-C must not tear a checkpoint
    half-written or end the process in a traceback), with one line on stderr the first time.  SIGQUIT (Ctrl-\\)
    and SIGKILL still end the process at once.  Returns the function that puts the previous handlers back.  Off
    the main thread, where Python cannot install signal handlers, nothing is caught."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {s: signal.getsignal(s) for s in stop_signals()}
    caught: list[int] = []

    def handler(signum, frame):
        caught.append(signum)
        if len(caught) == 1:
            on_stop(signum)
        elif len(caught) == 2:  # os.write: print() inside a handler can collide with the interrupted print
            os.write(2, (f"seco-lab: already stopping ({signal.Signals(signum).name} ignored); finishing the step "
                         f"and its checkpoint -- Ctrl-\\ or kill -9 {os.getpid()} ends it at once, losing "
                         "them\n").encode())

    for s in previous:
        signal.signal(s, handler)

    def restore():
        for s, h in previous.items():
            signal.signal(s, h)

    return restore
