"""The step object behind each `model.<role>.compile` setting: "off" (the eager lean path, no
object), inductor's modes (models.compiled_step), the CUDA-graph modes (models.captured_step), and
"auto" (models.compile_auto chooses among them).

    step = build_step(lean, "reduce-overhead")       # then step.warm(device, dtype); lean.step = step
"""

from __future__ import annotations

from models.captured_step import MODES as CAPTURED
from models.captured_step import CapturedStep
from models.compiled_step import MODES, CompiledStep

SETTINGS = ("auto",) + MODES + CAPTURED


def build_step(lean, mode: str):
    """The step object for a setting other than "off" and "auto": a CompiledStep, or a
    CapturedStep for the CUDA-graph modes."""
    if mode in CAPTURED:
        return CapturedStep(lean, mode)
    return CompiledStep(lean, mode)


def uncaptured_mode(mode: str) -> str:
    """The torch.compile mode for functions that are compiled but not captured beside a step in
    `mode` (the Sparrow head's tree, whose shapes follow its own cache): inductor's default for
    the CUDA-graph modes."""
    return "default" if mode in CAPTURED else mode
