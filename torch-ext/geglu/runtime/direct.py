"""The compiled CUDA library's C entry points (``geglu_c_fwd`` / ``geglu_c_bwd``) through ctypes: how the pointwise
op's implementation launches the library's kernels without a second trip through the dispatcher. ``AVAILABLE`` is
False without a compiled library or its entry points. Every function expects tensors validated as for the ops
(``runtime.checks``)."""

import ctypes
import glob
import os

import torch

from . import config as _config
from .._ops import HAS_CUDA_LIB

DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the C entry points' dtype codes
_ELEMENT_SIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def _find_entry_points():
    """(fwd, bwd, error string, plan setter or None) of the already-loaded library (RTLD_NOLOAD) in the package
    folder that exports the C entry points, or None."""
    if not HAS_CUDA_LIB or not hasattr(os, "RTLD_NOLOAD"):
        return None
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package's root folder
    for path in sorted(glob.glob(os.path.join(here, "*.so"))):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            fwd, bwd, err = lib.geglu_c_fwd, lib.geglu_c_bwd, lib.geglu_c_error_string
        except (OSError, AttributeError):
            continue
        fwd.argtypes = [_int, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _int, _int, _ptr]
        bwd.argtypes = [_int, _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _int, _int, _ptr]
        fwd.restype = bwd.restype = _int
        err.argtypes, err.restype = [_int], ctypes.c_char_p
        plan = getattr(lib, "geglu_c_set_plan", None)
        if plan is not None:
            plan.argtypes, plan.restype = [_int, _int, _int], _int
        return fwd, bwd, err, plan
    return None


_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only torch builds
_ENTRY = _find_entry_points() if _stream is not None else None
AVAILABLE = _ENTRY is not None
_fwd, _bwd, _err, set_plan = _ENTRY if AVAILABLE else (None, None, None, None)
_config.set_plan_hook(set_plan)  # configure(cuda_plan=...) hands plans to it
if set_plan is not None and _config.current.cuda_plan:  # GEGLU_CUDA_PLAN, read once with the other settings
    set_plan(*_config.plan_args(_config.current.cuda_plan))


def _row_stride(t: torch.Tensor, rows: int, cols: int) -> int:
    return t.stride(0) if rows > 1 else cols


def _extent(t: torch.Tensor, rows: int, cols: int, stride: int):
    start = t.data_ptr()
    return start, start + ((rows - 1) * stride + cols) * _ELEMENT_SIZE[t.dtype]


def _safe_output(out: torch.Tensor, rows: int, cols: int, inputs, others=()) -> bool:
    """Whether the kernels may write ``out``: its rows do not overlap, each input is exactly ``out`` (same data and
    row stride) or disjoint from it, and ``others`` are disjoint from it."""
    s = _row_stride(out, rows, cols)
    if rows > 1 and s < cols:
        return False
    o0, o1 = _extent(out, rows, cols, s)
    for t in inputs:
        ts = _row_stride(t, rows, cols)
        if t.data_ptr() == o0 and (rows <= 1 or ts == s):
            continue
        t0, t1 = _extent(t, rows, cols, ts)
        if t0 < o1 and o0 < t1:
            return False
    for t in others:
        t0, t1 = _extent(t, rows, cols, _row_stride(t, rows, cols))
        if t0 < o1 and o0 < t1:
            return False
    return True


def _raise(status: int, op: str) -> None:
    raise RuntimeError(f"{op}: CUDA kernel launch failed: {_err(status).decode()}")


def fwd(out2: torch.Tensor, g2: torch.Tensor, u2: torch.Tensor, tanh: bool, fresh_out: bool) -> bool:
    """Launch the forward on 2-D row views; False (nothing launched) when the caller must use the op instead.
    ``fresh_out``: out2 is newly allocated (no overlap check)."""
    rows, cols = g2.shape
    if not fresh_out and not _safe_output(out2, rows, cols, (g2, u2)):
        return False
    device = g2.get_device()
    status = _fwd(DTYPES[g2.dtype], out2.data_ptr(), _row_stride(out2, rows, cols), g2.data_ptr(),
                  _row_stride(g2, rows, cols), u2.data_ptr(), _row_stride(u2, rows, cols), rows, cols, tanh, device,
                  _stream(device))
    if status:
        _raise(status, "geglu_fwd")
    return True


def bwd(dg2: torch.Tensor, du2: torch.Tensor, dy2: torch.Tensor, g2: torch.Tensor, u2: torch.Tensor,
        tanh: bool) -> bool:
    """Launch the backward on 2-D row views (d_gate/d_up freshly allocated, or exactly gate/up); False when the
    caller must use the op instead."""
    rows, cols = g2.shape
    if not (_safe_output(dg2, rows, cols, (dy2, g2, u2), (du2,)) and _safe_output(du2, rows, cols, (dy2, g2, u2))):
        return False
    device = g2.get_device()
    status = _bwd(DTYPES[g2.dtype], dg2.data_ptr(), _row_stride(dg2, rows, cols), du2.data_ptr(),
                  _row_stride(du2, rows, cols), dy2.data_ptr(), _row_stride(dy2, rows, cols), g2.data_ptr(),
                  _row_stride(g2, rows, cols), u2.data_ptr(), _row_stride(u2, rows, cols), rows, cols, tanh, device,
                  _stream(device))
    if status:
        _raise(status, "geglu_bwd")
    return True


def flat_fwd(gate: torch.Tensor, up: torch.Tensor, tanh: bool) -> torch.Tensor:
    """``gelu(gate) * up`` of contiguous, validated CUDA tensors (numel > 0) in a new tensor: one launch on the flat
    elements, nothing else checked."""
    n = gate.numel()
    out = torch.empty_like(gate)
    device = gate.get_device()
    status = _fwd(DTYPES[gate.dtype], out.data_ptr(), n, gate.data_ptr(), n, up.data_ptr(), n, 1, n, tanh, device,
                  _stream(device))
    if status:
        _raise(status, "geglu_fwd")
    return out


def flat_bwd(d_gate: torch.Tensor, d_up: torch.Tensor, grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
             tanh: bool) -> None:
    """The backward of contiguous, validated CUDA tensors (numel > 0) on the flat elements: d_gate / d_up fresh, or
    exactly gate / up when the two do not overlap."""
    n = gate.numel()
    device = gate.get_device()
    status = _bwd(DTYPES[gate.dtype], d_gate.data_ptr(), n, d_up.data_ptr(), n, grad.data_ptr(), n, gate.data_ptr(),
                  n, up.data_ptr(), n, 1, n, tanh, device, _stream(device))
    if status:
        _raise(status, "geglu_bwd")
