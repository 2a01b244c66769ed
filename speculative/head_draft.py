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
   nodes overall (speculative.tree); the drafted rows are dropped from the head's cache afterwards.
   `tree=False` drafts a chain of `depth` tokens instead (the head's argmax), an ablation.
"""

from __future__ import annotations

import torch

from models.sparrow import HeadCache, SparrowHead
from speculative.protocol import DraftInfo, Proposal, Timer, Verdict
from speculative.tree import best_subtree, chain_parents, path_to, to_expand


def draft_tree(head: SparrowHead, lm, cache: HeadCache, top: torch.Tensor, position: int, *, total: int,
               depth: int, topk: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A dynamic draft tree under the token whose head output is `top` [hidden] (the head's cache
    holds it); its children sit at text position `position`. Returns (tokens [n], parents [n],
    facts) with parents listed first; the head's cache is as it was."""
    base = cache.length
    first = torch.log_softmax(lm.logits(top)[:vocab], -1).topk(min(topk, vocab))
    tokens = first.indices.tolist()
    parents = [-1] * len(tokens)
    scores = first.values.tolist()
    depths = [1] * len(tokens)
    state: dict[int, torch.Tensor] = {}            # node -> the head's output there (expanded nodes)
    slot: dict[int, int] = {}                      # node -> its row in the head's cache
    frontier = list(range(len(tokens)))
    for level in range(1, depth):
        expand = to_expand(frontier, scores, topk)
        if not expand:
            break
        feats = torch.stack([top if parents[i] < 0 else state[parents[i]] for i in expand])
        z = head.fuse(lm.embed(torch.tensor([tokens[i] for i in expand])), feats)
        n_cached = cache.length
        mask = torch.zeros(len(expand), n_cached + len(expand), dtype=torch.bool)
        mask[:, :base] = True                       # the committed text and the root
        for row, i in enumerate(expand):            # itself and its drafted ancestors' rows
            mask[row, [n_cached + row] + [slot[a] for a in path_to(parents, parents[i])]] = True
        out = head(cache, z, torch.full((len(expand),), position + level - 1), mask)
        frontier = []
        best = torch.log_softmax(lm.logits(out)[:, :vocab], -1).topk(min(topk, vocab), -1)
        for row, i in enumerate(expand):
            state[i], slot[i] = out[row], n_cached + row
            for lp, t in zip(best.values[row].tolist(), best.indices[row].tolist()):
                tokens.append(t)
                parents.append(i)
                scores.append(scores[i] + lp)
                depths.append(level + 1)
                frontier.append(len(tokens) - 1)
    cache.crop(base)
    order, kept_parents = best_subtree(parents, scores, depths, total)
    return (torch.tensor([tokens[i] for i in order]), kept_parents,
            {"nodes": len(order), "depth": max(depths[i] for i in order)})


def draft_chain(head: SparrowHead, lm, cache: HeadCache, top: torch.Tensor, position: int, *, depth: int,
                vocab: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The head's greedy chain of `depth` tokens (the tree ablation), as a tree of width 1."""
    base, tokens, state = cache.length, [], top
    for level in range(depth):
        token = int(lm.logits(state)[:vocab].argmax())
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
    VATA only); total, depth, topk: the tree (tree=False: a chain of `depth`); name: the head's,
    for the run's metrics."""

    def __init__(self, lm, head: SparrowHead, prompt_states: torch.Tensor, layout, *, total: int, depth: int,
                 topk: int, tree: bool = True, max_new_tokens: int, video_states: torch.Tensor | None = None,
                 name: str = "sparrow head"):
        self.lm, self.head = lm, head
        self.total, self.depth, self.topk, self.tree = total, depth, topk, tree
        self.max_new_tokens = max_new_tokens
        self.vocab = lm.vocabulary
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
            shape = dict(depth=self.depth, vocab=self.vocab)
            if self.tree:
                tokens, parents, _ = draft_tree(self.head, self.lm, self.cache, self.top, self.position,
                                                total=self.total, topk=self.topk, **shape)
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
        out = self.head(self.cache, self.head.fuse(self.lm.embed(rows), prev[:rows.shape[0]]),
                        torch.arange(self.position, self.position + rows.shape[0]))
        self.position += rows.shape[0]
        self.top, self.last_feature = out[-1], feats[-1]
        self.pending = 1 if verdict.token >= 0 else 0
