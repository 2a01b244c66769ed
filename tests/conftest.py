import multiprocessing
import os
import signal
import threading

import pytest

from graph.workers import leave_realtime_scheduling
from tests.video.videos import CASES, make_two_video_streams, make_video


@pytest.fixture
def no_leftovers():
    """Fails the test if it leaves reelflow threads, child processes or shared memory behind."""
    shm_before = set(os.listdir("/dev/shm"))
    yield
    threads = [t.name for t in threading.enumerate() if t.name.startswith("reelflow-") and t.is_alive()]
    children = multiprocessing.active_children()
    assert not threads, f"threads left behind: {threads}"
    assert not children, f"processes left behind: {children}"
    # Intel's OpenMP registers each process that loads it in /dev/shm (__KMP_REGISTERED_LIB_<pid>)
    # and removes the entry at exit: any process on the machine may add or leave one meanwhile
    # (a killed one leaves it), and it is the runtime's, not reelflow's
    left = {name for name in set(os.listdir("/dev/shm")) - shm_before if not name.startswith("__KMP_REGISTERED_LIB_")}
    assert left == set(), f"shared-memory segments left behind: {sorted(left)}"


@pytest.fixture
def ctrl_c():
    """Ctrl-C (SIGINT, `_thread.interrupt_main`) raises KeyboardInterrupt in this process during
    the test, even when pytest was started with SIGINT ignored: a command a non-interactive shell
    starts in the background inherits that, and a simulated Ctrl-C would then do nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def sigint_as_default() -> None:
    """For a test's child process (subprocess preexec_fn): SIGINT back to its default, so that the
    child's Python turns it into KeyboardInterrupt whatever this process inherited (see ctrl_c)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def stays_time_shared():
    """Fails a test that leaves this process under a real-time scheduling policy (and puts it
    back): every later test's processes would inherit it and could livelock the machine."""
    yield
    if leave_realtime_scheduling():
        pytest.fail("the test left the process under a real-time scheduling policy (SCHED_FIFO/RR)")


@pytest.fixture(scope="session")
def videos(tmp_path_factory):
    """One small file of every kind in tests/video/videos.py (codecs, containers, GOPs), made once."""
    root = tmp_path_factory.mktemp("videos")
    return {case: make_video(case, root / case) for case in CASES}


@pytest.fixture(scope="session")
def two_streams(tmp_path_factory):
    """An mp4 whose best video stream is not its first (see make_two_video_streams)."""
    return make_two_video_streams(tmp_path_factory.mktemp("streams"))
