"""A worker that ``meshlm train``, ``generate`` or ``serve`` started ends with its launcher.

NOTE [launcher death]
    The launcher's elastic agent stops the workers when the job ends, fails or is signalled
    (SIGTERM, SIGINT: NOTE [stopping on a signal] in meshlm/train/lifecycle.py).  A launcher killed
    outright (``kill -9``, the OOM killer) runs no code, so each worker watches it instead:
    multiprocessing keeps in the launcher the write end of a pipe whose read end the worker
    holds (the sentinel of ``multiprocessing.parent_process()``, the launcher under both the
    ``forkserver`` and the ``spawn`` start method), and the kernel closes it when the
    launcher dies, however it dies.  A daemon thread waits on it; when it closes, the worker
    says so on stderr (rank 0) and in its log, and leaves with ``os._exit`` at once, whatever
    its main thread is doing: no new checkpoint save starts, and a save in progress is
    abandoned in its ``.tmp_step_<N>`` directory, which no resume reads and the next save
    removes (NOTE [commit protocol] in meshlm/train/checkpoint/__init__.py), so the earlier checkpoints
    stay whole.  Exiting takes the worker's checkpoint-directory lock with it
    (NOTE [one writer per checkpoint directory] in meshlm/train/checkpoint/lock.py).

    A process that multiprocessing did not start (one rank under torchrun, or a one-process
    run) has no such parent and is not watched: torchrun's agent, or the user's shell, owns it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
from typing import Any, Callable

#: the exit status of a worker whose launcher died (nobody reads it; 128 + SIGHUP's number,
#: as a shell reports a process its terminal's hang-up ended)
EXIT_STATUS = 129


def watch_launcher(on_death: Callable[[], None] = lambda: None) -> bool:
    """Start the thread that ends this process when the launcher that started it dies
    (NOTE [launcher death]); ``on_death`` runs first (quick clean-up: it must not wait on
    other ranks).  False when this process has no launcher to watch."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return False
    pid = parent.pid

    def wait() -> None:
        parent.join()  # returns when the launcher's end of the pipe closes: it died
        rank = os.environ.get("RANK", "?")
        msg = f"meshlm: the launcher (pid {pid}) is gone; worker rank {rank} (pid {os.getpid()}) stops now"
        try:
            if rank == "0":
                os.write(2, (msg + "\n").encode())
            for name in ("meshlm", "meshlm.app.train"):
                logger = logging.getLogger(name)
                if logger.handlers:
                    logger.warning(msg)
                    for h in logger.handlers:
                        h.flush()
            on_death()
        finally:
            os._exit(EXIT_STATUS)

    threading.Thread(target=wait, name="meshlm-launcher-watch", daemon=True).start()
    return True


def _drop_swap_files() -> None:
    """os._exit skips atexit: remove this rank's offload swap files (NOTE [offload tiers])."""
    store = sys.modules.get("meshlm.runtime.offload.store")
    if store is not None:
        store.close_all()


def watched(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a worker that ends with its launcher: what ``meshlm.app.launch`` runs in
    each worker process."""
    watch_launcher(_drop_swap_files)
    return fn(*args)
