"""Workers: the process-wide runtime they start from (scheduling policy)."""

import os
import threading

import pytest

from graph.workers import leave_realtime_scheduling


def test_a_realtime_policy_is_left_before_workers_inherit_it(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(os, "sched_getscheduler", lambda pid: os.SCHED_FIFO)
    monkeypatch.setattr(os, "sched_setscheduler", lambda pid, policy, param: calls.append((pid, policy, param.sched_priority)))
    assert leave_realtime_scheduling()
    assert calls == [(0, os.SCHED_OTHER, 0)]
    assert "real-time scheduling policy (SCHED_FIFO" in caplog.text


def test_time_sharing_is_left_alone(monkeypatch):
    def refuse(*args):
        raise AssertionError("must not change a time-sharing policy")

    monkeypatch.setattr(os, "sched_getscheduler", lambda pid: os.SCHED_OTHER)
    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    assert not leave_realtime_scheduling()


def test_a_real_fifo_thread_gets_time_sharing_back():
    seen = {}

    def body():
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))  # this thread only
        except PermissionError:
            seen["denied"] = True
            return
        seen["left"] = leave_realtime_scheduling()
        seen["policy"] = os.sched_getscheduler(0)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if seen.get("denied"):
        pytest.skip("entering SCHED_FIFO needs CAP_SYS_NICE (the monkeypatched tests above cover the logic)")
    assert seen == {"left": True, "policy": os.SCHED_OTHER}
