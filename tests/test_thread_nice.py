"""The engine's nice value is a floor: a thread already at a higher nice value keeps it (taking it
back down would need privileges, and the operator chose it), a thread at a lower one is given the
value asked. Each case runs in a thread of its own, so the test process keeps its priority."""
from __future__ import annotations

import os
import sys
import threading

import pytest

from workers.service import _set_thread_nice

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def nice_after(start: int, asked: int) -> int:
    """In a new thread at nice `start`, ask for `asked`; the thread's nice value afterwards."""
    seen = []

    def run():
        thread_id = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread_id, start)
        _set_thread_nice(asked)
        seen.append(os.getpriority(os.PRIO_PROCESS, thread_id))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


BASE = os.getpriority(os.PRIO_PROCESS, 0)  # the test process's own nice value: the cases are relative to it


@pytest.mark.skipif(BASE > 11, reason="the cases need nice values up to 8 above the process's, and 19 is the most")
@pytest.mark.parametrize("start, asked, expected", [
    (0, 3, 3),  # given the value asked
    (8, 3, 8),  # already higher: kept (as root it could be taken down; the worker's own choice stands)
    (5, 5, 5),
])
def test_the_nice_value_is_a_floor(start, asked, expected):
    assert nice_after(BASE + start, BASE + asked) == BASE + expected
