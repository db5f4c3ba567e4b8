"""``GeGLUMLP`` without a gradient: :func:`regular` (eager's GEMMs around the pointwise kernel) or the fused gate/up
GEMM (``mlp.kernels``) where the ``fused_mlp`` setting and :func:`fused_rule` allow it; ``geglu_gate_up_op``, its
gate/up half as an operator that chooses when it runs, is what graphs and tensor subclasses call before their own
down projection (under torch.compile its [..., H] output is a buffer Inductor's memory planning sees).
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
    """:func:`gate_up` (the fused gate/up GEMM where ``fused_mlp`` and :func:`fused_rule` allow it), then
    ``F.linear(h, w_down)``: :func:`regular`'s bits where it does not fuse."""
    return F.linear(gate_up(x, w_gate, w_up, approximate), w_down)


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
    """Under torch.compile without a gradient: whether the graph calls :func:`geglu_gate_up_op` (else the host's ops);
    with dynamic shapes a guard on the symbolic row count."""
    rule = _traced_rule(x.dtype, x.device)
    if rule is None or x.dim() < 2 or w_gate.dim() != 2:
        return False
    H, D = w_gate.shape
    M = x.numel() // max(D, 1)
    return M >= rule[0] and M * D * H >= rule[1]


def fused_forward(x2: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, approximate: str) -> Tensor:
    """x2 [M, D] -> [M, D_out]: the fused gate/up GEMM, then ``h @ w_down^T``."""
    return torch.mm(_fused_gate_up(x2, w_gate, w_up, approximate), w_down.t())


def _fused_gate_up(x2: Tensor, w_gate: Tensor, w_up: Tensor, approximate: str) -> Tensor:
    """x2 [M, D] -> h [M, H] = ``gelu(x2 @ w_gate^T, approximate) * (x2 @ w_up^T)`` by the fused kernel."""
    w_gate, w_up = (w if w.stride(-1) == 1 else w.contiguous() for w in (w_gate, w_up))
    return _kernels().gate_up_geglu(x2.contiguous(), w_gate, w_up, is_tanh(approximate))


def gate_up(x: Tensor, w_gate: Tensor, w_up: Tensor, approximate: str) -> Tensor:
    """x [..., D] -> h [..., H] = ``gelu(x @ w_gate^T, approximate) * (x @ w_up^T)``: the fused kernel where
    ``fused_mlp``, one dtype, [H, D] weights, :func:`fused_kernel_applies` and :func:`fused_rule` allow it (decode
    sizes, host-bound, never), else eager's GEMMs around the pointwise op."""
    D, H = x.shape[-1], w_gate.shape[0]
    if (_config.current.fused_mlp and x.dim() >= 2 and x.numel() > DECODE_MAX_M * D
            and w_gate.shape == w_up.shape == (H, D) and x.dtype == w_gate.dtype == w_up.dtype
            and fused_kernel_applies(x2 := x.reshape(-1, D)) and fused_rule(x2.shape[0], D, H, x.device)):
        return _fused_gate_up(x2, w_gate, w_up, approximate).view(x.shape[:-1] + (H,))
    return _pw.geglu_impl(F.linear(x, w_gate), F.linear(x, w_up), approximate)


def _check(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Optional[Tensor], approximate: str) -> None:
    """TypeError for a non-float dtype; ValueError for a bad ``approximate``, mixed dtypes/devices or shapes
    (``w_down`` None: the gate/up half's arguments only)."""
    check_approximate(approximate)
    named = (("x", x), ("w_gate", w_gate), ("w_up", w_up)) + ((("w_down", w_down),) if w_down is not None else ())
    for name, t in named:
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
    if w_down is not None and (w_down.dim() != 2 or w_down.shape[1] != w_gate.shape[0]):
        raise ValueError(f"geglu_mlp: w_down {tuple(w_down.shape)} must be [D_out, H] with H = {w_gate.shape[0]} "
                         "(nn.Linear(H, D_out).weight).")


@_library.op(add_op_namespace_prefix("geglu_gate_up"))
def geglu_gate_up_op(x: Tensor, w_gate: Tensor, w_up: Tensor, approximate: str) -> Tensor:
    """:func:`gate_up` after :func:`_check`: ``gelu(x @ w_gate^T, approximate) * (x @ w_up^T)``, [..., H]."""
    _check(x, w_gate, w_up, None, approximate)
    return gate_up(x, w_gate, w_up, approximate)


@geglu_gate_up_op.register_fake
def _(x, w_gate, w_up, approximate):
    _check(x, w_gate, w_up, None, approximate)
    return x.new_empty(x.shape[:-1] + (w_gate.shape[0],))
