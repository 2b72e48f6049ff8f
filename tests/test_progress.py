"""Progress bars: a process killed while it drew one stops no other process."""

from __future__ import annotations

import os
import signal
import threading

from tqdm import tqdm

from offload import progress as bars


def test_a_process_killed_holding_the_bars_lock_stops_no_other_process():
    """tqdm's class-wide lock holds a semaphore shared by every process forked after it was made: a process killed
    (SIGKILL, the OOM killer) while it held it, in the middle of a save's bar, left it taken, and every sibling's
    next bar (so its next save) waited for ever. The library's bars lock within their process only."""
    tqdm.get_lock()  # made before the fork, as by a parent that showed a bar
    bars.progress(1, "before the fork", enabled=False).close()
    pid = os.fork()
    if pid == 0:  # the child takes the lock a bar takes, and dies holding it
        try:
            bars.progress(1, "child", enabled=False).get_lock().acquire()
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    made = threading.Event()

    def bar():
        bars.progress(1, "after the kill", enabled=False).close()
        made.set()

    threading.Thread(target=bar, daemon=True).start()
    assert made.wait(30), "a bar waited for a lock that a killed process held"
