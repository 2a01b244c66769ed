"""The peer a user would pick to decode faster: transformers' own Qwen2 decoder over a static cache,
the step through torch.compile ("reduce-overhead" on a GPU: CUDA graphs; inductor's default on the
CPU). bench_realsize times it beside reelflow's paths at the same shapes in the same run.

The peer is built from a loaded VideoLM's text decoder: a Qwen2ForCausalLM of the same shape that
takes the model's own weight tensors (shared, not copied), so it costs no extra memory and reads
the same bytes a step of reelflow's reads. Its context is text ids of the same length (a decode
step's cost depends on how many entries are cached, not on what they came from).

    peer = PeerDecoder(lm, compile="auto")
    step_ms = peer.step_ms(context=8192, steps=32)     # a static cache of 8192 + the steps' entries
"""

from __future__ import annotations

import statistics
import time

import torch

MODES = ("auto", "off", "default", "reduce-overhead")


class PeerDecoder:
    """transformers' Qwen2 decoder with lm's text shape and weights; compile: "off" (eager),
    "default", "reduce-overhead", or "auto" (reduce-overhead on CUDA, default on the CPU)."""

    def __init__(self, lm, *, compile: str = "auto"):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        if compile not in MODES:
            raise ValueError(f"peer compile={compile!r}: one of {', '.join(MODES)}")
        if lm.lean is None:
            raise ValueError(f"{lm.name}: the peer needs a Qwen2-kind text decoder (a model with a lean path)")
        c = lm.text_config
        theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or getattr(c, "rope_theta", 1e6)
        config = Qwen2Config(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                             num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                             num_key_value_heads=c.num_key_value_heads, vocab_size=c.vocab_size,
                             rms_norm_eps=c.rms_norm_eps, max_position_embeddings=1 << 20,
                             rope_parameters={"rope_type": "default", "rope_theta": float(theta)},
                             tie_word_embeddings=False, use_cache=True)
        config._attn_implementation = "sdpa"
        with torch.device("meta"):
            model = Qwen2ForCausalLM(config)
        # the parameters themselves, not state_dict(): packed weights (models.packing) give copies there
        tensors = {**dict(lm.text.named_parameters()), **dict(lm.text.named_buffers())}
        state = {f"model.{k}": v.detach() for k, v in tensors.items() if not k.startswith("rotary_emb")}
        state["lm_head.weight"] = lm.lm_head.weight
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if unexpected or [k for k in missing if "rotary" not in k]:
            raise ValueError(f"{lm.name}: its text decoder is not Qwen2's (missing {missing}, unexpected {unexpected})")
        with torch.device(lm.device):                      # its inverse frequencies were left on meta
            model.model.rotary_emb = type(model.model.rotary_emb)(config)
        self.model = model.to(lm.device).eval()
        self.config, self.device = config, lm.device
        on_gpu = lm.device.type == "cuda"
        self.mode = ("reduce-overhead" if on_gpu else "default") if compile == "auto" else compile
        self._forward = self.model.forward if self.mode == "off" else torch.compile(
            self.model.forward, mode=None if self.mode == "default" else self.mode, fullgraph=True)

    @torch.inference_mode()
    def step_ms(self, context: int, steps: int, warm: int = 3) -> float:
        """Milliseconds a greedy decode step takes after a prefill of `context` tokens: the one-token
        forward over a static cache sized for the context and the steps (as a user sizes it for a
        prompt and its answer), the argmax and the host reading the token, as bench_realsize's
        step_ms counts them; mean over `steps` after `warm` untimed steps (the compile and the
        graph capture: each cache size compiles once)."""
        from transformers import StaticCache

        cache = StaticCache(config=self.config, max_cache_len=context + warm + steps)
        g = torch.Generator().manual_seed(context)
        ids = torch.randint(0, self.config.vocab_size, (1, context), generator=g).to(self.device)
        out = self.model(input_ids=ids, cache=cache, cache_position=torch.arange(context, device=self.device),
                         logits_to_keep=1, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        position = context
        times = []
        for i in range(warm + steps):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            out = self._forward(input_ids=token, cache=cache,
                                cache_position=torch.tensor([position], device=self.device), logits_to_keep=1,
                                use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            int(token)                                     # the host reads the token, as a decode loop does
            times.append(time.perf_counter() - t0)
            position += 1
        return 1000 * statistics.mean(times[warm:])
