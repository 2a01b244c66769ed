import os
import threading

import multiprocessing
import pytest


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
