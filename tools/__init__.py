"""Analysis tools over the toy zoo's models and videos (`python -m tools.NAME`)."""

import models  # noqa: F401  (first: hides a torchvision that cannot load from transformers, which this package uses)
