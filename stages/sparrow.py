"""Sparrow's drafting stage: the draft head (models.sparrow) on the target's own hidden states
proposes a tree of candidates each round; the target verifies the tree (stages.verify, trees).

The head needs no video of its own: the target's prefill publishes its last layer's states as a tap
(the final norm is applied here, giving the feature the LM head reads), and each verdict carries the
target's features of the tokens it just cached. With VATA the head's cache holds the prompt's text
and the answer only; without (`vata: false`, an ablation) the video's layer-m* states come first.

A round (prime 1 on the verdict edge: draft, verify, draft ...):
1. catch up: the accepted tokens, re-run through the head with the target's true features in
   place of the head's own, then the target's new token (bonus or correction) with the true
   feature of the token before it; the last row's output predicts the next token;
2. draft a tree (EAGLE-2's dynamic tree, `draft_tree`): expand the `topk` best frontier nodes by
   cumulative log-probability, `topk` children each, for `depth` levels, then keep the `total`
   best nodes overall (a node's ancestors are always at least as likely, so the kept set is a
   tree); the drafted rows are dropped from the head's cache afterwards.
`tree: false` drafts a chain of `depth` tokens instead (the head's argmax), an ablation.
"""

from __future__ import annotations

import torch

from graph.stage import In, Out, Stage
from models.registry import get_model
from models.sparrow import HeadCache, SparrowHead
from stages.types import Proposal, Taps, Verdict


def draft_tree(head: SparrowHead, lm, cache: HeadCache, top: torch.Tensor, position: int, *, total: int,
               depth: int, topk: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A dynamic draft tree under the token whose head output is `top` [hidden] (the head's cache
    holds it); its children sit at text position `position`. Returns (tokens [n], parents [n],
    facts) with parents listed first; the head's cache is as it was."""
    base = cache.length
    first = torch.log_softmax(lm.lm_head(top).float()[:vocab], -1).topk(min(topk, vocab))
    tokens = first.indices.tolist()
    parents = [-1] * len(tokens)
    scores = first.values.tolist()
    depths = [1] * len(tokens)
    state: dict[int, torch.Tensor] = {}            # node -> the head's output there (expanded nodes)
    slot: dict[int, int] = {}                      # node -> its row in the head's cache
    frontier = list(range(len(tokens)))
    for level in range(1, depth):
        expand = sorted(frontier, key=lambda i: -scores[i])[:topk]
        if not expand:
            break
        feats = torch.stack([top if parents[i] < 0 else state[parents[i]] for i in expand])
        z = head.fuse(lm.embed(torch.tensor([tokens[i] for i in expand])), feats)
        n_cached = cache.length
        mask = torch.zeros(len(expand), n_cached + len(expand), dtype=torch.bool)
        mask[:, :base] = True                       # the committed text and the root
        for row, i in enumerate(expand):
            mask[row, n_cached + row] = True
            a = parents[i]
            while a >= 0:                           # its drafted ancestors' rows
                mask[row, slot[a]] = True
                a = parents[a]
        out = head(cache, z, torch.full((len(expand),), position + level - 1), mask)
        frontier = []
        logp = torch.log_softmax(lm.lm_head(out).float()[:, :vocab], -1)
        best = logp.topk(min(topk, vocab), -1)
        for row, i in enumerate(expand):
            state[i], slot[i] = out[row], n_cached + row
            for lp, t in zip(best.values[row].tolist(), best.indices[row].tolist()):
                tokens.append(t)
                parents.append(i)
                scores.append(scores[i] + lp)
                depths.append(level + 1)
                frontier.append(len(tokens) - 1)
    cache.crop(base)
    keep = set(sorted(range(len(tokens)), key=lambda i: -scores[i])[:total])
    for i in list(keep):                            # ancestors of a kept node (ties could drop one)
        a = parents[i]
        while a >= 0 and a not in keep:
            keep.add(a)
            a = parents[a]
    order = sorted(keep, key=lambda i: (depths[i], i))
    index = {node: j for j, node in enumerate(order)}
    return (torch.tensor([tokens[i] for i in order]), torch.tensor([index.get(parents[i], -1) for i in order]),
            {"nodes": len(order), "depth": max(depths[i] for i in order)})


def draft_chain(head: SparrowHead, lm, cache: HeadCache, top: torch.Tensor, position: int, *, depth: int,
                vocab: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The head's greedy chain of `depth` tokens (the tree ablation), as a tree of width 1."""
    base, tokens, state = cache.length, [], top
    for level in range(depth):
        token = int(lm.lm_head(state).float()[:vocab].argmax())
        tokens.append(token)
        if level + 1 < depth:
            state = head(cache, head.fuse(lm.embed(torch.tensor([token])), state[None]),
                         torch.tensor([position + level]))[0]
    cache.crop(base)
    return torch.tensor(tokens), torch.arange(depth) - 1, {"nodes": depth, "depth": depth}


class SparrowDraft(Stage):
    """model: the target entry (the head shares its embedding and LM head); head: the head's
    directory; total, depth, topk: the dynamic tree (the seed's 30-4-8, 48-5-10, 25-5-8);
    tree: false drafts a chain of `depth`; vata: null (the head's own setting) or false, the
    ablation where the head also attends to the video's layer-m* states; max_new_tokens: as the
    verifier's."""

    placement = "gpu"
    inputs = {"taps": In(Taps), "verdict": In(Verdict, stream=True)}
    outputs = {"proposal": Out(Proposal, stream=True)}

    def __init__(self, model: dict, head: str, total: int = 30, depth: int = 4, topk: int = 8, tree: bool = True,
                 vata: bool | None = None, max_new_tokens: int = 256):
        if not (total >= 1 and depth >= 1 and topk >= 1):
            raise ValueError(f"the tree needs total, depth and topk ≥ 1, got {total}-{depth}-{topk}")
        self.model, self.head_path = dict(model), head
        self.total, self.depth, self.topk, self.tree = total, depth, topk, bool(tree)
        self.max_new_tokens, self.vata_setting = max_new_tokens, vata
        self.lm = self.head = None

    def setup(self, ctx) -> None:
        self.lm = get_model(self.model, ctx.device)
        self.head = SparrowHead.load(self.head_path, self.lm)
        self.vata = self.head.config.vata if self.vata_setting is None else bool(self.vata_setting)
        if not self.vata and not self.head.config.tap_layer:
            raise ValueError(f"{self.head_path}: without VATA the head reads the video's layer-m* states, "
                             "and this head names no m* (tap_layer)")
        self._reset()

    def _reset(self) -> None:
        self.cache = None
        self.round = 0
        self.committed = 0
        self.position = 0                  # the head's next text position
        self.last_feature = None           # the target's feature of the last token it has cached
        self.top = None                    # the head's output for the last token it has run
        self.proposed: torch.Tensor | None = None
        self.pending = 0                   # committed tokens the target has not cached (its own last token)
        self.head_s = [0.0, 0]             # the head's time per round after the first: sum, count

    def start_run(self, ctx) -> None:
        self._reset()

    @torch.inference_mode()
    def __call__(self, ctx, taps: Taps, verdict: Verdict | None):
        lm, head = self.lm, self.head
        with ctx.timer("head") as timer:
            if self.cache is None:
                self._prefill(taps)
            if verdict is not None:
                if verdict.stale:
                    return {}
                self._catch_up(verdict)
            if self.committed >= self.max_new_tokens:
                return {}
            vocab = min(len(lm.tokenizer), lm.vocab_size)
            if self.tree:
                tokens, parents, facts = draft_tree(head, lm, self.cache, self.top, self.position, total=self.total,
                                                    depth=self.depth, topk=self.topk, vocab=vocab)
            else:
                tokens, parents, facts = draft_chain(head, lm, self.cache, self.top, self.position,
                                                     depth=self.depth, vocab=vocab)
        self.round += 1
        self.proposed = tokens
        if self.round > 1:            # the head's work for a round (catch-up and drafting), as Tq is reported
            self.head_s = [self.head_s[0] + timer.seconds, self.head_s[1] + 1]
        meta = {"features": True, "tree_nodes": facts["nodes"]}
        if self.head_s[1]:
            meta["tq_s"] = self.head_s[0] / self.head_s[1]
        if self.round == 1:
            meta |= {"draft_model": f"sparrow head {self.head_path}", "draft_prefill": {"mode": "text only",
                     "vata": self.vata, "head_tokens": self.cache.length}}
        ctx.emit("proposal", Proposal(self.round, self.committed, tokens, None, meta, parents=parents))
        return {}

    def _prefill(self, taps: Taps) -> None:
        """The head over the prompt's text, each token with the target's feature of the token
        before it; without VATA the video's layer-m* states first."""
        lm, head, c = self.lm, self.head, self.head.config
        layout = taps.layout
        final = lm.text.norm(taps.layers[lm.n_layers].to(lm.device))          # [L, hidden]: what the LM head reads
        text = torch.ones(layout.length, dtype=torch.bool)
        text[layout.video] = False
        text[0] = False                                                        # no feature before the first token
        rows = text.nonzero().squeeze(1)
        self.cache = HeadCache.empty(head)
        if not self.vata:
            if c.tap_layer not in taps.layers:
                raise ValueError(f"without VATA the head needs the target's layer {c.tap_layer} as a tap; the "
                                 f"prefill publishes {sorted(taps.layers)} (model.sparrow_taps)")
            video = taps.layers[c.tap_layer][layout.video].to(lm.device, lm.dtype)
            head(self.cache, video, torch.arange(-video.shape[0], 0))
        z = head.fuse(lm.embed(layout.ids[rows]), final[rows - 1])
        out = head(self.cache, z, torch.arange(rows.shape[0]))
        self.position = rows.shape[0]
        self.top, self.last_feature = out[-1], final[-1]

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
