"""The ar graph (decode → encode → prefill → generate) on the executor: token-identical to the
unmodified model's generate() for both architectures and both prefill modes, through a real
video file; sampling is reproducible from its seed; a video beyond the context is a clear error."""

from __future__ import annotations

import pytest

from graph.executor import Executor, StageFailed
from models.load import load_model
from models.registry import release_all
from stages.types import Request
from tests.helpers import make, node, target_side
from tests.models.test_adapters import ARCHS, random_checkpoint
from zoo.shapes import FPS
from zoo.tokenizer import build_tokenizer
from zoo.videos import make_video


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    path = random_checkpoint(d / "model", ARCHS[request.param], seed=1)
    video = d / "toy.mp4"
    make_video(21, 12, 2, 84, video)
    yield {"path": str(path), "fps": FPS[request.param], "size": 84, "name": request.param}, str(video)
    release_all()


def ar_nodes(model: dict, *, mode="one_shot", max_new_tokens=20, temperature=0.0, seed=0, group_frames=4):
    return {
        **target_side(model, max_new_tokens=max_new_tokens, group_frames=group_frames, mode=mode),
        "generate": node("stages.generate.Generate", on="target", inputs={"kv": "prefill.kv"}, model=model,
                         max_new_tokens=max_new_tokens, temperature=temperature, seed=seed),
    }


def run_graph(nodes, request):
    spec, plan = make(nodes)
    with Executor(spec, plan, progress=False) as ex:
        return ex.run(request)


def reference_ids(model: dict, video: str, prompt: str, n: int) -> list[int]:
    from video import read_video

    lm = load_model(model["path"])
    frames, _ = read_video(video, fps=model["fps"], size=model["size"])
    layout = lm.layout(prompt, frames.shape[0], tuple(frames.shape[-2:]), model["fps"])
    out = lm.model.generate(**lm.generate_inputs(layout, frames, model["fps"]), max_new_tokens=n, do_sample=False)
    return out[0, layout.length:].tolist()


@pytest.mark.parametrize("mode", ["one_shot", "groups"])
def test_ar_graph_is_token_identical_to_generate(checkpoint, mode):
    model, video = checkpoint
    prompt = "what happened after the red circle appeared ?"
    result = run_graph(ar_nodes(model, mode=mode), Request("v", video, prompt))
    tokens = result.outputs["generate.tokens"]
    ref = reference_ids(model, video, prompt, 20)
    assert len(set(ref)) > 3
    assert tokens.ids == ref
    assert result.outputs["generate.first"].ids == ref[:1]
    assert result.port_times["generate.first"]["first_s"] < result.port_times["generate.tokens"]["first_s"]
    assert tokens.meta["n_video_tokens"] == (108 + 1 if model["fps"] == 1 else 108)   # 12 s: 12x9+newline | 12x9


def test_sampling_is_reproducible_from_its_seed_and_differs_across_seeds(checkpoint):
    model, video = checkpoint
    runs = [run_graph(ar_nodes(model, temperature=1.0, seed=s), Request("v", video, "describe the video ."))
            .outputs["generate.tokens"].ids for s in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_a_video_beyond_the_context_is_a_clear_error(tmp_path, checkpoint):
    model, video = checkpoint
    short = dict(model, path=str(random_checkpoint(tmp_path / "short", ARCHS[model["name"]], max_position_embeddings=64)))
    with pytest.raises(StageFailed, match="beyond .* context of 64: sample fewer frames"):
        run_graph(ar_nodes(short), Request("v", video, "describe the video ."))


def test_the_card_and_the_trainers_check_answer_as_the_generate_stage_does(checkpoint):
    """One greedy loop (models.decoding) for all three: the Generate stage in the graph, the model
    card on a loaded checkpoint, and the trainer's check on the model in memory, lent to the adapter."""
    import torch
    from transformers import AutoModelForImageTextToText

    from models.decoding import greedy_answer
    from models.load import adapted
    from stages.decode import read_video
    from zoo.card import PROMPT
    from zoo.train.toy import preprocessor_config

    model, video = checkpoint
    staged = run_graph(ar_nodes(model, max_new_tokens=20), Request("v", video, PROMPT)).outputs["generate.tokens"].ids
    frames, _ = read_video(video, fps=model["fps"], size=model["size"])
    card = greedy_answer(load_model(model["path"]), frames, model["fps"], PROMPT, 20)
    net = AutoModelForImageTextToText.from_pretrained(model["path"], dtype=torch.float32).train()
    with adapted(net, build_tokenizer(net.config.model_type), preprocessor_config(net.config.model_type)) as lm:
        checked = greedy_answer(lm, frames, model["fps"], PROMPT, 20)
    assert len(set(staged)) > 3
    assert card == staged and checked == staged
    assert net.training and net.config.vision_config._attn_implementation == "sdpa"     # given back as it was
