"""Speculative decoding without the engine: the draft ⇄ verify protocol, the acceptance rules, draft
trees, the target's verifier, the drafters (a small model's chain, Sparrow's head tree) and the
reference loop that runs them (speculative.reference). The stages wrap these objects for the
engine; nothing here knows the engine."""
