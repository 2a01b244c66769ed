"""A checkpoint whose language model attends more sharply: every query scaled by `scale`.

    python -m models.toy.sharpen models/toy/weights/qwen-target /tmp/qwen-x1.3 --scale 1.3
    python -m models.toy.sharpen models/toy/weights/qwen-target /tmp/qwen-top --scale 1.6 --layers 3,4,5
    python -m run -m +experiment=caption_eval model.target.path=/tmp/qwen-x1.3 data.toy.seconds=30,120

Scaling q_proj (weight and bias) by s multiplies every attention logit of those layers by s, i.e.
softmax temperature 1/s, and the result is an ordinary checkpoint. A diagnostic for the toy zoo's
failure on videos 4x longer than it was trained on: with 4x the visual tokens, attention spreads
over more keys (README, "Models and the toy zoo" records what it did). Works for both families.
"""

from __future__ import annotations

import argparse
import json
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m models.toy.sharpen", description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="a checkpoint directory (a toy zoo model)")
    ap.add_argument("out", help="where the sharpened checkpoint goes")
    ap.add_argument("--scale", type=float, required=True, help="factor on the attention logits (> 1: sharper)")
    ap.add_argument("--layers", default=None, help="comma-separated 0-based layers (default: all)")
    args = ap.parse_args(argv)
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
