"""video/codec.py's shared-memory frames: what a killed process leaves in /dev/shm can be removed
by whoever outlives it, and nothing of a live process is touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from video.codec import SharedFrames, remove_segments_of


def test_the_segments_of_a_killed_process_are_removed_and_a_live_ones_kept():
    code = ("import time; from video.codec import SharedFrames; s = SharedFrames((1, 3, 4, 4)); "
            "print(s.path, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        path = child.stdout.readline().strip()
        assert os.path.exists(path)
        assert remove_segments_of(child.pid) == [] and os.path.exists(path)        # alive: in use
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert remove_segments_of(child.pid) == [path] and not os.path.exists(path)
    finally:
        child.kill()
        child.wait()
    with SharedFrames((1, 3, 4, 4)) as mine:
        assert remove_segments_of(os.getpid()) == [] and os.path.exists(mine.path)
