"""CPU implementation: eager PyTorch's CPU kernels in eager's order, bit-identical to
``F.gelu(gate, approximate=...) * up`` and its autograd on contiguous tensors.

Strided inputs are made contiguous; strided outputs receive a copy. Outputs may alias the inputs exactly
(in-place backward): everything is read before anything is written."""

import torch
import torch.nn.functional as F


def _store(dst: torch.Tensor, value: torch.Tensor) -> None:
    if dst.data_ptr() != value.data_ptr():
        dst.copy_(value)


def geglu_fwd(out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, approximate: str) -> None:
    gate, up = gate.contiguous(), up.contiguous()
    h = F.gelu(gate, approximate=approximate)
    if out.is_contiguous():
        torch.mul(h, up, out=out)
    else:
        _store(out, h * up)


def geglu_bwd(d_gate: torch.Tensor, d_up: torch.Tensor, grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              approximate: str) -> None:
    grad, gate, up = grad.contiguous(), gate.contiguous(), up.contiguous()
    d_h = grad * up
    h = F.gelu(gate, approximate=approximate)
    du = grad * h
    dg = torch.ops.aten.gelu_backward(d_h, gate, approximate=approximate)
    _store(d_up, du)
    _store(d_gate, dg)
