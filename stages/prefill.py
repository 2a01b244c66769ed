"""prefill: the prompt (text + visual tokens) into the model's KV cache.

    Prefill(mode="one_shot")   waits for the whole video, then one forward over the prompt
    Prefill(mode="groups")     QuickPrefill: the video's tokens are prefilled group by group as
                               they arrive (the prefix text with the first group), each group
                               optionally pruned (`prune`) before the next attends to it, then
                               the text after the video, never pruned

Every token is prefilled at its position in the unpruned prompt (models.adapter.Layout), so
both modes give the same cache up to float rounding when nothing is pruned, and a pruned cache
decodes at the logical positions: the KV's logical length counts the pruned tokens.

Taps (the hidden states after chosen layers, for a draft that reads the target's states) cover
every prompt row in both modes: in groups mode each row's state is the one the pruned prefill
computed, collected group by group and published when the text after the video is done.

Groups are `group_frames` frames (rounded up to the model's temporal patch, 2 frames for
Qwen2.5-VL), cut from the incoming visual tokens whatever the decoder's own group size, so the
decoder's streaming grain and the prefill's memory grain are separate knobs. Peak activation
memory is one group's; the cache is what pruning shrinks.
"""

from __future__ import annotations

import inspect
import math

import torch

from graph.stage import In, Out, Stage
from models.memory import PeakMemory
from models.registry import get_model
from stages.prune import GroupKVPrune
from stages.types import PrefillResult, Request, Selection, Taps, VisualTokens

DEFAULT_PROMPT = "describe the video ."


class ContextTooLong(ValueError):
    pass


class Prefill(Stage):
    """mode: one_shot | groups; group_frames: frames per prefill group (groups mode; 0 = as the
    encoder delivers them); prune: null, or the keys of stages.prune.GroupKVPrune (importance,
    keep, start_layer, decay, seed, keyframe_every; groups mode); measure_memory: record each group's peak memory
    (models.memory.PeakMemory: on a GPU this synchronises once per group; on a CPU it counts every
    operation's tensors, ~25 % slower); measure_matrix_rate: time the device's matrix product in the
    model's dtype at setup (models.matrix_rate), reported beside the prefill's figures
    (`matrix_flops_per_s`): the yardstick for the encoder's and the prefill's counted arithmetic.

    Every prompt forward is counted (ctx.count "flops", models' forward_flops: causal, over what the
    cache holds), but FastV's, whose later layers see fewer tokens."""

    placement = "gpu"
    inputs = {"tokens": In(VisualTokens, stream=True), "request": In(Request)}
    outputs = {"kv": Out(PrefillResult, resident=True), "taps": Out(Taps, tap=True), "attention": Out(Taps, tap=True)}

    def __init__(self, model: dict, mode: str = "one_shot", max_new_tokens: int = 256, group_frames: int = 0,
                 prune: dict | None = None, measure_memory: bool = False, taps: list | None = None,
                 attention: list | None = None, fastv: dict | None = None, measure_matrix_rate: bool = False):
        if mode not in ("one_shot", "groups"):
            raise ValueError(f"mode must be one_shot or groups, got {mode!r}")
        if group_frames < 0:
            raise ValueError(f"group_frames must be ≥ 0 (0: the encoder's groups), got {group_frames}")
        if prune and mode != "groups":
            raise ValueError("prune needs mode=groups (QuickPrefill prunes each group as it is prefilled)")
        self.model, self.mode, self.max_new_tokens = dict(model), mode, max_new_tokens
        self.group_frames, self.measure_memory = group_frames, measure_memory
        self.measure_matrix_rate, self.matrix_rate = measure_matrix_rate, None
        self.prune = dict(prune) if prune else None
        self.taps = sorted(int(t) for t in (taps or []))
        if self.taps and self.taps[0] < 0:
            raise ValueError(f"taps are layer numbers ≥ 0 (0: the embeddings), got {self.taps}")
        self.fastv = dict(fastv) if fastv else None
        if self.fastv:        # FastV (lossy): after layer K only the most attended visual tokens go on
            if set(self.fastv) != {"layer", "keep"} or mode != "one_shot" or int(self.fastv["layer"]) < 1 \
                    or not 0 < float(self.fastv["keep"]) <= 1:
                raise ValueError(f"fastv: {{layer: K ≥ 1, keep: share in (0, 1]}} with mode=one_shot, got {fastv}")
        self.attention = sorted(int(a) for a in (attention or []))
        if self.attention and (mode != "one_shot" or self.attention[0] < 1):
            raise ValueError(f"attention: layer numbers ≥ 1 whose text-query attention the one-shot prefill "
                             f"publishes, got {attention} (mode {mode})")
        if self.prune:
            known = list(inspect.signature(GroupKVPrune).parameters)
            unknown = set(self.prune) - set(known)
            if unknown:
                raise ValueError(f"prune: unknown keys {sorted(unknown)}; known: {', '.join(known)}")
            GroupKVPrune(**self.prune)    # validate now, before any weights load
        self.lm = None

    def setup(self, ctx) -> None:
        self.lm = get_model(self.model, ctx.device)
        if self.taps and self.taps[-1] > self.lm.n_layers:
            raise ValueError(f"taps {self.taps}: {self.lm.name} has {self.lm.n_layers} layers")
        if self.measure_matrix_rate:
            from models.matrix_rate import matrix_rate

            self.matrix_rate = matrix_rate(self.lm.device, self.lm.dtype)
        self._reset()

    def _reset(self) -> None:
        self.pending, self.pending_frames = [], 0        # arrived, not yet prefilled (embeds, frames)
        self.frames, self.cache, self.done, self.video_done = 0, None, 0, 0
        self.meta, self.groups, self.peaks, self.step_tokens = None, 0, [], 0
        self.pruner = GroupKVPrune(**self.prune) if self.prune else None
        self.tapped: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.taps}   # groups mode: chunks so far

    def _layout(self, request: Request, frames: int):
        prompt = request.prompt if request and request.prompt else DEFAULT_PROMPT
        return self.lm.layout(prompt, frames, self.meta["frame_hw"], self.meta["fps"])

    def start_run(self, ctx) -> None:      # a new run (the last one may have been cancelled midway)
        self._reset()

    def __call__(self, ctx, tokens: VisualTokens, request: Request):
        self.meta = self.meta or tokens.meta
        self.pending.append(tokens.embeds)
        self.pending_frames += tokens.meta["frames"]
        if self.mode == "one_shot":
            return {}
        for embeds, frames in self._cut_groups(last=tokens.last):
            self._prefill_group(ctx, request, embeds, frames)
            ctx.check()
        return {}

    def _cut_groups(self, last: bool):
        """Whole groups of `group_frames` frames from what has arrived (all of it when `last`)."""
        step = self.lm.frames_per_step
        size = math.ceil(self.group_frames / step) * step if self.group_frames else 0
        hw = self.meta["frame_hw"]
        # visual tokens per temporal step (LLaVA-OneVision's one newline token rides at the end)
        per_step = self.lm.video_token_count(2 * step, hw)[0] - self.lm.video_token_count(step, hw)[0]
        self.step_tokens = per_step
        if not size:
            if self.pending:
                yield torch.cat(self.pending), self.pending_frames
            self.pending, self.pending_frames = [], 0
            return
        while self.pending_frames >= size or (last and self.pending_frames):
            embeds = torch.cat(self.pending)
            frames = size if self.pending_frames > size or not last else self.pending_frames
            n = per_step * (frames // step) if frames < self.pending_frames else embeds.shape[0]
            yield embeds[:n], frames
            rest = embeds[n:]
            self.pending = [rest] if rest.shape[0] else []
            self.pending_frames -= frames

    def _prefill_group(self, ctx, request: Request, embeds: torch.Tensor, frames: int) -> None:
        """The prefix text (first time) and this group, at their positions in the full prompt;
        then the group's entries pruned in every layer."""
        self.frames += frames
        layout = self._layout(request, self.frames)
        self._check_context(layout)
        if self.cache is None:
            self.cache = self.lm.new_cache()
        n = embeds.shape[0]
        stop = layout.video_start + self.video_done + n
        offset = layout.video_start + self.video_done - self.done     # where this group's rows start in the span
        self._count(ctx, stop - self.done, logits=0)
        # the group's forward only: pruning copies the cache (DynamicCache's index_select), which
        # is this implementation's cost, not the group's
        with PeakMemory(self.lm.device) if self.measure_memory else _NoProbe() as probe:
            self.lm.prefill(self.cache, self.lm.embed(layout.ids[self.done:stop], embeds, offset),
                            layout.positions[:, self.done:stop], logits="none", taps=self.taps,
                            on_tap=lambda layer, hidden: self.tapped[layer].append(hidden))
        if self.pruner is not None:
            self._prune_group(layout, n)
        self.peaks.append(probe.peak_bytes)
        self.video_done, self.done, self.groups = self.video_done + n, stop, self.groups + 1

    def _prune_group(self, layout, n: int) -> None:
        lm, attention = self.lm, None
        if self.pruner.needs_attention:
            # the question as if the video ended here; its own entries leave the cache again
            end = layout.video_start + layout.n_video
            query = layout.ids[end:]
            attention = lm.attention_scores(self.cache, lm.embed(query), layout.positions[:, end:],
                                            layers=range(1, lm.n_layers + 1))
            lm.drop_last(self.cache, query.shape[0])
        keep = self.pruner.select(lambda layer: lm.layer_kv(self.cache, layer), lm.layer_lengths(self.cache), n,
                                  attention, step_tokens=self.step_tokens)
        if keep is not None:
            lm.keep(self.cache, keep)

    def finish(self, ctx):
        request = ctx.request
        if self.mode == "one_shot":
            self.frames = self.pending_frames
            layout = self._layout(request, self.frames)
            self._check_context(layout)
            self.cache = self.lm.new_cache()
            embeds = self.lm.embed(layout.ids, torch.cat(self.pending), layout.video_start)
            if not self.fastv:    # FastV's later layers see fewer tokens: no count rather than a wrong one
                self._count(ctx, layout.length, logits=1)
            if self.fastv:
                logits = self.lm.prefill(self.cache, embeds, layout.positions, drop_after=int(self.fastv["layer"]),
                                         choose=self._fastv_choice(layout))
            elif not self.attention:
                logits = self.lm.prefill(self.cache, embeds, layout.positions, taps=self.taps,
                                         on_tap=self._tap_publisher(ctx, layout))
            else:   # the text after the video separately, with its attention over the prompt (eager)
                end = layout.video_start + layout.n_video
                self.lm.prefill(self.cache, embeds[:end], layout.positions[:, :end], logits="none")
                probs, logits = self.lm.attention_scores(self.cache, embeds[end:], layout.positions[:, end:],
                                                         self.attention, logits="last")
                ctx.emit("attention", Taps(probs, layout=layout, model=self.lm.name))
        else:
            layout = self._layout(request, self.frames)
            self._count(ctx, layout.length - self.done, logits=1)
            logits = self.lm.prefill(self.cache, self.lm.embed(layout.ids[self.done:]), layout.positions[:, self.done:],
                                     taps=self.taps, on_tap=self._tap_publisher(ctx, layout, self.tapped))
        lengths = self.lm.layer_lengths(self.cache)
        text = layout.length - layout.n_video
        kept = [n - text for n in lengths]
        peaks = [p for p in self.peaks if p is not None]
        stats = {"mode": self.mode, "groups": self.groups if self.mode == "groups" else 1,
                 "group_frames": self.group_frames or None, "logical_length": layout.length,
                 "video_tokens": layout.n_video, "video_tokens_kept": kept,
                 "retention": round(sum(kept) / (len(kept) * layout.n_video), 6) if layout.n_video else 1.0,
                 "kv_bytes": self.lm.cache_bytes(self.cache),
                 "peak_group_bytes": max(peaks) if peaks else None,
                 "prune": self.pruner.describe() if self.pruner else None}
        if self.matrix_rate is not None:
            stats["matrix_flops_per_s"] = round(self.matrix_rate)
        kv = PrefillResult(self.cache, layout.length, layout=layout, logits=logits, model=self.lm.name,
                n_video_tokens=layout.n_video, frames=self.frames, prefill=stats)
        self._reset()
        return {"kv": kv}

    def _count(self, ctx, new: int, logits: int) -> None:
        """The arithmetic of prefilling `new` prompt tokens after what the cache holds now
        (ctx.count "flops": a report sets it against the stage's time). The prompt's forwards
        only: the question a pruner scores against the cache is its own cost, left out."""
        lengths = self.lm.layer_lengths(self.cache) or [0]
        ctx.count("flops", self.lm.forward_flops(new, sum(lengths) / len(lengths), causal=True, logits=logits))

    def _fastv_choice(self, layout):
        """The span indices later layers keep: all text, and the ⌈keep·m⌉ video tokens the last
        token attends to most at layer K."""
        def choose(attention: torch.Tensor) -> torch.Tensor:
            start, end = layout.video_start, layout.video_start + layout.n_video
            k = max(1, math.ceil(round(float(self.fastv["keep"]) * layout.n_video, 9)))
            video = start + attention[start:end].float().topk(k).indices.sort().values.cpu()
            return torch.cat([torch.arange(start), video, torch.arange(end, layout.length)])
        return choose

    def _tap_publisher(self, ctx, layout, before: dict[int, list[torch.Tensor]] | None = None):
        """on_tap for the adapter: collects the requested layers' hidden states [length, hidden]
        and publishes them the moment the last of them is done, while the forward goes on
        (ParallelVLM's draft prunes and prefills during the rest of the target's prefill).
        before: the groups mode's chunks of the earlier rows, per layer (each row's state as the
        pruned prefill computed it; the cache is pruned, these rows are not)."""
        if not self.taps:
            return None
        got: dict[int, torch.Tensor] = {}

        def on_tap(layer: int, hidden: torch.Tensor) -> None:
            got[layer] = torch.cat([*before[layer], hidden]) if before else hidden
            if len(got) == len(self.taps):
                ctx.emit("taps", Taps(dict(got), layout=layout, model=self.lm.name))

        return on_tap

    def _check_context(self, layout) -> None:
        limit = self.lm.max_positions
        # tokens held (what memory and attention pay) and positions used (MRoPE compresses them)
        need = max(layout.length, int(layout.positions.max()) + 1) + self.max_new_tokens
        if limit and need > limit:
            raise ContextTooLong(
                f"the prompt needs a context of {need} ({layout.n_video} visual tokens from {self.frames} frames "
                f"+ {self.max_new_tokens} new tokens), beyond {self.lm.name}'s context of {limit}: sample fewer frames "
                "(graph.nodes.decode.stage.fps=..., or num_frames=...) or prefill in groups with KV pruning "
                "(QuickPrefill)")


class _NoProbe:
    peak_bytes = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class SelectedPrefill(Prefill):
    """A one-shot prefill of only the selected visual tokens (ParallelVLM's draft): the prompt's
    text and the kept video tokens, each at its position in the unpruned prompt, so the cache is
    shorter than the logical length and decoding continues at the logical positions."""

    inputs = {"tokens": In(VisualTokens, stream=True), "request": In(Request), "selection": In(Selection)}
    outputs = {"kv": Out(PrefillResult, resident=True)}

    def __init__(self, model: dict, max_new_tokens: int = 256, mode: str = "one_shot"):
        if mode != "one_shot":
            raise ValueError(f"SelectedPrefill prefills the selected tokens in one shot (mode=one_shot), got {mode!r}")
        super().__init__(model, mode="one_shot", max_new_tokens=max_new_tokens)

    def __call__(self, ctx, tokens: VisualTokens, request: Request, selection: Selection):
        out = super().__call__(ctx, tokens, request)
        self.selection = selection        # the same on every call of a run; finish uses it
        return out

    def finish(self, ctx):
        selection = self.selection
        layout = self._layout(ctx.request, self.pending_frames)
        self.frames = self.pending_frames
        self._check_context(layout)
        if selection.total != layout.n_video:
            raise ValueError(f"the selection is over {selection.total} visual tokens, the draft's prompt has "
                             f"{layout.n_video}: draft and target must see the video alike (same fps, size, patching)")
        embeds = self.lm.embed(layout.ids, torch.cat(self.pending), layout.video_start)
        end = layout.video_start + layout.n_video
        keep = torch.cat([torch.arange(layout.video_start), layout.video_start + selection.keep.cpu(),
                          torch.arange(end, layout.length)])
        self.cache = self.lm.new_cache()
        self._count(ctx, int(keep.numel()), logits=1)
        logits = self.lm.prefill(self.cache, embeds[keep], layout.positions[:, keep])
        # where in the video the kept tokens are: the share of them in each tenth of the video (does
        # a selection pile up at the ends, as attention-guided pruning does in ParallelVLM's Fig. 7a?)
        tenths = torch.bincount(selection.keep.cpu() * 10 // layout.n_video, minlength=10)
        stats = {"mode": "selected", "logical_length": layout.length, "video_tokens": layout.n_video,
                 "video_tokens_kept": int(selection.keep.numel()), "kv_bytes": self.lm.cache_bytes(self.cache),
                 "kept_share_by_tenth": [round(float(x), 4) for x in tenths / tenths.sum()]}
        kv = PrefillResult(self.cache, layout.length, layout=layout, logits=logits, model=self.lm.name,
                n_video_tokens=layout.n_video, frames=self.frames, prefill=stats)
        self._reset()
        return {"kv": kv}
