"""The one small protocol every model stage uses, over a transformers Video-LLM.

    lm = load_model("zoo/weights/qwen-target")        # models.load
    layout = lm.layout("describe the video .", n_frames=60, frame_hw=(84, 84), fps=2.0)
    cache = lm.new_cache()
    video = lm.encode(frames)                                 # [n_video_tokens, hidden]
    logits = lm.prefill(cache, lm.embed(layout.ids, video), layout.positions)   # one shot
    logits = lm.score(cache, torch.tensor([tok]), layout.length)                # next tokens
    lm.crop(cache, n)              # rollback: keep the first n cached entries
    lm.keep(cache, indices)        # pruning: keep these cached entries (their positions stay theirs)

Positions are the crux. `layout` computes every position of the *unpruned* sequence once, with
the model's own code (Qwen2.5-VL: `get_rope_index`, 3-D MRoPE; LLaVA-OneVision: 1-D); a span
is prefilled with the columns of that table it covers, so a pruned or group-wise prefill carries
each token's original position. Tokens after the prompt sit at `logical index + rope_delta` in
every dimension (what `generate()` does), where the logical index counts pruned tokens too: a
pruned cache is shorter than its logical length, and the caller keeps both (stages.types.PrefillResult).

The forward is the model's own decoder layers, run one by one so that hidden states can be
published after chosen layers while the rest of the forward goes on (`on_tap`) and the cache
can be any length; masks come from transformers' `create_causal_mask`, so every attention
implementation (sdpa, eager, flash_attention_2, or one registered by a user) sees what it would
inside `model.forward`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from models.attention import SMALL_QUERY, sdpa_kernels
from models.lean import LeanDecoder
from models.prompt import video_prompt_ids


@dataclass(frozen=True)
class Layout:
    """The unpruned prompt: ids (the video as placeholder ids), where the video sits, and every
    position the model gives it."""

    ids: torch.Tensor            # int64 [L]
    video_start: int
    n_video: int
    positions: torch.Tensor      # int64 [P, L]: P = 3 (MRoPE t, h, w) or 1
    rope_delta: int              # position of logical index j >= L is j + rope_delta
    grid: tuple = ()             # model-specific video grid (Qwen: (t, h, w) in patches)

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])

    @property
    def video(self) -> slice:
        return slice(self.video_start, self.video_start + self.n_video)

    def decode_positions(self, start: int, k: int) -> torch.Tensor:
        """Positions [P, k] of logical indices start .. start + k - 1 after the prompt."""
        pos = torch.arange(start, start + k) + self.rope_delta
        return pos.expand(self.positions.shape[0], k)


def matrix_weights(module: torch.nn.Module) -> int:
    """Weights a token meets in `module`'s matrices and convolutions (norms' vectors left out):
    half the floating-point operations a token costs passing through them."""
    return sum(p.numel() for p in module.parameters() if p.dim() >= 2)


class VideoLM:
    """Base adapter: the text decoder loop, caches and scoring shared by both families.
    Subclasses supply `encode`, `video_token_count`, `_positions` and the placeholder id."""

    arch: str = ""
    placeholder_id: int

    def __init__(self, model, tokenizer, preprocess: dict, name: str):
        self.model, self.tokenizer, self.preprocess, self.name = model, tokenizer, preprocess, name
        self.model.eval()
        self.text = model.model.language_model           # embed_tokens, layers, norm, rotary_emb
        self.lm_head = model.lm_head
        self.text_config = self.text.config
        self.n_layers = self.text_config.num_hidden_layers
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = self.text_config.vocab_size
        # the decode path: tokens after the prompt through models.lean (None: the model's own forward)
        self.lean = LeanDecoder.of(self.text)
        self.compile = "off"           # the torch.compile mode of the decode path's steps (load_model sets it)
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    # ----------------------------------------------------------------------------- prompt

    @property
    def fps(self) -> float | None:
        """The frame rate the checkpoint was trained at, when its preprocessor config says."""
        return self.preprocess.get("fps")

    @property
    def frame_size(self) -> tuple[int, int] | None:
        size = self.preprocess.get("size")
        return tuple(size) if size else None

    def layout(self, prompt: str, n_frames: int, frame_hw: tuple[int, int], fps: float) -> Layout:
        n_video, grid = self.video_token_count(n_frames, frame_hw)
        ids, at = video_prompt_ids(self.tokenizer, prompt, self.placeholder_id, n_video)
        ids = torch.tensor(ids, dtype=torch.long)
        positions, delta = self._positions(ids, grid, fps)
        return Layout(ids, at, n_video, positions, int(delta), grid)

    def video_token_count(self, n_frames: int, frame_hw: tuple[int, int]) -> tuple[int, tuple]:
        raise NotImplementedError

    def _positions(self, ids: torch.Tensor, grid: tuple, fps: float) -> tuple[torch.Tensor, int]:
        raise NotImplementedError

    # ----------------------------------------------------------------------------- forward

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor, video: torch.Tensor | None = None, video_start: int = 0) -> torch.Tensor:
        """Token embeddings [n, hidden] of `ids` with rows video_start.. replaced by `video`."""
        x = self.text.embed_tokens(ids.to(self.device))
        if video is not None:
            x = x.clone()
            x[video_start:video_start + video.shape[0]] = video.to(x.dtype)
        return x

    def new_cache(self):
        from models.cache import growing_cache

        return growing_cache(self.text_config)      # appends in place: no whole-cache copy per forward

    @torch.inference_mode()
    def prefill(self, cache, embeds: torch.Tensor, positions: torch.Tensor, *, taps=(),
                on_tap: Callable[[int, torch.Tensor], None] | None = None,
                logits: str = "last", hidden: bool = False,
                drop_after: int | None = None, choose: Callable[[torch.Tensor], torch.Tensor] | None = None,
                among: torch.Tensor | None = None):
        """Runs `embeds` [n, hidden] at `positions` [P, n] through the decoder, appending to `cache`.

        taps: layer numbers l (1..n_layers; l is the output of layer l, 0 the embeddings) whose
        hidden states [n, hidden] are handed to `on_tap(l, h)` as soon as layer l is done.
        logits: "last" -> [vocab] of the last token, "all" -> [n, vocab], "none" -> None.
        hidden: also return the final-norm hidden states [n, hidden] (returns (logits, hidden)).
        drop_after, choose: FastV inside the forward: after layer `drop_after`, `choose(attention)`
        gets the last token's attention at that layer over the cache (float [n_cached + n]) and
        returns the indices (into this span, sorted) of the tokens the later layers keep; those
        layers then compute and cache only them (needs attn_implementation="reelflow").
        among: bool [n, n], which of the span's tokens each one sees (a draft tree's ancestors; every
        cached entry is seen); None: causal.
        """
        from transformers.masking_utils import create_causal_mask

        x = embeds.to(self.device, self.dtype)[None]                       # [1, n, d]
        pos = positions.to(self.device)
        pos = pos[:, None, :] if self.arch == "qwen2_5_vl" else pos[:1]    # [3, 1, n] | [1, n]
        # A cache pruned layer by layer (QuickPrefill) holds a different number of entries in
        # each layer, so each distinct length gets its own mask (usually there is one).
        masks: dict[int, object] = {}

        def mask_for(i: int):
            n_cached = cache.get_seq_length(i) if i < len(cache.layers) else 0
            if n_cached not in masks and among is not None:
                masks[n_cached] = self._span_mask(among, n_cached)
            if n_cached not in masks:
                masks[n_cached] = create_causal_mask(config=self.text_config, inputs_embeds=x, attention_mask=None,
                                                     cache=cache, layer_idx=i)
            return masks[n_cached]

        rope = self.text.rotary_emb(x, pos)
        taps = set(taps)
        with sdpa_kernels(x.device):
            x = self._layers(x, rope, cache, taps, on_tap, mask_for, masks, drop_after, choose)
        x = self.text.norm(x)[0]
        out = None if logits == "none" else self.lm_head(x[-1:] if logits == "last" else x).float()
        if out is not None and logits == "last":
            out = out[0]
        return (out, x) if hidden else out

    def _span_mask(self, among: torch.Tensor, n_cached: int) -> torch.Tensor:
        """[1, 1, n, n_cached + n] mask of a span that sees every cached entry and, among its own
        tokens, what `among` [n, n] allows: bool (True: attend), or additive float for eager."""
        n = among.shape[0]
        mask = torch.ones(1, 1, n, n_cached + n, dtype=torch.bool, device=self.device)
        mask[..., n_cached:] = among.to(self.device)
        if self.text_config._attn_implementation == "eager":
            return torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill(
                ~mask, torch.finfo(self.dtype).min)
        return mask

    def _layers(self, x, rope, cache, taps, on_tap, mask_for, masks, drop_after, choose):
        if 0 in taps and on_tap:
            on_tap(0, x[0])
        for i, layer in enumerate(self.text.layers):
            if drop_after is not None and i + 1 == drop_after:
                from models.attention import NAME, capture_last_row

                if self.text_config._attn_implementation != NAME:
                    raise ValueError(f"drop_after needs attn_implementation={NAME!r} (it reads the layer's attention)")
                with capture_last_row([i]) as row:
                    x = layer(x, attention_mask=mask_for(i), position_embeddings=rope, cache=cache,
                              use_cache=True)
                keep = choose(row[i]).to(x.device)
                x, rope = x[:, keep], tuple(r.index_select(-2, keep) for r in rope)
                masks.clear()
            else:
                x = layer(x, attention_mask=mask_for(i), position_embeddings=rope, cache=cache, use_cache=True)
            if i + 1 in taps and on_tap:
                on_tap(i + 1, x[0])
        return x

    @torch.inference_mode()
    def attention_scores(self, cache, embeds: torch.Tensor, positions: torch.Tensor, layers, *,
                         logits: str = "none"):
        """Prefills a span like `prefill` (it joins the cache) and returns, for each layer l in
        `layers` (1..n_layers), the span's attention probabilities over the whole cache, averaged
        over heads: float32 [n_span, n_cached + n_span]. For the baselines that prune by attention
        (SpecVLM, FastV, QuickPrefill's attention importance); the span runs with eager attention,
        the one implementation that materialises the probabilities (sdpa and flash never do).
        With logits="last"/"all", returns (probabilities, logits) as `prefill` gives them."""
        captured: dict[int, torch.Tensor] = {}
        hooks = [self.text.layers[layer - 1].self_attn.register_forward_hook(
            lambda module, args, out, layer=layer: captured.__setitem__(layer, out[1].mean(1)[0].float()))
            for layer in layers]
        implementation = self.text_config._attn_implementation
        self.text_config._attn_implementation = "eager"
        try:
            out = self.prefill(cache, embeds, positions, logits=logits)
        finally:
            self.text_config._attn_implementation = implementation
            for h in hooks:
                h.remove()
        return captured if logits == "none" else (captured, out)

    def score(self, cache, ids: torch.Tensor, start: int, layout: Layout, **kw) -> torch.Tensor:
        """Logits [k, vocab] for k new tokens `ids` at logical indices start.. (after the prompt).
        A few tokens (a decode step, a verification) take the lean path (models.lean) unless the
        model was loaded with lean=False or `kw` asks for what only the model's forward does
        (taps, FastV's drop)."""
        ids = ids.reshape(-1)
        if self.lean is not None and not kw and ids.shape[0] <= SMALL_QUERY:
            return self._lean_logits(cache, ids, layout.decode_positions(start, ids.shape[0])[0], None)
        return self.prefill(cache, self.embed(ids), layout.decode_positions(start, ids.shape[0]), logits="all", **kw)

    def score_tree(self, cache, ids: torch.Tensor, mask: torch.Tensor, depths: torch.Tensor, start: int,
                   layout: Layout, hidden: bool = False):
        """Logits [n, vocab] for a tree of n candidate tokens after the cached sequence, in one
        forward: node i (ids[i]) sits at logical index start + depths[i] and attends to the cache
        and to the nodes mask[i] [n] allows (itself and its ancestors: speculative.tree.tree_mask).
        All n entries join the cache in node order (keep the accepted path's with `keep_path`).
        hidden: also return the final-norm hidden states [n, hidden] (returns (logits, hidden))."""
        ids = ids.reshape(-1)
        positions = start + depths.reshape(-1) + layout.rope_delta               # [n]
        if self.lean is not None and ids.shape[0] <= SMALL_QUERY:
            return self._lean_logits(cache, ids, positions, mask, hidden=hidden)
        positions = positions.expand(layout.positions.shape[0], -1)              # [P, n]: one value per row
        return self.prefill(cache, self.embed(ids), positions, logits="all", among=mask, hidden=hidden)

    @torch.inference_mode()
    def _lean_logits(self, cache, ids: torch.Tensor, positions: torch.Tensor, mask, hidden: bool = False):
        states = self.lean.forward(cache, self.embed(ids), positions, mask)
        logits = self.lm_head(states).float()
        return (logits, states) if hidden else logits

    # ----------------------------------------------------------------------------- what stages read

    @property
    def vocabulary(self) -> int:
        """The token ids a draft and its target are compared over: those the tokenizer defines and
        the LM head scores (rows past the tokenizer are padding)."""
        return min(len(self.tokenizer), self.vocab_size)

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def max_positions(self) -> int | None:
        """The longest context the checkpoint declares, when it declares one."""
        return getattr(self.text_config, "max_position_embeddings", None)

    @property
    def attn_implementation(self) -> str:
        return self.text_config._attn_implementation

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """Decoder-layer output [n, hidden] -> the final-norm states the LM head reads."""
        return self.text.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-norm states [..., hidden] -> float32 logits [..., vocab_size]."""
        return self.lm_head(hidden).float()

    def step_weight_bytes(self) -> int:
        """Bytes of weights a forward of a few new tokens must read at least: every decoder layer,
        the final norm and the LM head (the input embedding is a row lookup: left out), each at the
        narrowest width that holds it exactly. A float32 tensor of bfloat16 values (a bfloat16
        checkpoint loaded in float32) counts 2 bytes a weight: the decoder layers' tiles hold such
        weights so (models.tiled); other paths read them at 4."""
        from models.tiled import holds_bfloat16

        params = [*self.text.layers.parameters(), *self.text.norm.parameters(), self.lm_head.weight]
        return int(sum(p.numel() * (2 if holds_bfloat16(p) else p.element_size()) for p in params))

    def forward_flops(self, new: int, cached: float, *, causal: bool = False, logits: int | None = None) -> int:
        """Floating-point operations a forward of `new` tokens after `cached` entries does at least
        (a multiply-add counts two): each token through every decoder layer's weight matrices and
        the LM head, and in attention each query head scoring every key it sees and summing its
        value. Norms, biases and rotary are left out (a rounding error beside them).

        causal: new token i sees the cache and new tokens 0..i (a prompt's prefill: what a causal
        kernel computes, about half of the whole square at a long prompt); otherwise every new
        token counts every cached and new key (a tree's nodes see only their ancestors: an upper
        bound of a few keys against the cache's thousands). `cached` may be the mean of the
        layers' lengths (a pruned cache): attention is linear in it. logits: the positions the LM
        head scores (None: every new one; a prefill scores its last, or none)."""
        layers = sum(p.numel() for p in self.text.layers.parameters() if p.dim() == 2)
        heads = self.text_config.num_attention_heads
        head_dim = getattr(self.text_config, "head_dim", None) or self.hidden_size // heads
        keys = new * cached + (new * (new + 1) / 2 if causal else new * new)     # query-key pairs, a layer and head
        attention = self.n_layers * heads * 2 * head_dim * keys                  # QK and PV, multiply-adds
        scored = new if logits is None else logits
        return round(2 * (new * layers + scored * self.lm_head.weight.numel() + attention))

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    # ----------------------------------------------------------------------------- cache edits

    @staticmethod
    def cached_length(cache) -> int:
        return cache.get_seq_length()

    @staticmethod
    def crop(cache, n: int) -> None:
        """Keep the first `n` cached entries (rollback after a rejected draft). A cache whose
        layers were pruned to different lengths has no one "first n": use `drop_last`."""
        lengths = set(VideoLM.layer_lengths(cache))
        if len(lengths) > 1:
            raise ValueError(f"crop to {n}: the cache's layers hold {sorted(lengths)} entries; use drop_last")
        drop = cache.get_seq_length() - n
        if drop < 0:
            raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} entries to {n}")
        VideoLM.drop_last(cache, drop)

    @staticmethod
    def drop_last(cache, k: int) -> None:
        """Drop the last `k` entries of every layer (whatever each layer's length)."""
        if k < 0 or k > min(VideoLM.layer_lengths(cache), default=0):
            raise ValueError(f"cannot drop {k} entries from layers of {VideoLM.layer_lengths(cache)}")
        if k:
            cache.crop(-k)         # transformers 5: a negative count of entries to drop, per layer

    @staticmethod
    def keep(cache, indices) -> None:
        """Keep only the cached entries at `indices` (sorted, int64): one tensor for every layer,
        or a list with one per layer (each layer keeps its own set). Each entry keeps the rotary
        position it was computed with, so the pruned cache attends as before."""
        per_layer = indices if isinstance(indices, (list, tuple)) else [indices] * len(cache.layers)
        if len(per_layer) != len(cache.layers):
            raise ValueError(f"{len(per_layer)} index sets for a cache of {len(cache.layers)} layers")
        for layer, idx in zip(cache.layers, per_layer):
            idx = idx.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)

    @staticmethod
    @torch.inference_mode()
    def keep_path(cache, n: int, rows) -> None:
        """The last `n` entries of every layer are a tree's nodes in node order: keep those of the
        nodes `rows` (ascending node indices: an accepted root-to-node path), in that order, and
        drop the others. Only those few entries move; the cache before them is not copied."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        kept = rows.numel()
        if kept and (int(rows.min()) < 0 or int(rows.max()) >= n):
            raise ValueError(f"keep_path: nodes {rows.tolist()} are not among the last {n} entries")
        # a path of the first nodes in order is in place already; else the rows go to each device
        # once (a copy per layer was a host-to-device transfer per layer on a GPU), and each tensor
        # moves them with two launches: a gather from the tree's entries, a copy behind the committed
        move = kept and rows.tolist() != list(range(kept))
        on_device: dict[torch.device, torch.Tensor] = {}
        for layer in cache.layers:
            start = layer.keys.shape[-2] - n
            if move:
                device = layer.keys.device
                if device not in on_device:
                    on_device[device] = rows.to(device)
                for held in (layer.keys, layer.values):          # views of the cache's buffers: written in place
                    tree = held.narrow(-2, start, n)
                    tree.narrow(-2, 0, kept).copy_(tree.index_select(-2, on_device[device]))
            if n > kept:
                layer.crop(-(n - kept))

    @staticmethod
    def layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s (0-based) cached keys and values, [kv_heads, n_cached, head_dim] each;
        keys carry their rotary positions."""
        entry = cache.layers[layer]
        return entry.keys[0], entry.values[0]

    @staticmethod
    def layer_lengths(cache) -> list[int]:
        """Entries cached in each layer (they differ once layers are pruned separately)."""
        return [cache.get_seq_length(i) for i in range(len(cache.layers))]

    @staticmethod
    def cache_bytes(cache) -> int:
        """Bytes of the cached keys and values, all layers (the entries; the in-place cache keeps
        up to a quarter more as spare room, models/cache.py)."""
        return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
                   if t is not None)

    # ----------------------------------------------------------------------------- vision

    def encode(self, frames: torch.Tensor, *, last: bool = True) -> torch.Tensor:
        """uint8 frames [n, 3, H, W] -> visual embeddings [n_tokens, hidden] in prompt order.
        Frames are encoded group by group (`last` marks the video's final group)."""
        raise NotImplementedError

    def encode_flops(self, frames: int, frame_hw: tuple[int, int]) -> int:
        """Floating-point operations `encode` does on `frames` frames of `frame_hw` pixels (a
        multiply-add counts two): the vision tower's and the projector's weight matrices (the patch
        embedding's convolution among them) over every token they see, and attention over the
        keys each token attends to. Norms, activations and resampling are left out. Exactly what
        torch's FlopCounterMode counts of the same call (tests/models/test_flops.py)."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {"name": self.name, "arch": self.arch, "parameters": self.parameter_count(),
                "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device),
                "attn_implementation": self.attn_implementation}
