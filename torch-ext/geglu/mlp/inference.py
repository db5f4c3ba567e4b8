"""``GeGLUMLP`` without a gradient: :func:`regular` (eager's GEMMs around the pointwise kernel) or the fused gate/up
GEMM (``mlp.kernels``) where the ``fused_mlp`` setting and :func:`fused_rule` allow it; ``geglu_mlp_op``, the same
as an operator, chooses when it runs.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..pointwise import ops as _pw
from ..runtime import backend as _backend
from ..runtime import config as _config
from ..runtime import library as _library
from .._ops import add_op_namespace_prefix
from ..runtime.checks import check_approximate, is_tanh

# M <= DECODE_MAX_M rows take `regular` (the fused kernel's smallest tile is 64 rows)
DECODE_MAX_M = 64
_LOW = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_kernels = _backend.lazy_module(".kernels", __package__)  # imports triton: only when a fused kernel may run


def fused_kernel_applies(x2: Tensor) -> bool:
    """Whether the fused kernel takes these 2-D rows: fp16/bf16, more than ``DECODE_MAX_M`` rows, on CUDA or
    (tests) on CPU under the Triton interpreter with the 'triton' backend."""
    if x2.dtype not in _LOW or x2.shape[0] <= DECODE_MAX_M:
        return False
    dev = x2.device.type
    if dev != "cuda" and (dev != "cpu" or _config.current.backend != "triton"):
        return False
    try:
        kt = _kernels()
    except ImportError:  # no triton
        return False
    return dev == "cuda" or kt.INTERPRET


def regular(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, approximate: str) -> Tensor:
    """The bit-exact path: eager's GEMMs around the pointwise op's implementation."""
    return F.linear(_pw.geglu_impl(F.linear(x, w_gate), F.linear(x, w_up), approximate), w_down)


def inference(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, approximate: str) -> Tensor:
    """The fused gate/up GEMM where ``fused_mlp`` and :func:`fused_rule` allow it, else :func:`regular`."""
    y = _fused_inference(x, w_gate, w_up, w_down, approximate) if _config.current.fused_mlp else None
    return y if y is not None else regular(x, w_gate, w_up, w_down, approximate)


# per capability major, measured ahead of time: least rows and M*D*H of the fused path, least M*D*H to trace the op
FUSED_RULES = {9: dict(min_m=1024, min_work=12e9, compiled_min_work=40e9)}


def fused_rule(M: int, D: int, H: int, device: torch.device) -> bool:
    """Whether the fused path runs for M rows of an MLP [D -> H]: the shipped rule (False where none; True off CUDA)."""
    return _backend.shipped_rule(FUSED_RULES, device, min_m=M, min_work=M * D * H)


@torch.compiler.assume_constant_result
def _traced_rule(dtype: torch.dtype, device: torch.device) -> Optional[Tuple[int, float]]:
    """(least rows, least M * D * H) from which a compiled graph calls the op, or None; read once per trace."""
    if not _config.current.fused_mlp or dtype not in _LOW:
        return None
    if device.type == "cuda":
        rule = FUSED_RULES.get(_backend.capability_major(device))
        if rule is None:
            return None
        return max(rule["min_m"], DECODE_MAX_M + 1), max(rule["min_work"], rule.get("compiled_min_work", 0.0))
    if device.type == "cpu" and _config.current.backend == "triton":  # the Triton interpreter (tests)
        try:
            return (DECODE_MAX_M + 1, 0.0) if _kernels().INTERPRET else None
        except ImportError:
            return None
    return None


def traced_op(x: Tensor, w_gate: Tensor) -> bool:
    """Under torch.compile without a gradient: whether the graph calls :func:`geglu_mlp_op` (else the host's ops);
    with dynamic shapes a guard on the symbolic row count."""
    rule = _traced_rule(x.dtype, x.device)
    if rule is None or x.dim() < 2 or w_gate.dim() != 2:
        return False
    H, D = w_gate.shape
    M = x.numel() // max(D, 1)
    return M >= rule[0] and M * D * H >= rule[1]


def _fused_inference(x, w_gate, w_up, w_down, approximate) -> Optional[Tensor]:
    D = x.shape[-1]
    if x.dim() < 2 or x.numel() <= DECODE_MAX_M * D:
        return None  # decode sizes first: they are host-bound
    H = w_gate.shape[0]
    if not (w_gate.shape == w_up.shape == (H, D) and w_down.dim() == 2 and w_down.shape[1] == H
            and x.dtype == w_gate.dtype == w_up.dtype == w_down.dtype):
        return None
    x2 = x.reshape(-1, D)
    if not fused_kernel_applies(x2) or not fused_rule(x2.shape[0], D, H, x.device):
        return None
    return fused_forward(x2, w_gate, w_up, w_down, approximate).view(x.shape[:-1] + (w_down.shape[0],))


def fused_forward(x2: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, approximate: str) -> Tensor:
    """x2 [M, D] -> [M, D_out]: the fused gate/up GEMM, then ``h @ w_down^T``."""
    h = _kernels().gate_up_geglu(x2.contiguous(), _unit_last(w_gate), _unit_last(w_up), is_tanh(approximate))
    return torch.mm(h, w_down.t())


def _unit_last(w: Tensor) -> Tensor:
    return w if w.stride(-1) == 1 else w.contiguous()


def _check(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, approximate: str) -> None:
    """TypeError for a non-float dtype; ValueError for a bad ``approximate``, mixed dtypes/devices or shapes."""
    check_approximate(approximate)
    for name, t in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if t.dtype not in _FLOATS:
            raise TypeError(f"geglu_mlp: {name} has dtype {t.dtype}; expected float32, float16 or bfloat16.")
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"geglu_mlp: {name} is {t.dtype} on {t.device} but x is {x.dtype} on {x.device}; "
                             "expected one dtype and device.")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"geglu_mlp: x has shape {tuple(x.shape)}; expected [..., D] with D >= 1.")
    if w_gate.dim() != 2 or w_gate.shape != w_up.shape or w_gate.shape[1] != x.shape[-1]:
        raise ValueError(f"geglu_mlp: w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} must both be [H, D] "
                         f"(nn.Linear(D, H).weight) with D = {x.shape[-1]}, x's last dim.")
    if w_down.dim() != 2 or w_down.shape[1] != w_gate.shape[0]:
        raise ValueError(f"geglu_mlp: w_down {tuple(w_down.shape)} must be [D_out, H] with H = {w_gate.shape[0]} "
                         "(nn.Linear(H, D_out).weight).")


@_library.op(add_op_namespace_prefix("geglu_mlp"))
def geglu_mlp_op(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, approximate: str) -> Tensor:
    """:func:`inference` after :func:`_check`; the fused path is chosen when the op runs."""
    _check(x, w_gate, w_up, w_down, approximate)
    return inference(x, w_gate, w_up, w_down, approximate)


@geglu_mlp_op.register_fake
def _(x, w_gate, w_up, w_down, approximate):
    _check(x, w_gate, w_up, w_down, approximate)
    return x.new_empty(x.shape[:-1] + (w_down.shape[0],))
