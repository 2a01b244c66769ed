"""EAGLE-2's expansion of a draft tree in fixed shapes: a level at a time over the whole frontier,
as tensors, for the Sparrow head (speculative.head_draft drafts with it, compiled on the CPU;
speculative.captured_head replays it as a CUDA graph)."""

from __future__ import annotations

import torch

from models.sparrow import SparrowHead
from speculative.tree import to_expand


def grow_tree(head: SparrowHead, lm, prefix_k: torch.Tensor, prefix_v: torch.Tensor, top: torch.Tensor,
              position: int | torch.Tensor, *, depth: int, topk: int, vocab: int,
              held: torch.Tensor | None = None, draft=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-2's expansion in fixed shapes, a level at a time over the whole frontier. The root is
    the token whose head output is `top` [hidden], its children at text position `position`;
    prefix_k, prefix_v [KV, L, hd]: the head's cache (read, never written). Each level expands the
    `topk` best frontier nodes (to_expand) in one head forward: each row sees the cache, its
    drafted ancestors' rows and itself; k children of each (the head's k most likely tokens) join
    the frontier.

    -> tokens [N], parents [N] (-1: under the root), scores float64 [N] (cumulative
    log-probabilities), k = min(topk, vocab), N = k + (depth - 1)·k² when topk ≤ vocab; listed
    level by level and, within a level, by the expanded parent, best first. No Python per node
    and no host sync: what torch.compile (or a captured graph) can take whole. For a captured
    graph (speculative.captured_head) the cache is a fixed buffer of which `held` (bool [L]) marks
    the entries, and `position` an int64 [1] tensor on the device. draft: a
    speculative.draft_vocab.DraftVocabulary, the only tokens proposed (their LM head rows alone are
    read, and the log-probabilities are over them); None: the first `vocab` tokens."""

    def log_probs(states):                   # [..., hidden] -> [..., V] (or [..., N]) over what may be proposed
        return torch.log_softmax(lm.logits(states)[..., :vocab] if draft is None else draft.logits(states), -1)

    def token_ids(indices):                  # indices into log_probs' last dimension -> token ids
        return indices if draft is None else draft.ids[indices]

    k = min(topk, vocab if draft is None else draft.size)
    first = log_probs(top).topk(k)
    tokens, parents = [token_ids(first.indices)], [torch.full((k,), -1, device=top.device)]
    scores = [first.values.double()]
    front_scores, front_first = scores[0], 0             # the frontier: the last level's nodes, from node front_first
    front_parent_row = torch.full((k,), -1, device=top.device)   # each frontier node's parent's row (-1: the root)
    c = head.config
    states = top[None]                                   # [1 + rows, hidden]: the root, then each drafted row's output
    drafted_k = prefix_k.new_zeros(c.kv_heads, 0, c.head_dim)      # [KV, rows, hd]
    drafted_v = drafted_k
    sees = torch.zeros(0, 0, dtype=torch.bool, device=top.device)   # [rows, rows]: a drafted row's ancestors and itself
    for level in range(1, depth):
        order = to_expand(front_scores, topk)                             # [e]: positions in the frontier
        e, rows = order.shape[0], sees.shape[0]
        up = front_parent_row[order]                                      # [e]: the parents' rows (-1: the root)
        above = (sees[up.clamp_min(0)] & (up >= 0)[:, None] if rows       # [e, rows]: each parent's view
                 else sees.new_zeros(e, 0))
        mask = torch.cat([above, torch.eye(e, dtype=torch.bool, device=top.device)], 1)   # [e, rows + e]
        z = head.fuse(lm.embed(tokens[-1][order]), states[up + 1])
        at = (torch.full((e,), position + level - 1, device=top.device) if isinstance(position, int)
              else (position + (level - 1)).expand(e))                                      # [e]: the rows' positions
        out, new_k, new_v = head.rows(z, at, prefix_k, prefix_v, drafted_k, drafted_v, mask, held)   # [e, hidden]
        sees = torch.cat([torch.cat([sees, sees.new_zeros(rows, e)], 1), mask])            # [rows + e, rows + e]
        drafted_k, drafted_v = torch.cat([drafted_k, new_k], 1), torch.cat([drafted_v, new_v], 1)
        states = torch.cat([states, out])
        best = log_probs(out).topk(k, -1)                                                    # [e, k]
        tokens.append(token_ids(best.indices).reshape(-1))
        parents.append((front_first + order).repeat_interleave(k))
        front_first += front_scores.shape[0]
        front_scores = (front_scores[order, None] + best.values.double()).reshape(-1)          # [e·k]
        scores.append(front_scores)
        front_parent_row = (rows + torch.arange(e, device=top.device)).repeat_interleave(k)
    return torch.cat(tokens), torch.cat(parents), torch.cat(scores)
