"""Where a linear layer's weight lies in memory, for the CPU's small products.

A decode step or a verification multiplies a few rows by every weight matrix. On the CPU, MKL's
product of a few rows with a weight stored as nn.Linear keeps it ([out, in], each output's
inputs together) is up to twice as slow as with the same matrix stored input-major ([in, out]
in memory, seen as its transpose): on one core, [1, 256] × the toy's [768, 256] took 25 µs against
14, [11, 256] 81 against 47; for a prefill's thousand rows the two are the same. So on the CPU the
decoder's weights are re-laid once at load: the parameter keeps its shape [out, in] and its
values, only its strides change (a transposed view of an input-major copy; the old storage is
freed), so every user of the module (the model's own forward, the lean path, training) runs the
same arithmetic on the faster layout.

    input_major(lm.text, lm.lm_head)       # models.load does this for CPU models
"""

from __future__ import annotations

import torch
from torch import nn


def input_major(*modules: nn.Module) -> int:
    """Re-lay the weight of every nn.Linear under `modules` input-major (see the module doc).
    Returns how many were re-laid; one already input-major is left as it is."""
    done = 0
    for module in modules:
        for layer in module.modules():
            if isinstance(layer, nn.Linear) and layer.weight.is_contiguous() and layer.weight.dim() == 2:
                with torch.no_grad():
                    layer.weight.data = layer.weight.data.t().contiguous().t()     # [out, in], strides (1, out)
                done += 1
    return done
