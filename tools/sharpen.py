"""A checkpoint whose language model attends more sharply: every query scaled by `scale`; and a
probe of a sharpening that grows with the context instead.

    python -m tools.sharpen zoo/weights/qwen-target /tmp/qwen-x1.3 --scale 1.3
    python -m tools.sharpen zoo/weights/qwen-target /tmp/qwen-top --scale 1.6 --layers 3,4,5
    python -m run -m +experiment=caption_eval model.target.path=/tmp/qwen-x1.3 data.toy.seconds=30,120
    python -m tools.sharpen zoo/weights/qwen-target --logn 400 --powers 0,2,4 --seconds 30,120

Scaling q_proj (weight and bias) by s multiplies every attention logit of those layers by s, i.e.
softmax temperature 1/s, and the result is an ordinary checkpoint. A diagnostic for the toy zoo's
failure on videos 4x longer than it was trained on: with 4x the visual tokens, attention spreads
over more keys (it recovered part of the 120-s loss and was not shipped: docs/zoo.md). Works for both families.

`--logn L`: no checkpoint is written. Each query that sees n keys is scaled by (log n / log L)^P
(1 up to n = L), as Qwen-1's "logn" attention does, through an attention function registered for
the language model only; the F1 of greedy descriptions (the trainer's check,
`zoo.train.toy.caption_f1`: rendered frames, reelflow's greedy decoding) on validation seeds is
printed for each power P and length.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch


def sharpen(model, scale: float, layers=None):
    """Scales the queries of the language model's layers `layers` (all when None) in place."""
    if not scale > 0:
        raise ValueError(f"scale={scale}: a positive factor on the attention logits")
    decoder = model.model.language_model.layers
    chosen = range(len(decoder)) if layers is None else list(layers)
    for i in chosen:
        if not 0 <= i < len(decoder):
            raise ValueError(f"layer {i}: the language model has layers 0..{len(decoder) - 1}")
        q = decoder[i].self_attn.q_proj
        with torch.no_grad():
            q.weight.mul_(scale)
            if q.bias is not None:
                q.bias.mul_(scale)
    return model


def logn_factor(n_keys: torch.Tensor, length: float, power: float) -> torch.Tensor:
    """(log n / log length)^power, at least 1: the scale on a query that sees n keys."""
    return (torch.log(n_keys.float()) / math.log(length)).clamp(min=1.0) ** power


def probe_logn(source: str, length: float, powers, seconds, seeds) -> list[dict]:
    """F1 of `source` with its LM queries scaled by `logn_factor` (causal: query i of q over k keys
    sees k - q + i + 1 of them), for each power and video length."""
    from transformers import (
        AttentionInterface,
        AttentionMaskInterface,
        AutoModelForImageTextToText,
    )
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    from zoo.tokenizer import build_tokenizer
    from zoo.train.toy import caption_f1

    power_now = {"p": 0.0}

    def attention(module, query, key, value, attention_mask, **kwargs):
        q, k = query.shape[2], key.shape[2]
        n = torch.arange(k - q + 1, k + 1, device=query.device)
        scale = logn_factor(n, length, power_now["p"]).to(query.dtype).view(1, 1, q, 1)
        return sdpa_attention_forward(module, query * scale, key, value, attention_mask, **kwargs)

    name = "toy_logn_probe"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32, use_safetensors=True)
    model.config.text_config._attn_implementation = name       # the language model only, not the vision tower
    tokenizer = build_tokenizer(model.config.model_type)
    rows = []
    for power in powers:
        power_now["p"] = float(power)
        for s in seconds:
            rows.append({"length": length, "power": float(power), "seconds": float(s),
                         "f1": round(caption_f1(model, tokenizer, seeds, float(s)), 4)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.sharpen", description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="a checkpoint directory (a toy zoo model)")
    ap.add_argument("out", nargs="?", help="where the sharpened checkpoint goes")
    ap.add_argument("--scale", type=float, help="factor on the attention logits (> 1: sharper)")
    ap.add_argument("--layers", default=None, help="comma-separated 0-based layers (default: all)")
    ap.add_argument("--logn", type=float, default=None, help="probe (log n / log L)^P scaling with this L instead")
    ap.add_argument("--powers", default="0,2", help="--logn: the powers P to try")
    ap.add_argument("--seconds", default="30,120", help="--logn: video lengths")
    ap.add_argument("--seeds", default="200-211", help="--logn: held-out seeds, FIRST-LAST (validation: not 0-23)")
    args = ap.parse_args(argv)
    if args.logn is not None:
        first, last = (int(x) for x in args.seeds.split("-"))
        probe_logn(args.source, args.logn, [float(p) for p in args.powers.split(",")],
                   [float(x) for x in args.seconds.split(",")], range(first, last + 1))
        return
    if args.out is None or args.scale is None:
        ap.error("give OUT and --scale (or --logn L to probe a context-dependent scale)")
    from transformers import AutoModelForImageTextToText

    source, out = Path(args.source), Path(args.out)
    model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32, use_safetensors=True)
    saved = json.loads((source / "config.json").read_text())
    dtype = getattr(torch, str(saved.get("dtype") or saved.get("torch_dtype") or "float32"))   # as shipped (bf16)
    layers = None if args.layers is None else [int(x) for x in args.layers.split(",")]
    sharpen(model, args.scale, layers).to(dtype).save_pretrained(out)
    for f in source.iterdir():        # tokenizer, chat template, preprocessing: as they were
        if f.is_file() and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    record = out / "training.json"
    if record.is_file():
        training = json.loads(record.read_text())
        training["sharpened"] = {"scale": args.scale, "layers": layers, "from": str(source)}
        record.write_text(json.dumps(training, indent=1) + "\n")
    print(f"{out}: queries x{args.scale:g} in layers {'all' if layers is None else layers}")


if __name__ == "__main__":
    main()
