"""Ranks of a gloo job forked from the current process (torch imported once), for the distributed tests' workers."""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from typing import Callable


def fork_ranks(world: int, rank_main: Callable[[int], None], timeout: float) -> list[int]:
    """Fork ``world`` processes, rank ``r`` running ``rank_main(r)``, and wait for them; returns their exit codes
    in rank order (0: it returned; 1: it raised, the traceback printed; minus the signal for one killed by a
    signal, as subprocess says). A rank still running after ``timeout`` seconds is SIGKILLed."""
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                rank_main(rank)
                code = 0
            except BaseException:  # printed for the test's report
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # no teardown: a rank that died may leave gloo waiting in its peer
        pids.append(pid)
    codes, deadline = {}, time.monotonic() + timeout
    while len(codes) < world:
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        if time.monotonic() > deadline:
            for pid in pids:
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
            deadline = float("inf")  # their statuses are collected above
        time.sleep(0.02)
    return [codes[p] for p in pids]
