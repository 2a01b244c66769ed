"""Packed decoder weights (models.packing): the packed tensors hold the layer's own weights, the
modules then read views of them (nothing held twice), a packed model scores as it did before
packing, eager and compiled, and `pack: auto` measures once per shape and remembers its choice.

Tolerances: packing changes which BLAS kernel multiplies ([in, out] instead of [out, in], and
q, k, v in one product on the compiled path), so sums are blocked differently: float32
roundings of logits of size ~10, as in tests/models/test_lean.py (ATOL 1e-4)."""

from __future__ import annotations

import json

import pytest
import torch

from models import packing
from models.compiling import compile_records
from models.decoding import greedy, prefill_video
from models.load import ModelError, load_model
from tests.models.test_adapters import ARCHS, random_checkpoint
from tests.models.test_lean import prefilled

ATOL = 1e-4


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    return str(random_checkpoint(tmp_path_factory.mktemp(request.param), ARCHS[request.param]))


def test_packed_tensors_hold_the_layers_weights_and_the_modules_read_views_of_them(checkpoint):
    lm = load_model(checkpoint, pack=False)
    text = lm.text
    before = {name: t.detach().clone() for name, t in text.layers.state_dict().items()}
    layers = packing.pack(text)
    after = text.layers.state_dict()
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    for layer, p in zip(text.layers, layers):
        a, m = layer.self_attn, layer.mlp
        q, k, v = p.split
        assert p.qkv.shape == (lm.hidden_size, q + k + v) and p.qkv.is_contiguous()
        assert p.gate_up.shape == (lm.hidden_size, 2 * p.intermediate) and p.down.is_contiguous()
        # views, not copies: the module's weight starts inside the packed tensor's storage
        assert a.k_proj.weight.untyped_storage().data_ptr() == p.qkv.untyped_storage().data_ptr()
        assert m.up_proj.weight.untyped_storage().data_ptr() == p.gate_up.untyped_storage().data_ptr()
        assert a.v_proj.weight.shape == (v, lm.hidden_size)


@pytest.mark.parametrize("pack, compile", [(True, "off"), (True, "default"), ("tiled", "default")])
def test_a_packed_model_scores_as_it_did_as_loaded(checkpoint, pack, compile):
    """The eager path multiplies a projection at a time by the views, the compiled one by the
    packed tensors (q, k and v in one product), or by their tiles through the tiled kernel: each
    scores like the model as loaded."""
    packed = load_model(checkpoint, pack=pack, compile=compile)
    loaded = load_model(checkpoint, pack=False)
    assert packed.lean.packed is not None and loaded.lean.packed is None
    assert all((p.tiles is not None) == (pack == "tiled") for p in packed.lean.packed)
    layout, cache, _ = prefilled(packed)
    _, loaded_cache, _ = prefilled(loaded)
    for k in (1, 4, 9):
        ids = torch.arange(10, 10 + k) % packed.vocab_size
        for step in range(2):
            got = packed.score(cache, ids, layout.length + step * k, layout)
            want = loaded.score(loaded_cache, ids, layout.length + step * k, layout)
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
            assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("pack", [True, "tiled"])
def test_a_packed_compiled_model_decodes_the_eager_paths_tokens(pack):
    """The toy target packed (or tiled) and compiled (the fused products) against itself as
    loaded, eager: the same greedy tokens, up to 64."""
    from zoo.train.data import example

    compiled = load_model("zoo/weights/qwen-target", compile="default", pack=pack)
    eager = load_model("zoo/weights/qwen-target", pack=False)
    ex = example(5, 30, 2)
    answers = []
    for lm in (compiled, eager):
        cache, layout, logits = prefill_video(lm, ex.frames, 2, ex.prompt)
        with torch.compiler.set_stance("fail_on_recompile"):
            answers.append(greedy(lm, cache, logits, layout.length, layout, 64))
    assert len(answers[0]) > 20 and answers[0] == answers[1]      # up to 64 tokens, or the answer's end


def test_auto_measures_once_per_shape_then_reads_its_choice(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("REELFLOW_CACHE", str(tmp_path))
    lm = load_model(checkpoint, pack="auto")
    (key, choice), = json.loads((tmp_path / packing.CHOICES_FILE).read_text()).items()
    assert "layers: q, k, v" in key and set(choice["ms"]) == {"as_loaded", "packed"}
    assert choice["layout"] == min(choice["ms"], key=choice["ms"].get)
    assert (lm.lean.packed is not None) == (choice["layout"] == "packed")

    def measured_again(*a, **k):
        raise AssertionError("auto measured a second time")

    monkeypatch.setattr(packing, "products_ms", measured_again)
    again = load_model(checkpoint, pack="auto")          # same shapes, same CPU: the choice is read
    assert (again.lean.packed is not None) == (choice["layout"] == "packed")


def test_the_measurement_offers_tiles_to_fused_products_only(checkpoint):
    lm = load_model(checkpoint, pack=False)
    sample = packing.packed_layers(lm.text)[:2]
    assert set(packing.products_ms(lm.text, sample, fused=True, rounds=1)) == {"as_loaded", "packed", "tiled"}
    assert set(packing.products_ms(lm.text, sample, fused=False, rounds=1)) == {"as_loaded", "packed"}


def test_packing_is_in_the_runs_records_and_bad_settings_are_refused(checkpoint):
    load_model(checkpoint, pack=True)
    assert any(r["what"].endswith("weights") and r["mode"] == "on" for r in compile_records())
    with pytest.raises(ModelError, match="pack"):
        load_model(checkpoint, pack="yes")
    with pytest.raises(ModelError, match="tiled serves the compiled steps"):
        load_model(checkpoint, pack="tiled")            # compile off: nothing would multiply by the tiles


def test_without_the_kernel_auto_keeps_to_the_torch_layouts_and_tiled_says_why(checkpoint, monkeypatch):
    from models import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_build", lambda: "no C++ compiler here")
    lm = load_model(checkpoint, pack=False)
    sample = packing.packed_layers(lm.text)[:1]
    assert set(packing.products_ms(lm.text, sample, fused=True, rounds=1)) == {"as_loaded", "packed"}
    with pytest.raises(ModelError, match="no C\\+\\+ compiler here"):
        load_model(checkpoint, pack="tiled", compile="default")


def test_tiles_that_would_not_fit_in_memory_are_neither_offered_nor_made(checkpoint, tmp_path, monkeypatch):
    """The tiles copy the decoder layers: with less than twice their bytes free, auto chooses
    between as loaded and packed, and pack=tiled is refused with the sizes."""
    from models import load

    monkeypatch.setenv("REELFLOW_CACHE", str(tmp_path))
    layers = packing.layers_bytes(load_model(checkpoint, pack=False).text)
    monkeypatch.setattr(load, "_available_memory", lambda: layers)
    seen = {}
    real = packing.products_ms

    def spy(*a, **k):
        seen.update(k)
        return real(*a, **k)

    monkeypatch.setattr(packing, "products_ms", spy)
    lm = load_model(checkpoint, pack="auto", compile="default")
    assert seen["tiles"] is False and all(p.tiles is None for p in (lm.lean.packed or []))
    with pytest.raises(ModelError, match="copies the decoder layers"):
        load_model(checkpoint, pack="tiled", compile="default")
