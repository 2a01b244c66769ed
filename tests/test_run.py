"""`python -m run` as a user runs it: every experiment composes and validates, a real run leaves its
files, a bad config is one readable message, sweeps run with the basic and joblib launchers, and
Ctrl-C cancels cleanly."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from job.run import prepare
from tests.conftest import sigint_as_default

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
SMALL_DEMO = ["graph.nodes.source.stage.items=6", "graph.nodes.check.stage.rounds=8", "executor.warmup=0"]


def run(*args, timeout=240):
    """`python -m run ...` in its own process group, killed whole (workers too) if it overruns.

    Its output goes to files, not pipes: waiting for a pipe's end would also wait for every
    process that inherited it (a sweep launcher's workers), and a full pipe would stall the run."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "run", *args], cwd=ROOT, stdout=out, stderr=err,
                                text=True, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.kill(proc.pid, signal.SIGUSR1)  # run.py prints every thread's stack on it: where it was stuck
            time.sleep(2)
        finally:
            with contextlib.suppress(ProcessLookupError):  # whatever of the group is left, workers too
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if timed_out:
        pytest.fail(f"python -m run {' '.join(args)} did not finish in {timeout} s:\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_validates(name):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"+experiment={name}"])
    if cfg.get("train"):       # train_* run a trainer, not a graph: their keys must parse (and check)
        from omegaconf import OmegaConf

        from zoo.train.recipes import check, recipe_of

        check(*recipe_of(OmegaConf.to_container(cfg.train, resolve=True)))
        return
    spec, plan = prepare(cfg)  # the whole validation, no stage is built
    assert spec.nodes and plan.nodes


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "conf" / "sweep").glob("*.yaml")))
def test_every_saved_sweep_composes_with_the_demo(name):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=demo", f"+sweep={name}"], return_hydra_config=True)
    assert cfg.hydra.mode.name == "MULTIRUN" and cfg.hydra.sweeper.params
    prepare(cfg)


def test_saved_sweep_runs_without_dash_m(tmp_path):
    out = run("+experiment=demo", "+sweep=runners", *SMALL_DEMO, f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    table = (tmp_path / "report.md").read_text()
    assert "| threaded |" in table and "| sequential |" in table and "speedup" in table


def test_every_graph_validates_on_every_resources_config():
    graphs = sorted(p.stem for p in (ROOT / "conf" / "graph").glob("*.yaml"))
    for resources in ("cpu", "split", "gpu", "gpu2", "gpu_split"):
        for graph in graphs:
            with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
                cfg = compose("config", overrides=[f"graph={graph}", f"resources={resources}"])
            prepare(cfg, n_cuda=0)
            prepare(cfg, n_cuda=2)


def test_cfg_job_prints_the_composed_config():
    out = run("+experiment=demo", "graph.nodes.check.stage.rounds=7", "--cfg", "job")
    assert out.returncode == 0, out.stderr
    assert "rounds: 7" in out.stdout and "_target_: bench.synthetic.Checker" in out.stdout


def test_a_home_relative_path_after_a_key_is_expanded_as_a_user_types_it():
    from run import expand_home

    home = os.path.expanduser("~")
    assert expand_home(["data.folder=~/videos", "-m", "data.path=~/a.mp4,~/b.mp4", "~model.draft", "x=a~/b"]) == \
        [f"data.folder={home}/videos", "-m", f"data.path={home}/a.mp4,{home}/b.mp4", "~model.draft", "x=a~/b"]
    out = run("+experiment=train_draft", "data=folder", "data.folder=~/my-videos", "--cfg", "job")
    assert out.returncode == 0, out.stderr
    assert f"folder: {home}/my-videos" in out.stdout


def test_demo_run_leaves_every_file(tmp_path):
    out = run("+experiment=demo", *SMALL_DEMO, f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    for name in (".hydra/config.yaml", "plan.txt", "trace.json", "timeline.png", "metrics.json", "run.log"):
        assert (tmp_path / name).is_file(), name
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("experiment", "model", "video", "output_text", "output_ids", "n_generated", "wall_s", "ttft_s",
                "decode_s", "stages", "memory", "ideal_wall_s", "efficiency"):
        assert key in metrics, key
    assert metrics["experiment"] == "demo" and metrics["stages"]["consume"]["calls"] == 6
    assert 0 < metrics["ttft_s"] < metrics["wall_s"] and metrics["ideal_wall_s"] <= metrics["wall_s"] * 1.05
    trace = json.loads((tmp_path / "trace.json").read_text())
    rows = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert rows == {"cpu", "target", "draft"}
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_a_bad_kernel_setting_in_the_environment_is_one_readable_message(tmp_path, monkeypatch):
    """$REELFLOW_PREFIX_KERNEL is read when the attention kernel's module loads; a bad value is a
    config problem of the run (exit 2, before any setup), not a failed import."""
    monkeypatch.setenv("REELFLOW_PREFIX_KERNEL", "block_n=48")
    out = run("+experiment=demo", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 2, out.stderr
    assert "REELFLOW_PREFIX_KERNEL='block_n=48': block_n=48: a power of two ≥ 16" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("override,expect", [
    ("graph.nodes.consume.inputs.item=check.tokens", "node 'consume' input 'item' expects Payload but check.tokens gives Tokens"),
    ("graph.nodes.consume.on=gpu9", "node 'consume': unknown resource 'gpu9'"),
    ("graph.nodes.consume.stage._target_=bench.synthetic.Consumr", "unknown _target_ 'bench.synthetic.Consumr'"),
    ("graph.nodes.consume.stage.iters=-1", "iters ≥ 0"),
])
def test_bad_config_exits_nonzero_with_one_readable_message(override, expect, tmp_path):
    out = run("+experiment=demo", override, f"hydra.run.dir={tmp_path}")
    assert out.returncode == 2, out.stderr      # a config problem, a stage's refused value too: before any setup
    assert not (tmp_path / "error.txt").exists()
    assert expect in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("args,code,expect", [
    (["model.target.path=/nowhere/model"], 1, "model path '/nowhere/model': no usable checkpoint"),
    (["data.prompt='<|im_start|> user describe the video . <|im_end|>'"], 1, "0 video placeholders (<|video_pad|>)"),
    (["data.path=/nowhere/clip.mp4"], 2, "data.path=/nowhere/clip.mp4: no such file"),
    (["model=none"], 2, "Fix: choose what it refers to, e.g. model=toy_qwen"),
    (["model.target.path=SHORT"], 1, "beyond qwen-target's context of 256: sample fewer frames"),
    (["model.target.compile=bogus"], 2, "model.target.compile='bogus': use one of auto, off"),
], ids=["unknown-model", "prompt-without-video", "missing-video", "no-model", "beyond-context", "bad-setting"])
def test_bad_input_is_one_clear_message(args, code, expect, tmp_path):
    if args == ["model.target.path=SHORT"]:     # a checkpoint whose context the sample video overflows
        from tests.models.test_adapters import random_checkpoint
        args = [f"model.target.path={random_checkpoint(tmp_path / 'short', 'qwen-draft', max_position_embeddings=256)}"]
    out = run(*args, f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == code, out.stderr
    assert expect in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("args,expect", [
    (["model=toy_qwn"], "model=toy_qwn: no such choice in conf/model/; did you mean toy_qwen?"),
    (["+experiment=nosuch"], "experiment=nosuch: no such choice in conf/experiment/"),
    (["-m", "+experiment=bench_sparrow", "method=ar,sparow"], "method=sparow: no such choice in conf/method/"),
    (["stage/decode@graph.nodes.decode.stage=pyavv"], "stage/decode=pyavv: no such choice in conf/stage/decode/; did you mean pyav?"),
], ids=["model", "experiment", "swept", "packaged"])
def test_a_config_choice_that_is_no_file_is_one_line_and_status_2(args, expect, tmp_path):
    out = run(*args, f"hydra.run.dir={tmp_path}", f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 2 and expect in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "HYDRA_FULL_ERROR" not in out.stderr
    assert not any(tmp_path.iterdir())                  # refused before Hydra made a run dir


def test_every_choice_the_check_knows_is_one_hydra_composes():
    """The check reads conf/GROUP/*.yaml: each file it accepts must be a choice Hydra composes too
    (a group the check reads wrong would refuse good commands)."""
    from run import check_config_choices

    for group in ("model", "method", "resources", "data", "cluster"):
        for choice in sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml")):
            check_config_choices([f"{group}={choice}"])               # no exit
            with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
                compose("config", overrides=[f"{group}={choice}"] if group != "method" else
                        ["+experiment=bench_sparrow", f"method={choice}"])


@pytest.mark.parametrize("args,expect", [
    (["train.stepz=5"], "train.stepz: no such key; did you mean train.steps?"),
    (["+train.warmpu=5"], "train.warmpu: no such key; did you mean train.warmup"),
    (["train.precision=fp16", "train.steps=0"], "invalid config (2 problems):"),
], ids=["misspelt", "misspelt-appended", "out-of-range"])
def test_a_bad_train_key_is_one_clear_message_before_anything_trains(args, expect, tmp_path):
    out = run("+experiment=train_toy", *args, f"hydra.run.dir={tmp_path}")
    assert out.returncode == 2, out.stderr
    assert expect in out.stderr and "Traceback" not in out.stderr and "step 1" not in out.stderr


@pytest.mark.parametrize("experiment,model", [("train_toy", "zoo/weights/qwen-draft"),
                                              ("train_sparrow", "zoo/weights/qwen-sparrow")])
def test_a_try_of_a_recipe_without_train_out_leaves_the_shipped_model_alone(experiment, model, tmp_path):
    """The toy recipes' default train.out is the zoo's own directory: a finished model there is
    replaced only with train.overwrite=true, and the refusal comes before anything loads."""
    before = {p.name: p.read_bytes() for p in (ROOT / model).iterdir()}
    extra = ["train.model=qwen-draft"] if experiment == "train_toy" else []
    out = run(f"+experiment={experiment}", *extra, "train.steps=1", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 2, out.stderr
    assert f"train.out (unset, so {model}): holds a trained model" in out.stderr and "train.overwrite=true" in out.stderr
    assert "Traceback" not in out.stderr and "loaded" not in out.stderr
    assert {p.name: p.read_bytes() for p in (ROOT / model).iterdir()} == before


def test_stage_failure_exits_1_and_names_node_and_item(tmp_path):
    out = run("+experiment=demo", *SMALL_DEMO, "+graph.nodes.consume.stage.fail_at=3", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 1
    assert "node 'consume' (Consumer) failed on item 3" in out.stderr and "Traceback" not in out.stderr
    assert "Traceback" in (tmp_path / "error.txt").read_text()


@pytest.mark.parametrize("launcher", ["basic", "joblib", "ray_cluster"])
def test_sweep_and_report(launcher, tmp_path):
    """ray_cluster: Hydra's Ray launcher, each job a Ray task on a local Ray it starts and ends."""
    from tests.job.test_ray_pool import ray_processes

    before = ray_processes()
    out = run("-m", "+experiment=demo", *SMALL_DEMO, f"hydra/launcher={launcher}",
              "executor.runner=threaded,sequential", f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    assert ("Ray Launcher is launching 2 jobs" in out.stdout + out.stderr) == (launcher == "ray_cluster")
    assert ray_processes() - before == set()
    for job in ("0", "1"):
        assert (tmp_path / job / "metrics.json").is_file()
    table = (tmp_path / "report.md").read_text()
    assert "| executor.runner |" in table and "| threaded |" in table and "| sequential |" in table
    assert (tmp_path / "report.csv").is_file() and (tmp_path / "report.png").is_file()


def _children(pid: int) -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def test_ctrl_c_cancels_and_leaves_nothing_behind(tmp_path):
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "run", "+experiment=demo", "graph.nodes.source.on=decode",
         "graph.nodes.source.stage.items=100000", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=sigint_as_default)  # noqa: PLW1509 -- one signal call in the child, no lock taken
    deadline = time.time() + 60
    children = set()
    while time.time() < deadline and not children:  # wait for the decode worker process
        time.sleep(0.5)
        children = _children(proc.pid)
    assert children, "the run never started its worker process"
    time.sleep(2.0)  # let it run for a while
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    time.sleep(0.5)
    alive = [p for p in children if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]]
    assert not alive, f"worker processes left behind: {alive}"
    assert set(os.listdir("/dev/shm")) - shm_before == set()


def _folder(tmp_path, names) -> Path:
    """A folder of videos: links to the bundled sample, and a truncated copy for each name starting 'bad'."""
    folder = tmp_path / "videos"
    folder.mkdir()
    sample = ROOT / "zoo" / "sample" / "toy-30s.mp4"
    for name in names:
        if name.startswith("bad"):
            (folder / f"{name}.mp4").write_bytes(sample.read_bytes()[:20000])   # its header cut off: not a video
        else:
            (folder / f"{name}.mp4").symlink_to(sample)
    return folder


def test_a_bad_video_among_several_is_recorded_and_the_others_answered_and_resume_retries_only_it(tmp_path):
    folder = _folder(tmp_path, ["a", "bad", "c"])
    out = run("data=folder", f"data.folder={folder}", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr
    assert "2 of 3 requests answered" in out.stdout + out.stderr and "Traceback" not in out.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert [(r["request"], r["status"]) for r in rows] == [("a", "ok"), ("bad", "failed"), ("c", "ok")]
    assert rows[0]["metrics"]["output_text"] == rows[2]["metrics"]["output_text"]     # the same video
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [r["request"] for r in metrics["runs"]] == ["a", "c"] and metrics["failed"][0]["request"] == "bad"
    assert "not a video file FFmpeg can read" in (tmp_path / "run" / "summary.md").read_text()
    assert "== bad:" in (tmp_path / "run" / "error.txt").read_text()

    # the same command again into the same run dir: refused without resume, nothing overwritten
    again = run("data=folder", f"data.folder={folder}", f"hydra.run.dir={tmp_path / 'run'}")
    assert again.returncode == 2 and "cluster.resume=true" in again.stderr
    (folder / "bad.mp4").unlink()
    (folder / "bad.mp4").symlink_to(ROOT / "zoo" / "sample" / "toy-30s.mp4")    # mended
    resumed = run("data=folder", f"data.folder={folder}", "cluster.resume=true", f"hydra.run.dir={tmp_path / 'run'}")
    assert resumed.returncode == 0, resumed.stderr
    assert "resume: 2 of 3 requests have results; running 1" in resumed.stdout + resumed.stderr
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [r["request"] for r in metrics["runs"]] == ["a", "bad", "c"] and "failed" not in metrics


def test_a_run_where_every_request_fails_exits_1_naming_the_first(tmp_path):
    folder = _folder(tmp_path, ["bad1", "bad2"])
    out = run("data=folder", f"data.folder={folder}", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 1
    assert "every request failed; the first: bad1" in out.stderr and "Traceback" not in out.stderr
    assert (tmp_path / "run" / "error.txt").read_text().count("Traceback") == 2


def test_ctrl_c_keeps_the_finished_requests_results_and_resume_goes_on_from_them(tmp_path):
    folder = _folder(tmp_path, [f"v{i:03d}" for i in range(300)])      # ~0.3 s each: far longer than the wait
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "run", "data=folder", f"data.folder={folder}", "executor.progress=false"]
    proc = subprocess.Popen([*args, f"hydra.run.dir={run_dir}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_default)  # noqa: PLW1509
    results = run_dir / "results.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (results.exists() and results.read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    kept = results.read_text().splitlines()
    assert len(kept) >= 2 and all(json.loads(line)["status"] == "ok" for line in kept)
    assert f"{len(kept)} answers kept in {results}" in err and "Traceback" not in err
    assert not (run_dir / "metrics.json").exists()
    # resuming needs only the requests without a result: cut the folder to the first few
    for video in sorted(folder.iterdir())[len(kept) + 1:]:
        video.unlink()
    resumed = run("data=folder", f"data.folder={folder}", "cluster.resume=true", f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resume: {len(kept)} of {len(kept) + 1} requests have results; running 1" in resumed.stdout + resumed.stderr


def test_default_run_describes_the_bundled_video_with_the_toy_target(tmp_path):
    from zoo.captions import score
    from zoo.world import Truth

    out = run(f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["output_text"] in out.stdout
    assert metrics["video"]["n_video_tokens"] == 270 and metrics["ttft_s"] < metrics["wall_s"]
    truth = Truth.from_dict(json.loads((ROOT / "zoo" / "sample" / "toy-30s.json").read_text()))
    # the shipped target describes all 8 of this video's events right (F1 1.0, greedy, fp32); a broken
    # pipeline (random weights: 0; decoding at wrong positions: 0.375 with earlier weights) scores below
    assert score(metrics["output_text"], truth)["f1"] >= 0.6


def test_caption_eval_scores_each_video_and_summarises(tmp_path):
    out = run("+experiment=caption_eval", "data.toy.videos=2", "data.toy.seconds=8", "data.toy.first_seed=50",
              f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert [r["request"] for r in metrics["runs"]] == ["s50-8s", "s51-8s"]
    f1 = [r["score"]["f1"] for r in metrics["runs"]]
    assert metrics["summary"]["score"]["f1"] == pytest.approx(sum(f1) / 2, abs=1e-6)
    table = (tmp_path / "summary.md").read_text()
    assert "| s50-8s |" in table and "**mean**" in table and "| generate |" in table
    # the console names where every answer is, not the first request's answer as if it were the job's
    assert metrics["runs"][0]["output_text"] not in out.stdout
    assert "2 requests" in out.stdout + out.stderr and "summary.md" in out.stdout + out.stderr


@pytest.mark.parametrize("case", sorted(p.stem for p in (ROOT / "conf" / "qv_case").glob("*.yaml")))
def test_every_quickvideo_bench_case_composes_and_its_prefill_builds(case):
    from stages.prefill import Prefill

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=bench_quickvideo", f"qv_case={case}"])
    prepare(cfg)
    stage = {k: v for k, v in OmegaConf.to_container(cfg.graph.nodes.prefill.stage, resolve=True).items() if k != "_target_"}
    Prefill(**stage)          # validates mode, group_frames and the prune block; loads nothing


def test_quickvideo_prunes_the_sample_and_reports_its_cache(tmp_path):
    out = run("+experiment=quickvideo", "graph.prune.keep=0.2", "graph.group_frames=8", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    prefill = metrics["tokens_meta"]["prefill"]
    assert prefill["groups"] == 8 and prefill["video_tokens"] == 270           # 60 frames in groups of 8
    # seven groups of 36 tokens and one of 18 keep ceil(0.2 n) each: 7 * 8 + 4 in every layer
    assert prefill["video_tokens_kept"] == [60] * 6 and prefill["retention"] == pytest.approx(60 / 270, abs=1e-6)
    assert prefill["kv_bytes"] < 0.3 * 1726464                                   # the unpruned cache: 1.73 MB
    assert metrics["cpu_s"] > 0 and metrics["stages"]["prefill"]["calls"] == 8    # one per decoded group


def test_quickvideo_rejects_a_bad_prune_block(tmp_path):
    out = run("+experiment=quickvideo", "graph.prune.importance=l1", f"hydra.run.dir={tmp_path}")
    assert out.returncode != 0
    assert "importance must be one of key_norm, value_norm, attention, random" in out.stderr


@pytest.mark.parametrize("case", sorted(p.stem for p in (ROOT / "conf" / "method").glob("*.yaml")))
def test_every_speculative_bench_case_composes_and_validates(case):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=bench_sd", f"method={case}"])
    spec, _ = prepare(cfg)
    assert ("verify" in spec.nodes) == (case not in ("ar", "fastv", "quickvideo"))   # fastv, quickvideo: a pruned target alone


def test_speculative_methods_give_the_autoregressive_answer_on_the_sample(tmp_path):
    """The README's speculative commands on the bundled video: the toy pair, greedy, the same
    tokens as `python -m run`, with the speculative metrics in metrics.json."""
    names = ("vanilla_sd", "parallelvlm", "specvlm", "parallelvlm_self", "fastv_verified")
    # one sweep, one process: the same configs as the single commands, without six interpreter starts
    out = run("-m", f"+experiment=ar,{','.join(names)}", f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    ar = json.loads((tmp_path / "0" / "metrics.json").read_text())
    assert ar["experiment"] == "ar"
    expected = ar["output_ids"]
    for job, name in enumerate(names, start=1):
        metrics = json.loads((tmp_path / str(job) / "metrics.json").read_text())
        assert metrics["experiment"] == name
        assert metrics["output_ids"] == expected, name
        meta = metrics["tokens_meta"]
        assert meta["rounds"] > 0 and 1 <= meta["mean_accepted_length"] <= meta["window_setting"] + 1
        if name in ("parallelvlm", "specvlm", "parallelvlm_self"):
            assert meta["draft_prefill"]["video_tokens_kept"] == 27          # α = 0.9 of 270
        if name == "fastv_verified":                                          # the pruned target drafts: A < 1
            assert meta["draft_prefill"]["video_tokens_kept"] == [270, 270, 135, 135, 135, 135]
            assert 0.3 < meta["acceptance_rate"] < 1


def test_the_gpu_figure5_benchmark_runs_at_a_small_size_on_the_cpu(tmp_path):
    """bench_quickvideo_gpu is meant for a lent GPU, which most sessions lack: its graph, data and
    report are checked here with a two-layer variant of the same shape on a 20-s 1080p-aspect video."""
    from tests.models.test_shapes import TINY

    out = run("-m", "+experiment=bench_quickvideo_gpu", f"model.target.path='{TINY}'", "qv_case=sequential,overlapped,ar",
              "data.toy.seconds=20", "data.toy.size=[108,192]", "model.target.size=112", "resources=cpu",
              "graph.nodes.decode.stage.workers=2", f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    runs = [json.loads((tmp_path / job / "metrics.json").read_text()) for job in ("0", "1", "2")]
    assert runs[0]["output_ids"] == runs[1]["output_ids"]           # the overlap changes when, not what
    assert [r["runner"] for r in runs] == ["sequential", "threaded", "threaded"]
    assert [r["tokens_meta"]["prefill"]["mode"] for r in runs] == ["groups", "groups", "one_shot"]
    table = (tmp_path / "report.md").read_text()
    assert "| overlap_bound_s |" in table and (tmp_path / "report.png").is_file()
    # the tower's and the prefill's arithmetic over their time, against the matrix rate timed at setup
    assert "| encode_share | prefill_share | matrix_tflops |" in table and "- `encode_share`: " in table
    for r in runs:
        assert r["stages"]["encode"]["counts"]["flops"] > 0 and r["stages"]["prefill"]["counts"]["flops"] > 0
        assert r["tokens_meta"]["prefill"]["matrix_flops_per_s"] > 1e9


EXIT_PROBE = """
import atexit, sys
sys.path.insert(0, {root!r})
from run import ExitWithoutTeardown

class Teardown:                     # a cycle: only the interpreter's teardown collection frees it
    def __del__(self, open=open):   # bound now: the teardown clears builtins before it collects
        open({teardown!r}, "w").close()

probe = Teardown()
probe.self = probe
leave = ExitWithoutTeardown()
atexit.register(leave)
atexit.register(lambda: open({handler!r}, "w").close())    # registered later: runs first
print("buffered output", end="")
{leaving}
"""


@pytest.mark.parametrize("leaving, status, torn_down", [
    ("", 0, False), ("leave.record(SystemExit(3))", 3, False), ("leave.record(SystemExit('why'))", 1, False),
    ("leave.record(RuntimeError())", 1, False), ("leave.record(KeyboardInterrupt())", 0, True)])
def test_the_command_line_exits_with_its_status_after_every_exit_handler_without_tearing_down(
        tmp_path, leaving, status, torn_down):
    """ExitWithoutTeardown: the status of the error it recorded, the exit handlers registered after
    it run, buffered output is flushed, and the interpreter's teardown is skipped (a cycle's
    __del__ never runs), except after a recorded Ctrl-C, which leaves Python's own way."""
    teardown, handler = tmp_path / "teardown", tmp_path / "handler"
    script = EXIT_PROBE.format(root=str(ROOT), teardown=str(teardown), handler=str(handler), leaving=leaving)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == status, out.stderr
    assert out.stdout == "buffered output"
    assert handler.exists()
    assert teardown.exists() == torn_down


@pytest.mark.parametrize("args,expect", [
    (["+experiment=quickvideo", "graph.prune.kep=0.2"], "graph.prune.kep: no key 'kep' in graph.prune; did you mean "
                                                        "graph.prune.keep?"),
    (["executor.runer=sequential"], "executor.runer: no key 'runer' in executor; did you mean executor.runner?"),
    (["-m", "+experiment=bench_sparrow", "method=ar,sparrow", "bench.fpz=2,8"], "bench.fpz: no key 'fpz' in bench"),
    (["grph.window=3"], "grph.window: no key 'grph' in the config; did you mean graph?"),
    (["executor.runner.kind=x"], "executor.runner.kind: executor.runner holds a value, not keys"),
], ids=["nested", "executor", "swept", "top", "under-a-value"])
def test_a_misspelt_key_is_one_line_and_status_2(args, expect, tmp_path):
    out = run(*args, f"hydra.run.dir={tmp_path}", f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 2 and expect in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "HYDRA_FULL_ERROR" not in out.stderr
    assert not any(tmp_path.iterdir())                  # refused before Hydra made a run dir


def documented_commands() -> list[list[str]]:
    """Every `python -m run ...` command in a code block of the README and docs/, as its arguments
    (continued lines joined, comments left out)."""
    import re
    import shlex

    commands = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        in_block = False
        for line in re.sub(r"\\\n\s*", " ", doc.read_text()).splitlines():
            if line.lstrip().startswith("```"):
                in_block = not in_block
            found = re.search(r"python -m run\b(.*)", line.split(" #")[0]) if in_block else None
            if found and found[1].strip():
                commands.append(shlex.split(found[1]))
    return commands


def test_no_documented_command_is_refused_by_the_key_check():
    """check_override_keys composes the config to find misspelt keys: a key the docs use must
    never be one it refuses (VIDEO, FILE... stand for the user's own values)."""
    from run import check_override_keys

    commands = documented_commands()
    assert len(commands) > 30, commands
    for args in commands:
        check_override_keys(args)                           # no exit
