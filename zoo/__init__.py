"""The toy zoo: small Video-LLMs trained here on a procedural video world, since no weights can be
downloaded. The world (`world`, `videos`, `captions`), the tokenizer, the zoo's model shapes
(`shapes`), training (`train`), the model card (`card`), and the shipped `weights/` and `sample/`."""

from pathlib import Path

import models  # noqa: F401  (first: hides a torchvision that cannot load from transformers, which this package uses)

WEIGHTS = Path(__file__).resolve().parent / "weights"   # the shipped checkpoints, one directory each
