"""``GeGLUMLP`` without a gradient: eager's GEMMs around the pointwise kernel, or the fused gate/up GEMM (the GeGLU
in its epilogue, ``mlp.kernels``) where the ``fused_mlp`` setting allows it and the shipped rule (:func:`fused_rule`)
says it is faster for the shape on the device; and ``geglu_mlp_op``, the same computation as an operator for
torch.compile, tracing and tensor subclasses (the choice is made inside the op when it runs, so a traced graph has no
shape guards of its own).
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..pointwise import ops as _pw
from ..runtime import backend as _backend
from ..runtime import config as _config
from ..runtime import direct as _direct
from ..runtime import library as _library
from .._ops import add_op_namespace_prefix
from ..runtime.checks import check_approximate, is_tanh

# M <= DECODE_MAX_M rows: cuBLAS + the pointwise kernel (the fused kernel's smallest tile is 64 rows, and decode is
# bound by reading the weights, which both paths do once).
DECODE_MAX_M = 64
_LOW = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# the fused gate/up GEMM's module (imports triton: only when a fused kernel may run)
_kernels = _backend.lazy_module(".kernels", __package__)


def fused_kernel_applies(x2: Tensor) -> bool:
    """Whether the fused gate/up kernel can take these 2-D rows: fp16/bf16 and more than ``DECODE_MAX_M`` rows, on a
    CUDA device (TMA descriptors where the device and strides allow, pointer loads otherwise), or (tests) CPU
    tensors under the Triton interpreter with the backend set to 'triton'."""
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



# --- inference -----------------------------------------------------------------------------------------------------


_lean_fwd = _direct.lean_fwd if _direct.AVAILABLE else None


def regular(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, approximate: str) -> Tensor:
    """The bit-exact inference path: eager's GEMMs and our pointwise kernel (at decode sizes through the compiled
    library's C entry, as ``functional.geglu`` calls it: the same kernel for a few µs less host time; the op's
    dispatch otherwise)."""
    g, u = F.linear(x, w_gate), F.linear(x, w_up)
    h = _lean_fwd(g, u, approximate) if _lean_fwd is not None else None
    if h is None:
        h = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        _pw.forward_into(h, g, u, approximate, True)
    return F.linear(h, w_down)


def inference(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, approximate: str) -> Tensor:
    """The MLP forward without a gradient: the fused gate/up GEMM where the ``fused_mlp`` setting allows it and
    :func:`fused_rule` says it is faster for this shape on this device, else :func:`regular`."""
    y = _fused_inference(x, w_gate, w_up, w_down, approximate) if _config.current.fused_mlp else None
    return y if y is not None else regular(x, w_gate, w_up, w_down, approximate)


# Where the fused gate/up GEMM beats cuBLAS + the pointwise kernel, decided from the shape alone (nothing is timed
# at run time): per compute capability major, the fewest rows, and the least GEMM work (M * D * H) at which it
# runs. Measured by `python -m kerneltools.bench.fused_rule` (docs/fused-mlp.md, "The shipped rule"): on the GPU
# the fused path is faster from 1024 rows at every width of the supported models (below that the wide ones lose);
# launched from Python it costs the host about 90 us more than the regular path, which a call of less work than
# min_work (~0.1 ms of GEMM) does not hide. Inside a compiled graph the rest of the forward costs the host little, so
# the op's own host cost shows unless its GPU work covers it: `compiled_min_work` (measured with
# `kerneltools bench --parts serve`, docs/fused-mlp.md) is the least M * D * H at which a compiled graph calls it.
FUSED_RULES = {9: dict(min_m=1024, min_work=12e9, compiled_min_work=40e9)}


def fused_rule(M: int, D: int, H: int, device: torch.device) -> bool:
    """Whether the fused path runs for M rows of an MLP [D -> H]: the shipped rule for the device's architecture
    (False on one it has none for); on CPU tensors (the Triton interpreter, tests) always."""
    return _backend.shipped_rule(FUSED_RULES, device, min_m=M, min_work=M * D * H)


@torch.compiler.assume_constant_result
def _traced_rule(dtype: torch.dtype, device: torch.device) -> Optional[Tuple[int, float]]:
    """(least rows, least M * D * H) from which a compiled graph calls the inference op for tensors of this dtype on
    this device (the shipped rule with its ``compiled_min_work``), or None where it never does. Under torch.compile
    this is read once, when a graph is traced (no guard): a later change of the ``fused_mlp`` or ``backend`` setting
    holds for graphs traced after it."""
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
    """Under torch.compile, without a gradient: whether the graph calls :func:`geglu_mlp_op`, because the fused
    gate/up GEMM may run for x's rows (the ``fused_mlp`` setting, fp16/bf16, a device with a shipped rule, rows and
    work at or above it). Elsewhere the op would run eager's GEMMs around the pointwise kernel, which Inductor does
    itself from the host's ops (the same GPU work, fused with the neighbours) for less host time per call. With
    dynamic shapes the comparison is a guard on the symbolic row count: each graph serves the lengths on one side of
    the rule."""
    rule = _traced_rule(x.dtype, x.device)
    if rule is None or x.dim() < 2 or w_gate.dim() != 2:
        return False
    H, D = w_gate.shape
    M = x.numel() // max(D, 1)
    return M >= rule[0] and M * D * H >= rule[1]


def _fused_inference(x, w_gate, w_up, w_down, approximate) -> Optional[Tensor]:
    D = x.shape[-1]
    if x.dim() < 2 or x.numel() <= DECODE_MAX_M * D:
        return None  # decode sizes return here, before any other check: they are host-bound
    H = w_gate.shape[0]
    if not (w_gate.shape == w_up.shape == (H, D) and w_down.dim() == 2 and w_down.shape[1] == H
            and x.dtype == w_gate.dtype == w_up.dtype == w_down.dtype):
        return None
    x2 = x.reshape(-1, D)
    if not fused_kernel_applies(x2) or not fused_rule(x2.shape[0], D, H, x.device):
        return None
    return fused_forward(x2, w_gate, w_up, w_down, approximate).view(x.shape[:-1] + (w_down.shape[0],))


def fused_forward(x2: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, approximate: str) -> Tensor:
    h = _kernels().gate_up_geglu(x2.contiguous(), _unit_last(w_gate), _unit_last(w_up), is_tanh(approximate))
    return torch.mm(h, w_down.t())


def _unit_last(w: Tensor) -> Tensor:
    return w if w.stride(-1) == 1 else w.contiguous()


# --- the operator -----------------------------------------------------------------------------------------------------


def _check(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, approximate: str) -> None:
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
    """The MLP forward without a gradient (:func:`inference`: the fused path's choice is made here, at run time)."""
    _check(x, w_gate, w_up, w_down, approximate)
    return inference(x, w_gate, w_up, w_down, approximate)


@geglu_mlp_op.register_fake
def _(x, w_gate, w_up, w_down, approximate):
    _check(x, w_gate, w_up, w_down, approximate)
    return x.new_empty(x.shape[:-1] + (w_down.shape[0],))


def _rows(x: Tensor) -> int:
    n = 1
    for s in x.shape[:-1]:
        n = n * s
    return n


__all__ = ["inference", "regular", "fused_rule", "fused_kernel_applies", "geglu_mlp_op", "traced_op", "DECODE_MAX_M", "FUSED_RULES"]
