"""CPU implementation: eager PyTorch's own CPU kernels, in eager's order, so results are bit-identical to
`F.gelu(gate, approximate=...) * up` and to its autograd on CPU. Outputs may be strided views (the halves of a
packed gradient) and may alias the inputs exactly (in-place backward)."""

import torch
import torch.nn.functional as F


def geglu_fwd(out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, approximate: str) -> None:
    torch.mul(F.gelu(gate, approximate=approximate), up, out=out)


def geglu_bwd(d_gate: torch.Tensor, d_up: torch.Tensor, grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              approximate: str) -> None:
    # Everything that reads gate/up is computed before d_gate/d_up (which may be gate/up) are written.
    d_h = grad * up
    h = F.gelu(gate, approximate=approximate)
    torch.mul(grad, h, out=d_up)
    torch.ops.aten.gelu_backward.grad_input(d_h, gate, approximate=approximate, grad_input=d_gate)
