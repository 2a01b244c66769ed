import multiprocessing
import os
import threading

import pytest

from graph.workers import REALTIME_POLICIES


@pytest.fixture
def no_leftovers():
    """Fails the test if it leaves reelflow threads, child processes or shared memory behind."""
    shm_before = set(os.listdir("/dev/shm"))
    yield
    threads = [t.name for t in threading.enumerate() if t.name.startswith("reelflow-") and t.is_alive()]
    children = multiprocessing.active_children()
    assert not threads, f"threads left behind: {threads}"
    assert not children, f"processes left behind: {children}"
    assert set(os.listdir("/dev/shm")) - shm_before == set(), "shared-memory segments left behind"


@pytest.fixture(autouse=True)
def stays_time_shared():
    """Fails a test that leaves this process under a real-time scheduling policy (and puts it
    back): every later test's processes would inherit it and could livelock the machine."""
    yield
    if os.sched_getscheduler(0) in REALTIME_POLICIES:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        pytest.fail("the test left the process under a real-time scheduling policy (SCHED_FIFO/RR)")
