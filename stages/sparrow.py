"""sparrow: Sparrow's draft head proposes a tree of candidates each round, from the target's own
hidden states (speculative.head_draft has the drafting; the target verifies the tree in one
forward, stages.verify).

The target's prefill publishes its last layer's states (and, for the no-VATA ablation, layer m*'s)
as a tap; the head prefills the prompt's text from them on its first call, and each verdict brings
the target's states of what it accepted. The verdict edge takes prime 1 (draft, verify, draft ...).
"""

from __future__ import annotations

from graph.stage import In, Out, Stage
from models.registry import get_model
from models.sparrow import SparrowHead
from speculative.draft_vocab import DraftVocabulary
from speculative.head_draft import HeadDrafter, warm_tree
from speculative.protocol import Proposal, Verdict
from stages.draft import draft_round
from stages.types import Taps


class SparrowDraft(Stage):
    """model: the target entry (the head shares its embedding and LM head); head: the head's
    directory; total, depth, topk: the dynamic tree (the paper's 30-4-8, 48-5-10, 25-5-8);
    tree: false drafts a chain of `depth`; vata: null (the head's own setting) or false, the
    ablation where the head also attends to the video's layer-m* states; draft_vocab: null (the
    head proposes any token) or a JSON list of the token ids it may propose (python -m
    tools.draft_vocab; its LM head rows alone are read each level: speculative.draft_vocab);
    max_new_tokens: as the verifier's."""

    placement = "gpu"
    inputs = {"taps": In(Taps), "verdict": In(Verdict, stream=True)}
    outputs = {"proposal": Out(Proposal, stream=True)}

    def __init__(self, model: dict, head: str, total: int = 30, depth: int = 4, topk: int = 8, tree: bool = True,
                 vata: bool | None = None, draft_vocab: str | None = None, max_new_tokens: int = 256):
        if not (total >= 1 and depth >= 1 and topk >= 1):
            raise ValueError(f"the tree needs total, depth and topk ≥ 1, got {total}-{depth}-{topk}")
        self.model, self.head_path = dict(model), head
        self.total, self.depth, self.topk, self.tree = total, depth, topk, bool(tree)
        self.max_new_tokens, self.vata_setting = max_new_tokens, vata
        self.draft_vocab_path = draft_vocab
        self.lm = self.head = self.draft_vocab = None

    def setup(self, ctx) -> None:
        self.lm = get_model(self.model, ctx.device)
        self.head = SparrowHead.load(self.head_path, self.lm)
        self.vata = self.head.config.vata if self.vata_setting is None else bool(self.vata_setting)
        if not self.vata and not self.head.config.tap_layer:
            raise ValueError(f"{self.head_path}: without VATA the head reads the video's layer-m* states, "
                             "and this head names no m* (tap_layer)")
        # one object for the stage's life: a captured tree reads its tensors by address
        self.draft_vocab = DraftVocabulary.load(self.draft_vocab_path, self.lm) if self.draft_vocab_path else None
        if self.tree:
            warm_tree(self.head, self.lm, total=self.total, depth=self.depth, topk=self.topk, draft=self.draft_vocab)
        self.start_run(ctx)

    def __call__(self, ctx, taps: Taps, verdict: Verdict | None):
        return draft_round(self, ctx, taps, verdict)

    def start_run(self, ctx) -> None:
        self.drafter: HeadDrafter | None = None

    def drafter_for(self, taps: Taps) -> HeadDrafter:
        """This stage's head and tree over the target's prefill states: what one run drafts with."""
        layout, m = taps.layout, self.head.config.tap_layer
        video = None
        if not self.vata:
            if m not in taps.layers:
                raise ValueError(f"without VATA the head needs the target's layer {m} as a tap; the "
                                 f"prefill publishes {sorted(taps.layers)} (model.sparrow_taps)")
            video = taps.layers[m][layout.video]
        return HeadDrafter(self.lm, self.head, taps.layers[self.lm.n_layers], layout, total=self.total,
                           depth=self.depth, topk=self.topk, tree=self.tree, max_new_tokens=self.max_new_tokens,
                           video_states=video, draft_vocab=self.draft_vocab, name=f"sparrow head {self.head_path}")
