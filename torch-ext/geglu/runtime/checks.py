"""Input validation shared by every op's real and fake implementations: bad input raises the same error in eager
mode, under torch.compile and on every backend."""

from typing import Optional

import torch

from .._activations import APPROXIMATIONS

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_DTYPE_NAMES = "torch.float32, torch.float16 or torch.bfloat16"


def check_approximate(approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"geglu: approximate={approximate!r} is not supported; expected 'none' (exact erf GELU) "
                         "or 'tanh' (the tanh approximation, transformers' gelu_pytorch_tanh).")


def is_tanh(approximate: str) -> bool:
    """The kernels' flag for a validated ``approximate``: True for the tanh GELU."""
    return approximate == "tanh"


def _check_one(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"geglu: {name} must be a torch.Tensor, got {type(t).__name__}.")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"geglu: {name} has dtype {t.dtype}; expected {_DTYPE_NAMES}. "
                        f"Cast it first, e.g. {name}.to(torch.bfloat16).")
    if t.dim() == 0:
        raise ValueError(f"geglu: {name} is a 0-dim tensor; expected at least one dimension (the feature dim).")
    if t.shape[-1] > 1 and t.stride(-1) != 1 and t.numel() > 0:
        raise ValueError(f"geglu: {name} has stride {t.stride(-1)} in its last dimension; expected 1 (rows may be "
                         f"strided, but the feature dim must be contiguous). Pass {name}.contiguous().")


def _check_same(names: tuple, tensors: tuple) -> None:
    ref_name, ref = names[0], tensors[0]
    for name, t in zip(names[1:], tensors[1:]):
        if t.dtype != ref.dtype:
            raise TypeError(f"geglu: {ref_name} is {ref.dtype} but {name} is {t.dtype}; expected the same dtype.")
        if t.device != ref.device:
            raise ValueError(f"geglu: {ref_name} is on {ref.device} but {name} is on {t.device}; expected one device. "
                             "Move them with .to(device).")
        if t.shape != ref.shape:
            raise ValueError(f"geglu: {ref_name} has shape {tuple(ref.shape)} but {name} has shape {tuple(t.shape)}; "
                             "expected equal shapes.")


_OK_DTYPES = frozenset(SUPPORTED_DTYPES)


def _split_ok(gate, up, approximate, out) -> bool:
    """True for the common valid split call, checked in one pass; False sends it to the detailed checks."""
    dt = gate.dtype
    if approximate not in APPROXIMATIONS or dt not in _OK_DTYPES or up.dtype != dt:
        return False
    shape = gate.shape
    if not shape or up.shape != shape or (shape[-1] > 1 and (gate.stride(-1) != 1 or up.stride(-1) != 1)):
        return False
    device = gate.device
    if up.device != device:
        return False
    if out is not None and (out.dtype != dt or out.shape != shape or out.device != device
                            or (shape[-1] > 1 and out.stride(-1) != 1)):
        return False
    return True


def check_split(gate: torch.Tensor, up: torch.Tensor, approximate: str, out: Optional[torch.Tensor] = None) -> None:
    """gate, up (and out) for the split form: same dtype, device and shape; unit-stride last dim."""
    if (isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor)
            and (out is None or isinstance(out, torch.Tensor)) and _split_ok(gate, up, approximate, out)):
        return
    check_approximate(approximate)
    _check_one("gate", gate)
    _check_one("up", up)
    _check_same(("gate", "up"), (gate, up))
    if out is not None:
        _check_one("out", out)
        _check_same(("gate", "out"), (gate, out))


def check_packed(x: torch.Tensor, approximate: str, out: Optional[torch.Tensor] = None) -> int:
    """x[..., 2d] for the packed forms; returns d."""
    check_approximate(approximate)
    _check_one("x", x)
    two_d = x.shape[-1]
    if two_d % 2:
        raise ValueError(f"geglu: the packed input's last dimension is {two_d}, which is odd; expected 2*d (the "
                         "activated half and the multiplied half side by side).")
    d = two_d // 2
    if out is not None:
        _check_one("out", out)
        expected = tuple(x.shape[:-1]) + (d,)
        if tuple(out.shape) != expected:
            raise ValueError(f"geglu: out has shape {tuple(out.shape)}; expected {expected} (x.shape[:-1] + (d,)).")
        if out.dtype != x.dtype:
            raise TypeError(f"geglu: x is {x.dtype} but out is {out.dtype}; expected the same dtype.")
        if out.device != x.device:
            raise ValueError(f"geglu: x is on {x.device} but out is on {out.device}; expected one device.")
    return d


def check_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, approximate: str) -> None:
    check_split(gate, up, approximate)
    _check_one("grad", grad)
    _check_same(("gate", "grad"), (gate, grad))
