"""Sparrow's drafting: the draft head (models.sparrow) on the target's own hidden states proposes a
tree of candidates each round. The SparrowDraft stage (stages.sparrow) and the reference loop
(speculative.reference) both drive `HeadDrafter`.

The head needs no video of its own: it starts from the target's last-layer states of the prompt
(final norm applied here: the feature the LM head reads), and each verdict carries the target's
features of the tokens it just cached. With VATA the head's cache holds the prompt's text and the
answer only; without (`vata=False`, an ablation) the video's layer-m* states come first.

A round:
1. catch up: the accepted tokens, re-run through the head with the target's true features in place
   of the head's own, then the target's new token (bonus or correction) with the true feature of
   the token before it; the last row's output predicts the next token;
2. draft a tree (EAGLE-2's dynamic tree, `draft_tree`): expand the `topk` best frontier nodes by
   cumulative log-probability, `topk` children each, for `depth` levels, then keep the `total` best
   nodes overall (speculative.tree); the drafted rows attend to the head's cache without joining it.
   `tree=False` drafts a chain of `depth` tokens instead (the head's argmax), an ablation.
"""

from __future__ import annotations

import functools
from dataclasses import astuple

import torch

from models.compiling import (
    call_at_warmed_threads,
    compiled,
    thread_counts,
    varying,
    warm_at_thread_counts,
)
from models.sparrow import HeadCache, SparrowHead
from models.steps import CAPTURED, uncaptured_mode
from speculative.expansion import grow_tree
from speculative.protocol import DraftInfo, Proposal, Timer, Verdict
from speculative.tree import best_subtree, chain_parents, tree_depths


def draft_tree(head: SparrowHead, lm, cache: HeadCache, top: torch.Tensor, position: int, *, total: int,
               depth: int, topk: int, vocab: int, grow=grow_tree,
               draft=None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A dynamic draft tree under the token whose head output is `top` [hidden] (the head's cache
    holds it); its children sit at text position `position`. EAGLE-2: `grow` (grow_tree, or it
    compiled) drafts depth levels of the topk best, then the `total` best nodes are kept
    (best_subtree). Returns (tokens [n], parents [n], facts) with parents listed first; the head's
    cache is untouched. draft: a DraftVocabulary, the only tokens proposed (None: all)."""
    # top is a row of the head's last output: a copy of its own, so that a compiled grow sees the
    # same layout (no storage offset) whichever row it was
    tokens, parents, scores = grow(head, lm, cache.keys, cache.values, top.clone(), position, depth=depth,
                                   topk=topk, vocab=vocab, draft=draft)
    # the reranking and everything after it run on the host, as the verifier's tree code does
    tokens, parents, scores = tokens.cpu(), parents.cpu(), scores.cpu()
    kept, kept_parents = best_subtree(parents, scores, total)
    return tokens[kept], kept_parents, {"nodes": int(kept.shape[0]), "depth": int(tree_depths(kept_parents).max()) + 1}


_COMPILED: dict[tuple, object] = {}       # (function, mode, device type, head shape) -> compiled, at its warmed counts


def grower(mode: str, device="cpu", shape: tuple = ()):
    """grow_tree as the head drafts with it: eager for "off", else compiled in that torch.compile
    mode (models.compiled_step.MODES), once per process, mode, device type and `shape` (the head's
    and its target's sizes: head_shape), and called at a thread count it was warmed for (warm_tree:
    the counts of the first call, at load). The key holds no thread count: an elastic pool changes
    a worker's count between rounds, and a new key would be a new compile in the middle of a
    request. The cache length and the position are symbolic, so a tree shape (depth, topk) is one
    compile that serves every cache length and position; the model sizes are constants, so each
    head shape compiles on a code object of its own (torch counts its recompile limit per code object)."""
    return grow_tree if mode == "off" else _compiled_once(grow_tree, mode, device, shape)


def head_shape(head: SparrowHead, lm) -> tuple:
    """What a compiled head function is specialised on: the head's config and the target's vocabulary."""
    return (*astuple(head.config), lm.vocabulary)


def _marked(fn, rows: bool):
    """fn(head, lm, keys, values, *tensors, position) -> fn with the head's cache length marked
    varying, with rows: the first dimension of the further tensors too (catch_up_rows' rows), and
    the int position as an int64 [1] tensor (an int that changes between calls would compile again)."""
    def call(head, lm, keys, values, *rest, **shape):
        *tensors, position = rest
        if isinstance(position, int):
            position = torch.tensor([position], device=keys.device)
        if rows:
            tensors = [varying(t, 0) for t in tensors]
        return fn(head, lm, varying(keys, 1), varying(values, 1), *tensors, position, **shape)

    return call


def _compiled_once(fn, mode: str, device, shape: tuple = ()):
    """fn compiled in `mode` (models.compiling.compiled, with its varying sizes marked: _marked),
    once per process, function, mode, device type and head shape, called at the thread counts it
    is warmed for (see grower for why no thread count in the key)."""
    key = (fn.__name__, mode, torch.device(device).type, shape)
    if key not in _COMPILED:
        run = _marked(compiled(fn, mode), rows=fn is catch_up_rows)
        _COMPILED[key] = functools.partial(call_at_warmed_threads, run, thread_counts(device))
    return _COMPILED[key]


def captures_head(lm) -> bool:
    """Whether the head's work runs as CUDA graphs beside `lm`: when the target's steps are
    captured (lm.compile "cudagraph" or "reduce-overhead") on CUDA."""
    return lm.compile in CAPTURED and torch.device(lm.device).type == "cuda"


def _captured(head: SparrowHead, lm, kind):
    """The head's one `kind` (speculative.captured_head's CapturedTree or CapturedHeadStep) for the
    target `lm`, made on first use: per target, since the graphs read its embedding and LM head."""
    made = head.__dict__.setdefault("_captured", {})
    if (kind, id(lm)) not in made:
        made[kind, id(lm)] = kind(head, lm)
    return made[kind, id(lm)]


def tree_grower(head: SparrowHead, lm):
    """How `head` grows its trees beside the target `lm`: replayed as a CUDA graph when
    captures_head(lm) (speculative.captured_head.CapturedTree), else grower() in the uncaptured mode."""
    if captures_head(lm):
        from speculative.captured_head import CapturedTree

        return _captured(head, lm, CapturedTree)
    return grower(uncaptured_mode(lm.compile), lm.device, head_shape(head, lm))


def catch_up_rows(head: SparrowHead, lm, keys: torch.Tensor, values: torch.Tensor, ids: torch.Tensor,
                  features: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A round's catch-up as a pure function: the head over fuse(embed(ids), features) (ids [m],
    features [m, hidden]) at text positions position.. after its cache keys, values [KV, L, hd],
    causal among the m rows. -> (outputs [m, hidden], the rows' keys and values [KV, m, hd]); the
    caller appends them to the cache. Nothing written: what torch.compile takes whole."""
    c, m = head.config, ids.shape[0]
    z = head.fuse(lm.embed(ids), features)
    none = keys.new_zeros(c.kv_heads, 0, c.head_dim)
    causal = torch.ones(m, m, dtype=torch.bool, device=keys.device).tril()
    return head.rows(z, position + torch.arange(m, device=keys.device), keys, values, none, none, causal)


class CompiledHeadStep:
    """The head's catch-up through catch_up_rows compiled (dynamic shapes: one compile serves every
    row count above one and every cache length), called like CapturedHeadStep."""

    def __init__(self, head: SparrowHead, lm, mode: str):
        self.head, self.lm, self.mode = head, lm, mode
        self.run = _compiled_once(catch_up_rows, mode, lm.device, head_shape(head, lm))

    @torch.inference_mode()
    def __call__(self, cache: HeadCache, ids: torch.Tensor, features: torch.Tensor, position: int) -> torch.Tensor:
        out, k, v = self.run(self.head, self.lm, cache.keys, cache.values, ids, features.to(self.lm.dtype), position)
        cache.keys, cache.values = torch.cat([cache.keys, k], 1), torch.cat([cache.values, v], 1)
        return out

    @torch.inference_mode()
    def warm(self, *, rows: int) -> float:
        """Compile now for 1..rows rows at every thread count the compiled function is called at,
        over a dummy cache longer than any row count (equal sizes would be traced as one symbol and
        recompile later). Returns the seconds."""
        c, weight = self.head.config, self.head.fc.weight

        def every_row_count():
            for m in range(1, rows + 1):
                cache = HeadCache(*(torch.zeros(c.kv_heads, rows + 2, c.head_dim, device=weight.device,
                                                dtype=weight.dtype) for _ in range(2)))
                self(cache, torch.zeros(m, dtype=torch.long, device=weight.device),
                     torch.zeros(m, c.hidden, device=weight.device, dtype=weight.dtype), rows + 2)

        return warm_at_thread_counts(self.run.args[1], every_row_count, f"sparrow head step, 1-{rows} rows", self.mode)


def head_stepper(head: SparrowHead, lm):
    """The head's catch-up step: a CUDA graph (speculative.captured_head.CapturedHeadStep) when
    captures_head(lm); compiled (CompiledHeadStep) when lm's steps are; None: the eager head."""
    if captures_head(lm):
        from speculative.captured_head import CapturedHeadStep

        return _captured(head, lm, CapturedHeadStep)
    mode = uncaptured_mode(lm.compile)
    if mode == "off":
        return None
    made = head.__dict__.setdefault("_compiled_step", {})
    if (mode, id(lm)) not in made:
        made[mode, id(lm)] = CompiledHeadStep(head, lm, mode)
    return made[mode, id(lm)]


@torch.inference_mode()
def warm_tree(head: SparrowHead, lm, *, total: int, depth: int, topk: int, draft=None) -> float:
    """Compile (or capture) the tree drafting of this shape for lm's compile mode now (nothing to
    do when it is "off"), over a dummy cache, so that no request pays for it. Returns the seconds."""
    if lm.compile == "off":
        return 0.0
    grow = tree_grower(head, lm)
    if captures_head(lm):                                  # the tree and the catch-up step: capture them now
        seconds = grow.warm(depth=depth, topk=topk, vocab=lm.vocabulary, what=f"sparrow tree {total}-{depth}-{topk}",
                            draft=draft)
        return seconds + head_stepper(head, lm).warm(rows=depth + 1)     # a round accepts ≤ depth tokens, + 1
    cache = HeadCache.empty(head)
    top = head(cache, torch.zeros(3, head.config.hidden, device=lm.device, dtype=lm.dtype), torch.arange(3))[-1]
    seconds = warm_at_thread_counts(      # grow.args[1]: the thread counts the compiled tree is called at
        grow.args[1], lambda: draft_tree(head, lm, cache, top, 3, total=total, depth=depth, topk=topk,
                                         vocab=lm.vocabulary, grow=grow, draft=draft),
        f"sparrow tree {total}-{depth}-{topk}", lm.compile)
    return seconds + head_stepper(head, lm).warm(rows=depth + 1)     # a round accepts ≤ depth tokens, + 1


def draft_chain(head: SparrowHead, lm, cache: HeadCache, top: torch.Tensor, position: int, *, depth: int,
                vocab: int, draft=None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The head's greedy chain of `depth` tokens (the tree ablation), as a tree of width 1 (draft:
    a DraftVocabulary, the only tokens proposed)."""
    base, tokens, state = cache.length, [], top
    for level in range(depth):
        token = (int(lm.logits(state)[:vocab].argmax()) if draft is None
                 else int(draft.ids[draft.logits(state).argmax()]))
        tokens.append(token)
        if level + 1 < depth:
            state = head(cache, head.fuse(lm.embed(torch.tensor([token])), state[None]),
                         torch.tensor([position + level]))[0]
    cache.crop(base)
    return torch.tensor(tokens), chain_parents(depth), {"nodes": depth, "depth": depth}


class HeadDrafter:
    """lm: the target (the head shares its embedding and LM head); head: a loaded SparrowHead;
    prompt_states: the target's last-layer states of the prompt [L, hidden] (before the final
    norm), layout: the prompt's; video_states: the video's layer-m* states [V, hidden] (without
    VATA only); total, depth, topk: the tree (tree=False: a chain of `depth`); draft_vocab: a
    speculative.draft_vocab.DraftVocabulary, the only tokens the head proposes (None: every token);
    name: the head's, for the run's metrics."""

    def __init__(self, lm, head: SparrowHead, prompt_states: torch.Tensor, layout, *, total: int, depth: int,
                 topk: int, tree: bool = True, max_new_tokens: int, video_states: torch.Tensor | None = None,
                 draft_vocab=None, name: str = "sparrow head"):
        self.lm, self.head = lm, head
        self.total, self.depth, self.topk, self.tree = total, depth, topk, tree
        self.max_new_tokens = max_new_tokens
        self.vocab, self.draft_vocab = lm.vocabulary, draft_vocab
        self.round = 0
        self.committed = 0
        self.proposed: torch.Tensor | None = None
        self.pending = 0                   # committed tokens the target has not cached (its own last token)
        self.head_s = [0.0, 0]             # the head's time per round after the first: sum, count
        self.name, self.cache = name, None
        self.prompt = (prompt_states, layout, video_states)    # the head prefills them in the first round

    @property
    def info(self) -> DraftInfo:
        return DraftInfo(self.name, {"mode": "text only", "vata": self.prompt[2] is None,
                                     "head_tokens": self.cache.length if self.cache is not None else 0})

    @torch.inference_mode()
    def propose(self, verdict: Verdict | None, timer: Timer) -> Proposal | None:
        """The next tree after `verdict` (None: the first); None for a stale verdict or once the
        budget is committed."""
        with timer("head") as spent:       # the head's whole work for a round (its prefill in the first)
            if self.cache is None:
                self._prefill(*self.prompt)
            if verdict is not None:
                if verdict.stale:
                    return None
                self._catch_up(verdict)
            if self.committed >= self.max_new_tokens:
                return None
            shape = dict(depth=self.depth, vocab=self.vocab, draft=self.draft_vocab)
            if self.tree:
                grow = tree_grower(self.head, self.lm)
                tokens, parents, _ = draft_tree(self.head, self.lm, self.cache, self.top, self.position,
                                                total=self.total, topk=self.topk, grow=grow, **shape)
            else:
                tokens, parents, _ = draft_chain(self.head, self.lm, self.cache, self.top, self.position, **shape)
        self.round += 1
        self.proposed = tokens
        if self.round > 1:            # the head's work for a round (catch-up and drafting), as Tq is reported
            self.head_s = [self.head_s[0] + spent.seconds, self.head_s[1] + 1]
        return Proposal(self.round, self.committed, tokens, parents=parents, wants_features=True,
                        draft_s=self.head_s[0] / self.head_s[1] if self.head_s[1] else None,
                        info=self.info if self.round == 1 else None)

    @torch.inference_mode()
    def _prefill(self, prompt_states: torch.Tensor, layout, video_states: torch.Tensor | None) -> None:
        """The head over the prompt's text, each token with the target's feature of the token before
        it; without VATA the video's layer-m* states first."""
        lm, head = self.lm, self.head
        final = lm.final_norm(prompt_states.to(lm.device))                       # [L, hidden]: what the LM head reads
        text = torch.ones(layout.length, dtype=torch.bool)
        text[layout.video] = False
        text[0] = False                                                        # no feature before the first token
        rows = text.nonzero().squeeze(1)
        self.cache = HeadCache.empty(head)
        if video_states is not None:
            video = video_states.to(lm.device, lm.dtype)
            head(self.cache, video, torch.arange(-video.shape[0], 0))
        z = head.fuse(lm.embed(layout.ids[rows]), final[rows - 1])
        out = head(self.cache, z, torch.arange(rows.shape[0]))
        self.position = rows.shape[0]              # the head's next text position
        self.top, self.last_feature = out[-1], final[-1]   # its output for the last token; the target's feature there

    def _catch_up(self, verdict: Verdict) -> None:
        """After a verdict: the accepted tokens and the target's own with true features."""
        path = [int(self.proposed[i]) for i in verdict.path]
        new = path + ([verdict.token] if verdict.token >= 0 else [])
        self.committed = verdict.length
        feats = torch.cat([self.last_feature[None], verdict.features.to(self.last_feature.dtype)])  # [1 + m, H]
        # the rows the head runs now: the path's tokens and the new one, each after the token
        # whose true feature precedes it (the pending token's, when there was one, came first)
        prev = feats[self.pending:]
        rows = torch.tensor(new)
        step = head_stepper(self.head, self.lm)
        if step is not None:
            out = step(self.cache, rows, prev[:rows.shape[0]], self.position)
        else:
            out = self.head(self.cache, self.head.fuse(self.lm.embed(rows), prev[:rows.shape[0]]),
                            torch.arange(self.position, self.position + rows.shape[0]))
        self.position += rows.shape[0]
        self.top, self.last_feature = out[-1], feats[-1]
        self.pending = 1 if verdict.token >= 0 else 0
