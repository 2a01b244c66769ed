"""graph.wire: messages between processes, with CPU tensors as the bytes of their values."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from graph import wire


@pytest.mark.parametrize("tensor", [
    torch.arange(4),                                        # a proposal's tokens
    torch.randn(3, 5),
    torch.randn(5, 3).t(),                                  # not contiguous
    torch.tensor([True, False]),
    torch.randn(2, dtype=torch.complex64).conj(),           # a conjugate view
    torch.zeros(0, 3),
    torch.tensor(7.5),
    torch.randint(0, 255, (2, 3, 8, 8), dtype=torch.uint8),  # frames
], ids=["int64", "float32", "transposed", "bool", "conj", "empty", "scalar", "uint8"])
def test_plain_cpu_tensors_travel_as_their_values(tensor):
    data = wire.dumps({"tokens": tensor, "round": 3})
    assert b"_tensor_from_array" in data and b"_rebuild_tensor" not in data     # not torch's own pickling
    back = wire.loads(data)
    assert back["round"] == 3 and back["tokens"].dtype == tensor.dtype and back["tokens"].shape == tensor.shape
    assert torch.equal(back["tokens"], tensor)


def test_the_copy_is_writable_and_its_own():
    sent = torch.arange(4)
    back = wire.loads(wire.dumps(sent))
    back += 1
    assert back.tolist() == [1, 2, 3, 4] and sent.tolist() == [0, 1, 2, 3]


def test_inference_tensors_arrive_as_ordinary_ones():
    with torch.inference_mode():
        made = torch.arange(3) * 2
    back = wire.loads(wire.dumps(made))
    assert not back.is_inference() and back.tolist() == [0, 2, 4]


@pytest.mark.parametrize("tensor", [torch.randn(3, dtype=torch.bfloat16), torch.nn.Parameter(torch.randn(2)),
                                    torch.randn(2, requires_grad=True)], ids=["bfloat16", "parameter", "grad"])
def test_other_tensors_keep_torchs_pickling(tensor):
    back = wire.loads(wire.dumps(tensor))
    assert type(back) is type(tensor) and back.dtype == tensor.dtype
    assert back.requires_grad == tensor.requires_grad and torch.equal(back.detach(), tensor.detach())


def test_importing_it_does_not_import_torch():
    """A worker process unpickles its entry point before it pins its cores and starts torch."""
    code = "import sys, graph.wire as w; w.loads(w.dumps([1, 'a'])); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
