"""speculative.model_draft's rules off the engine: when a pre-verify round pays, and the drafter
deciding it from the times it measured and was told, driven round by round with a scripted model
and a timer whose readings the test sets."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from models.sampling import Sampling
from speculative.model_draft import ModelDrafter, pre_verify_pays
from speculative.protocol import RoundKind, Verdict

VOCAB = 8
DRAFTED = 3          # the scripted draft's greedy token, always


def test_pre_verify_pays_when_the_window_covers_the_one_token_verification():
    # γ = c*: the window takes as long as the target's one-token round, so only Tq is added
    assert pre_verify_pays(tq_s=0.010, window=5, tp1_s=0.050, target_s_per_token=0.015)
    # a draft 15x faster than the target (the toy pair on CPU cores): the one-token round costs the
    # target most of a round (1 + 6 - 4 = 3 ms) for about one token, which now costs it 2.5 ms
    assert not pre_verify_pays(tq_s=0.001, window=4, tp1_s=0.006, target_s_per_token=0.0025)
    # the same round where tokens cost the target more than that delay
    assert pre_verify_pays(tq_s=0.001, window=4, tp1_s=0.006, target_s_per_token=0.004)


class ScriptedLM:
    """A draft whose greedy token is always DRAFTED; its cache is not modelled."""

    vocabulary = VOCAB

    def score(self, cache, tokens, start, layout):
        logits = torch.zeros(tokens.shape[0], VOCAB)
        logits[:, DRAFTED] = 1.0
        return logits

    def drop_last(self, cache, n):
        pass


def fixed_timer(seconds: float):
    @contextmanager
    def timer(name):
        yield SimpleNamespace(seconds=seconds)
    return timer


def drafter(pre_verify) -> ModelDrafter:
    first = torch.zeros(VOCAB)
    first[DRAFTED] = 1.0
    return ModelDrafter(ScriptedLM(), None, 0, None, first, window=4, sampling=Sampling(0.0, 0, 1.0), vocab=VOCAB,
                        max_new_tokens=64, pre_verify=pre_verify)


@pytest.mark.parametrize("verify_s, after_rollback", [(0.006, RoundKind.PRE_VERIFY), (0.012, RoundKind.WINDOW)])
def test_auto_pre_verifies_after_a_rollback_only_where_it_pays(verify_s, after_rollback):
    """Tq 1 ms and γ 4 (the window drafts in 4 ms). Round 1 (pre-verify: nothing is measured yet)
    and round 2 (drafted ahead) are accepted, round 2 partly; the rollback's next round is then a
    pre-verify round where the target's one-token verification (verify_s) delays the window less
    than a committed token costs it: at 6 ms, 1 + (6 - 4) = 3 ms against 12 ms / 3 tokens = 4 ms; at
    12 ms, 1 + 8 = 9 ms against 24 / 3 = 8 ms."""
    d, timer = drafter("auto"), fixed_timer(0.001)
    first = d.propose(None, timer)
    assert first.kind == RoundKind.PRE_VERIFY and first.tokens.tolist() == [DRAFTED]
    ahead = d.propose(None, timer)                 # drafted on the assumption round 1 is accepted whole
    assert ahead.kind == RoundKind.WINDOW and ahead.tokens.tolist() == [DRAFTED] * 4
    # round 1 accepted, the target's own token the draft's: the round in flight still stands
    d.propose(Verdict(1, 1, DRAFTED, 2, verify_s=verify_s), timer)
    assert d.tp1 == [verify_s, 1] and d.committed == 2 and not d.restarted
    # round 2: of the 3 tokens past the target's, none accepted; the target's own token differs
    nxt = d.propose(Verdict(2, 0, DRAFTED + 1, 3, verify_s=verify_s), timer)
    assert d.committed == 3 and d.target_s == pytest.approx(2 * verify_s)
    assert nxt.kind == after_rollback
    assert nxt.tokens.shape[0] == (1 if after_rollback == RoundKind.PRE_VERIFY else 4)


@pytest.mark.parametrize("setting, kinds", [(True, [RoundKind.PRE_VERIFY]), (False, [RoundKind.WINDOW])])
def test_fixed_settings_ignore_the_times(setting, kinds):
    d, timer = drafter(setting), fixed_timer(0.001)
    assert [d.propose(None, timer).kind] == kinds


def test_pre_verify_setting_is_checked():
    with pytest.raises(ValueError, match="pre_verify"):
        drafter("sometimes")
