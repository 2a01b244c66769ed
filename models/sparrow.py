"""Sparrow's draft head: one decoder layer on the target's hidden states that attends to text only.

What it computes (the paper's Eq. 1-2, EAGLE's head):

    z_t   = FC(e_t ⊕ h_{t-1})          e_t: the target's embedding of token t (shared, frozen);
                                        h_{t-1}: the target's feature of the token before t, or,
                                        for a drafted token, the head's own output there
    ĥ_t   = Layer(z_t | the head's cache)  one decoder layer shaped like one of the target's
    p_t+1 = softmax(lm_head(ĥ_t))       the target's LM head (shared, frozen)

Choices the paper leaves open, made here (config keys of the head, `SparrowConfig`):

- **The feature h** is the target's *final-norm* hidden state, the vector its LM head reads
  (VideoLM.prefill(hidden=True)); EAGLE's "second-to-top" feature. The head regresses it, so
  lm_head(ĥ) is a prediction in the target's own terms.
- **Positions (VATA)**: the head's cache holds text tokens only (the prompt's text and the
  answer), numbered 0, 1, 2 ... in their order, so a text token's position does not depend on how
  much video the prompt holds: what the head learned on short videos is what it sees on long ones.
  Rotary embedding is plain 1-D RoPE with the target's base.
- **Without VATA** (`vata: false`, an ablation), the head's cache also holds the video tokens'
  mid-layer states (IVSB's h^{m*}) as a prefix at positions −V .. −1 before the text.
- **IVSB in training**: the same prefix of h^{m*} (m* = half the target's layers) joins the
  head's input sequence; at inference with VATA it is left out.

The head's parameters are its own (FC, the layer); embedding and LM head stay the target's and are
never saved with it. A head is saved as `sparrow.json` + `head.safetensors` beside nothing else.

    head = SparrowHead.load("zoo/weights/qwen-sparrow", target_lm)
    cache = HeadCache.empty(head)
    out = head.forward(cache, head.fuse(embeds, features), positions)     # [n, hidden]
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import grouped_attention
from models.compiled_step import split_attention
from models.lean import rms_norm, rotate
from models.packing import PackedLayer, mlp_products, o_product, packed_copy, qkv_products, rebind, with_tiles
from models.tiled import product as tiled_product
from models.tiled import tile, tile_bias

CONFIG_FILE, WEIGHTS_FILE = "sparrow.json", "head.safetensors"


@dataclass(frozen=True)
class SparrowConfig:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float
    eps: float
    vocab: int                       # the target's LM head rows (checked at load)
    target: str = ""                 # the target it was trained on (a name, for the card)
    tap_layer: int = 0               # m*: the target layer whose video states IVSB bridges (0: none)
    vata: bool = True                # text-only attention at inference
    ivsb: bool = True                # trained with the video's mid-layer states as a prefix
    mtp: bool = True                 # trained with the recursive second pass

    @classmethod
    def of_target(cls, lm, **kw) -> SparrowConfig:
        c = lm.text_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or getattr(c, "rope_theta", 1e6)
        return cls(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, head_dim, c.intermediate_size,
                   float(theta), float(c.rms_norm_eps), int(lm.vocab_size), **kw)


@dataclass
class HeadCache:
    """The head's own keys and values [kv_heads, L, head_dim] and the positions they sit at."""

    keys: torch.Tensor
    values: torch.Tensor

    @classmethod
    def empty(cls, head: SparrowHead) -> HeadCache:
        c, p = head.config, head.fc.weight
        return cls(p.new_zeros(c.kv_heads, 0, c.head_dim), p.new_zeros(c.kv_heads, 0, c.head_dim))

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    def crop(self, n: int) -> None:
        self.keys, self.values = self.keys[:, :n], self.values[:, :n]


class SparrowHead(nn.Module):
    packed: PackedLayer | None = None        # the layer's projections packed (pack), as its target's are
    fc_tiles: tuple | None = None            # the FC's weight and bias in column tiles (pack(tiled=True))

    def __init__(self, config: SparrowConfig):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(2 * c.hidden, c.hidden)
        self.input_norm = nn.Parameter(torch.ones(c.hidden))
        self.q = nn.Linear(c.hidden, c.heads * c.head_dim)
        self.k = nn.Linear(c.hidden, c.kv_heads * c.head_dim)
        self.v = nn.Linear(c.hidden, c.kv_heads * c.head_dim)
        self.o = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        self.post_norm = nn.Parameter(torch.ones(c.hidden))
        self.gate = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down = nn.Linear(c.intermediate, c.hidden, bias=False)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    # ------------------------------------------------------------------------ the math

    def fuse(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """embeds, features [n, hidden] -> z [n, hidden] = FC(e ⊕ h)."""
        x = torch.cat([embeds, features.to(embeds.dtype)], -1)
        if self.fc_tiles is not None:
            return tiled_product(x, *self.fc_tiles, self.config.hidden)
        return self.fc(x)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] (any integers, negative for a prefix before the text) -> cos, sin [n, head_dim]."""
        angles = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None]   # [n, hd/2]
        emb = torch.cat([angles, angles], -1)
        return emb.cos().to(self.fc.weight.dtype), emb.sin().to(self.fc.weight.dtype)

    def forward(self, cache: HeadCache | None, z: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """z [n, hidden] (fused inputs, or raw states for a prefix) at positions [n] after the
        cached entries; appends their keys and values to `cache` (None: no cache, the n alone).
        mask: bool [n, cached + n] (True: attend) or None (everything cached, causal among the
        n). Returns the layer's output ĥ [n, hidden] (no final norm: it regresses the target's
        final-norm feature)."""
        c, n = self.config, z.shape[0]
        q, k, v = self._project(z, positions)
        if cache is not None:
            keys, values = torch.cat([cache.keys, k], 1), torch.cat([cache.values, v], 1)
            cache.keys, cache.values = keys, values
        else:
            keys, values = k, v
        full = None if mask is None else mask[None, None].to(z.device)
        attn = grouped_attention(q[None], keys[None], values[None], full, c.head_dim ** -0.5)   # [1, n, H, hd]
        return self._finish(z, attn.reshape(n, c.heads * c.head_dim))

    def rows(self, z: torch.Tensor, positions: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
             earlier_k: torch.Tensor, earlier_v: torch.Tensor, mask: torch.Tensor, held: torch.Tensor | None = None):
        """The layer over rows that are not cached (a draft tree's level): z [n, hidden] at
        positions [n]; every entry of the read-only prefix_k, prefix_v [KV, L, hd] (the head's
        cache) is seen (with `held` bool [L], only those it marks: a fixed buffer with spare room),
        and of the rows earlier_k, earlier_v [KV, e, hd] followed by these n, the ones mask bool
        [n, e + n] says. Returns (ĥ [n, hidden], the n rows' keys and values [KV, n, hd]). Fixed
        shapes and nothing written: what a compiled or captured tree level needs."""
        c = self.config
        q, k, v = self._project(z, positions)
        among_k, among_v = torch.cat([earlier_k, k], 1), torch.cat([earlier_v, v], 1)
        attn = split_attention(q, among_k, among_v, prefix_k, prefix_v, mask, c.head_dim ** -0.5, held)   # [n, H*hd]
        return self._finish(z, attn), k, v

    def _project(self, z: torch.Tensor, positions: torch.Tensor):
        """z [n, hidden] -> q [H, n, hd], k, v [KV, n, hd], rotated to their positions."""
        c, n = self.config, z.shape[0]
        h = rms_norm(z, self.input_norm, c.eps)
        q, k, v = qkv_products(h, self.packed) if self.packed is not None else (self.q(h), self.k(h), self.v(h))
        q = q.reshape(n, c.heads, c.head_dim).transpose(0, 1)                 # [H, n, hd]
        k = k.reshape(n, c.kv_heads, c.head_dim).transpose(0, 1)              # [KV, n, hd]
        v = v.reshape(n, c.kv_heads, c.head_dim).transpose(0, 1)
        cos, sin = self.rotary(positions)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def _finish(self, z: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual, output projection and MLP after attention [n, H * hd] -> ĥ [n, hidden]."""
        p = self.packed
        x = z + (o_product(attn, p) if p is not None else self.o(attn))
        h = rms_norm(x, self.post_norm, self.config.eps)
        return x + (mlp_products(h, p) if p is not None else self.down(F.silu(self.gate(h)) * self.up(h)))

    def pack(self, tiled: bool = False) -> None:
        """Pack the layer's projections (models.packing: q, k, v in one [in, out] matrix, gate and
        up in one), the modules rebound as views of them; its drafting then multiplies by the
        packed tensors (tiled: by their copy in column tiles, models.tiled, the FC's too). For a head on the CPU
        beside a packed target (load)."""
        projections = {"q": self.q, "k": self.k, "v": self.v, "o": self.o, "gate": self.gate, "up": self.up,
                       "down": self.down}
        packed = packed_copy(projections)
        rebind(projections, packed)
        self.packed = with_tiles(packed) if tiled else packed
        if tiled:      # the FC too: MKL multiplies by its [out, in] weight at a third of the tiles' pace here
            with torch.no_grad():
                self.fc_tiles = tuple(None if t is None else nn.Parameter(t, requires_grad=False)
                                      for t in (tile(self.fc.weight.t()), tile_bias(self.fc.bias)))

    # ------------------------------------------------------------------------ files

    def save(self, out_dir: Path) -> None:
        from safetensors.torch import save_file

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=1))
        save_file({k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in self.state_dict().items()},
                  str(out_dir / WEIGHTS_FILE))

    @classmethod
    def load(cls, path: str | Path, lm) -> SparrowHead:
        """The head saved at `path`, for the target `lm` (same width and vocabulary, or a clear
        error), in the target's dtype and on its device."""
        from safetensors.torch import load_file

        from models.load import ModelError, resolve

        where = Path(resolve(str(path)))
        if not (where / CONFIG_FILE).is_file():
            raise ModelError(f"Sparrow head {str(path)!r}: no {CONFIG_FILE} there (train one: "
                             "python -m run +experiment=train_sparrow)")
        config = SparrowConfig(**json.loads((where / CONFIG_FILE).read_text()))
        if config.hidden != lm.text_config.hidden_size or config.vocab != lm.vocab_size:
            raise ModelError(f"Sparrow head {str(path)!r} was trained for width {config.hidden} and "
                             f"{config.vocab} tokens; the target {lm.name} has {lm.text_config.hidden_size} and "
                             f"{lm.vocab_size}")
        head = cls(config)
        head.load_state_dict({k: v.float() for k, v in load_file(str(where / WEIGHTS_FILE)).items()})
        head = head.to(lm.device, lm.dtype).eval()
        if lm.lean is not None and lm.lean.packed is not None:       # packing paid for the target here
            head.pack(tiled=lm.lean.packed[0].tiles is not None)
        return head
