"""cluster=ray as a user runs it, on a local Ray with this machine's 2 CPUs: 6 held-out toy videos
over 2 workers give the local run's tokens, a bad video among them is one failed row; a worker
killed mid-run is replaced and every result is there; Ctrl-C leaves nothing behind and a resumed
run loses nothing and repeats nothing. Every test checks that no Ray process, actor or /dev/shm
segment outlives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from job.run import run_job
from models.registry import release_all
from stages.source import load_requests
from tests.conf.test_experiments import composed
from tests.test_run import ROOT, run

SECONDS = 30          # a request takes ~0.3 s: long enough to kill a worker or interrupt while others run


def ray_processes() -> set[int]:
    """Ray's own processes (GCS, raylet, workers) on this machine."""
    out = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "gcs_server" in cmd or "raylet" in cmd or cmd.startswith("ray::") or "default_worker.py" in cmd:
            out.add(int(pid))
    return out


@pytest.fixture
def nothing_left():
    shm, before = set(os.listdir("/dev/shm")), ray_processes()
    yield
    deadline = time.time() + 10          # a killed process takes a moment to go
    while time.time() < deadline and ray_processes() - before:
        time.sleep(0.2)
    assert ray_processes() - before == set(), "Ray processes left behind"
    assert set(os.listdir("/dev/shm")) - shm == set(), "shared-memory segments left behind"


@pytest.fixture(scope="module")
def manifests(tmp_path_factory):
    """6 held-out toy videos (a manifest), the same with a corrupt file in the middle, and the local
    run's tokens for the 6."""
    from zoo.videos import ensure_video

    root = tmp_path_factory.mktemp("ray")
    rows = [{"path": str(ensure_video(seed, SECONDS, 2, 84)[0]), "id": f"s{seed}"} for seed in range(40, 46)]
    good = root / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad_video = root / "broken.mp4"
    bad_video.write_bytes(b"\x00\x00\x00\x18ftypmp42" + os.urandom(4000))
    mixed = root / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in rows[:3] + [{"path": str(bad_video), "id": "broken"}] + rows[3:]))
    # the local run, in this process (python -m run's job without its CLI: the same code path)
    cfg = composed(["data=manifest", f"data.manifest={good}"])
    metrics = run_job(cfg, load_requests(cfg.data), root)
    local = {r["request"]: r["output_ids"] for r in metrics["runs"]}
    release_all()
    return good, mixed, local


def results(run_dir: Path) -> list[dict]:
    path = run_dir / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def tokens(run_dir: Path) -> dict[str, list]:
    return {r["request"]: r["metrics"]["output_ids"] for r in results(run_dir) if r["status"] == "ok"}


def test_two_workers_give_the_local_tokens_and_a_bad_video_is_one_failed_row(manifests, tmp_path, nothing_left):
    _, mixed, local = manifests
    out = run("data=manifest", f"data.manifest={mixed}", "cluster=ray", "cluster.workers=2", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    rows = results(tmp_path)
    assert sorted(r["index"] for r in rows) == list(range(7))
    failed = [r for r in rows if r["status"] != "ok"]
    assert [(r["request"], r["attempts"]) for r in failed] == [("broken", 1)]           # never retried
    assert "decode" in failed[0]["error"]
    assert tokens(tmp_path) == local
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert [r["request"] for r in metrics["runs"]] == ["s40", "s41", "s42", "s43", "s44", "s45"]   # request order
    assert metrics["failed"][0]["request"] == "broken" and metrics["cluster"]["failed"] == 1
    assert len({w["pid"] for w in metrics["cluster"]["workers"]}) == 2
    assert "| broken | 1 |" in (tmp_path / "summary.md").read_text()
    assert "== broken:" in (tmp_path / "error.txt").read_text() and "Traceback" in (tmp_path / "error.txt").read_text()
    assert (tmp_path / "trace.json").exists() and (tmp_path / "timeline.png").exists()
    console = out.stdout + out.stderr                                             # its last word
    assert "6 of 7 requests answered" in console and "answers in results.jsonl" in console


def start(args: list[str]) -> subprocess.Popen:
    """`python -m run` as a terminal starts it: SIGINT at its default, whatever this process has
    (a shell ignores it in a job it starts in the background, and the child would inherit that)."""
    return subprocess.Popen([sys.executable, "-m", "run", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_results(proc: subprocess.Popen, run_dir: Path, n: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while len(results(run_dir)) < n:
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"the run ended or stalled before {n} results:\n{proc.communicate()[1][-4000:]}")
        time.sleep(0.01)


def test_a_killed_worker_is_replaced_and_every_result_is_there(manifests, tmp_path, nothing_left):
    good, _, local = manifests
    proc = start(["data=manifest", f"data.manifest={good}", "cluster=ray", "cluster.workers=2", f"hydra.run.dir={tmp_path}"])
    wait_for_results(proc, tmp_path, 1)            # 5 requests to go: both workers have more to do
    workers = [p for p in ray_processes() if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"ray::RequestWorker")]
    assert len(workers) == 2, workers
    os.kill(workers[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert tokens(tmp_path) == local
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["cluster"]["replaced_workers"] == 1 and "failed" not in metrics
    assert len(metrics["runs"]) == 6


def test_ctrl_c_leaves_nothing_and_the_resumed_run_loses_and_repeats_nothing(manifests, tmp_path, nothing_left):
    good, _, local = manifests
    args = ["data=manifest", f"data.manifest={good}", "cluster=ray", "cluster.workers=1", f"hydra.run.dir={tmp_path}"]
    proc = start(args)
    wait_for_results(proc, tmp_path, 2)
    os.killpg(proc.pid, signal.SIGINT)            # Ctrl-C at a terminal: the whole foreground group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    before = results(tmp_path)
    assert 2 <= len(before) < 6 and all(r["status"] == "ok" for r in before)
    resumed = run(*args, "cluster.resume=true")
    assert resumed.returncode == 0, resumed.stderr
    after = results(tmp_path)
    assert after[:len(before)] == before                                          # kept as they were
    assert sorted(r["index"] for r in after) == list(range(6))                    # each once: none repeated
    assert tokens(tmp_path) == local
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["cluster"]["requests"] == 6 - len(before) and len(metrics["runs"]) == 6


def test_a_worker_that_cannot_set_up_stops_the_run_with_its_reason(tmp_path, nothing_left):
    """A bad model path fails every worker alike: one message, exit 1, no endless replacing."""
    out = run("cluster=ray", "cluster.workers=1", "model.target.path=/nonexistent", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 1
    assert "reelflow: run failed: a Ray worker could not set up the graph" in out.stderr
    assert "model path '/nonexistent'" in out.stderr and not (tmp_path / "metrics.json").exists()
