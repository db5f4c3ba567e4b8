"""Fused GeGLU MLP: ``down(gelu(x @ Wg^T, approximate) * (x @ Wu^T))`` with the gate and up projections computed by
one Triton GEMM whose epilogue applies the GeGLU (``_fused_mlp_triton``), then ``down_proj`` by cuBLAS.

Public pieces (``GeGLUMLP`` uses ``inference_forward`` when enabled; see docs/fused-mlp.md):

* ``fused_geglu_mlp_forward(x, w_gate, w_up, w_down=None, approximate="none")``: the MLP (or, without ``w_down``,
  only the GeGLU hidden state ``h``), differentiable in x and every weight; works under torch.compile(fullgraph).
* the op ``geglu_mlp_fused(x, w_gate, w_up, w_down, approximate, save_for_backward, fused_backward=False)
  -> (y, gu, h)`` in the build's namespace (``add_op_namespace_prefix``), with a fake implementation and autograd.
  ``gu`` ([M, 2H], the rounded gate/up pre-activations) and ``h`` (the GeGLU output, kept for dW_down unless
  ``fused_backward``) are written only with ``save_for_backward=True`` (else 0-element tensors); they are
  internal: the backward overwrites ``gu``.
* the op ``geglu_mlp_down_dgeglu_(dy, w_down, gu, approximate, write_h) -> h``: the fused backward step (in place).
* ``use_fused(M, D, H, dtype, device)``: the rule for when the caller should take this path (False until measured).
* ``inference_forward(x, w_gate, w_up, w_down, approximate)``: ``GeGLUMLP``'s inference path (on unless
  ``GEGLU_FUSED_MLP=0`` or ``ENABLED = False``): the fused forward with the fast epilogue where it measured faster
  than cuBLAS + the pointwise kernel for the shape on this device (timed once per shape bucket), else None.

Routing inside the op: the fused Triton kernel runs for fp16/bf16 CUDA tensors with more than ``DECODE_MAX_M`` rows
(and for CPU tensors under the Triton interpreter with the 'triton' backend: the tests); everything else (decode
sizes, fp32, CPU) runs cuBLAS / torch matmuls plus our pointwise GeGLU op, with identical rounding.

Backward:
  default: d_h = dY @ Wd, dWd = dY^T @ h (cuBLAS); [d_g | d_u] written over gu by the in-place packed dGeGLU;
  FUSED_BACKWARD (fused_backward=True): one Triton GEMM dY @ Wd whose epilogue writes [d_g | d_u] over gu and
    recomputes h (d_h never reaches memory; the forward keeps no h), then dWd = dY^T @ h (cuBLAS);
  then dX = d_g @ Wg + d_u @ Wu (one GEMM, then one accumulating GEMM); [dWg; dWu] = [d_g | d_u]^T @ x (one GEMM,
  N=2H).
"""

import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _backend
from . import _custom_ops as _pw
from ._checks import check_approximate, env_switch
from ._ops import add_op_namespace_prefix

# M <= DECODE_MAX_M: cuBLAS + the pointwise kernel (the fused kernel's smallest tile is 64 rows, and decode is bound
# by reading the weights, which both paths do once).
DECODE_MAX_M = 64

# Backward with the dGeGLU fused into the epilogue of dY @ Wd (Triton), which also recomputes h for dW_down, so the
# forward keeps only [g | u] (2E instead of 3E held). Off until measured against cuBLAS + the pointwise kernel.
FUSED_BACKWARD = False

_kernels_mod = None


def _kernels():
    global _kernels_mod
    if _kernels_mod is None:
        from . import _fused_mlp_triton as mod  # imports triton: only when the fused kernel runs

        _kernels_mod = mod
    return _kernels_mod


def use_fused(M: int, D: int, H: int, dtype: torch.dtype, device) -> bool:
    """Whether a GeGLU MLP of this shape should take the fused path. False until device measurements show where
    the fused GEMM holds cuBLAS's rate (it must stay within ~3% at D=4096 to pay off; docs/fused-mlp.md)."""
    return False


# --- validation -----------------------------------------------------------------------------------------------


def _check(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Optional[Tensor], approximate: str) -> None:
    check_approximate(approximate)
    for name, t in (("x", x), ("w_gate", w_gate), ("w_up", w_up)) + ((("w_down", w_down),) if w_down is not None
                                                                        else ()):
        if not isinstance(t, Tensor):
            raise TypeError(f"geglu_mlp_fused: {name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"geglu_mlp_fused: {name} has dtype {t.dtype}; expected float32, float16 or bfloat16.")
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"geglu_mlp_fused: {name} is {t.dtype} on {t.device} but x is {x.dtype} on {x.device}; "
                             "expected one dtype and device.")
    if x.dim() < 1:
        raise ValueError("geglu_mlp_fused: x must have at least one dimension (the feature dim D).")
    if w_gate.dim() != 2 or w_gate.shape != w_up.shape:
        raise ValueError(f"geglu_mlp_fused: w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} must both be "
                         "[H, D] (nn.Linear(D, H).weight).")
    if x.shape[-1] == 0:
        raise ValueError("geglu_mlp_fused: x has D=0 features; expected D >= 1.")
    if w_gate.shape[1] != x.shape[-1]:
        raise ValueError(f"geglu_mlp_fused: x has D={x.shape[-1]} features but the weights are "
                         f"{tuple(w_gate.shape)} ([H, D]).")
    if w_down is not None and (w_down.dim() != 2 or w_down.shape[1] != w_gate.shape[0]):
        raise ValueError(f"geglu_mlp_fused: w_down {tuple(w_down.shape)} must be [D_out, H] with H="
                         f"{w_gate.shape[0]} (nn.Linear(H, D_out).weight).")


def _rows2d(t: Tensor) -> Tensor:
    """[..., n] as 2-D rows with a unit last-dim stride and distinct rows (gradients can arrive expanded, with
    stride 0 along rows or features, which neither TMA nor the in-place kernels accept)."""
    t = t.reshape(-1, t.shape[-1])
    if (t.stride(-1) != 1 and t.shape[-1] > 1) or (t.shape[0] > 1 and t.stride(0) < t.shape[-1]):
        t = t.contiguous()
    return t


def _unit_last(w: Tensor) -> Tensor:
    return w if w.stride(-1) == 1 and w.shape[-1] > 0 else w.contiguous()


# --- forward --------------------------------------------------------------------------------------------------


def _fused_kernel_applies(x2: Tensor) -> bool:
    if x2.dtype not in (torch.float16, torch.bfloat16):
        return False  # fp32: cuBLAS computes full-fp32 GEMMs; Triton's dot would use TF32
    impl = _backend.impl_for(x2.device.type, x2.numel())
    if x2.device.type == "cuda":
        return x2.shape[0] > DECODE_MAX_M
    # CPU: only under the Triton interpreter with the backend forced to 'triton' (tests)
    if impl == "triton":
        return _kernels().INTERPRET and x2.shape[0] > DECODE_MAX_M
    return False


def _gate_up(x2: Tensor, w_gate: Tensor, w_up: Tensor, approximate: str, save: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """h [M, H] and, with ``save``, gu = [g | u] [M, 2H]."""
    if _fused_kernel_applies(x2):
        return _kernels().gate_up_geglu(x2, _unit_last(w_gate), _unit_last(w_up), approximate == "tanh", save)
    # cuBLAS (or CPU matmul) + our pointwise GeGLU: the reference path the fused epilogue reproduces.
    H = w_gate.shape[0]
    if save:
        gu = torch.empty((x2.shape[0], 2 * H), dtype=x2.dtype, device=x2.device)
        gu[:, :H] = x2 @ w_gate.t()
        gu[:, H:] = x2 @ w_up.t()
        g, u = gu[:, :H], gu[:, H:]
    else:
        gu, g, u = None, x2 @ w_gate.t(), x2 @ w_up.t()
    h = torch.empty((x2.shape[0], H), dtype=x2.dtype, device=x2.device)
    _pw._forward_into(h, g, u, approximate)
    return h, gu


_EMPTY = (0,)


@torch.library.custom_op(add_op_namespace_prefix("geglu_mlp_fused"), mutates_args=())
def geglu_mlp_fused(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Optional[Tensor], approximate: str,
                    save_for_backward: bool, fused_backward: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    _check(x, w_gate, w_up, w_down, approximate)
    x2 = _rows2d(x)
    h, gu = _gate_up(x2, w_gate, w_up, approximate, save_for_backward)
    H = w_gate.shape[0]
    # Outputs must not alias one another: a fresh 0-element tensor for each unused one.
    gu_out = gu if save_for_backward else x.new_empty(_EMPTY)
    if w_down is None:
        return h.view(x.shape[:-1] + (H,)), gu_out, x.new_empty(_EMPTY)
    y = h @ w_down.t()
    keep_h = save_for_backward and not fused_backward  # the fused backward recomputes h from [g | u]
    return y.view(x.shape[:-1] + (w_down.shape[0],)), gu_out, (h if keep_h else x.new_empty(_EMPTY))


@geglu_mlp_fused.register_fake
def _(x, w_gate, w_up, w_down, approximate, save_for_backward, fused_backward=False):
    _check(x, w_gate, w_up, w_down, approximate)
    H = w_gate.shape[0]
    M = 1
    for s in x.shape[:-1]:
        M = M * s
    gu = x.new_empty((M, 2 * H)) if save_for_backward else x.new_empty(_EMPTY)
    if w_down is None:
        return x.new_empty(x.shape[:-1] + (H,)), gu, x.new_empty(_EMPTY)
    h = x.new_empty((M, H)) if save_for_backward and not fused_backward else x.new_empty(_EMPTY)
    return x.new_empty(x.shape[:-1] + (w_down.shape[0],)), gu, h


@torch.library.custom_op(add_op_namespace_prefix("geglu_mlp_down_dgeglu_"), mutates_args=("gu",))
def geglu_mlp_down_dgeglu_(dy: Tensor, w_down: Tensor, gu: Tensor, approximate: str, write_h: bool) -> Tensor:
    """Backward of the GeGLU + down projection, in place: gu = [g | u] [M, 2H] becomes [d_g | d_u] for
    d_h = dy @ w_down (dy [M, D_out], w_down [D_out, H]); returns h = geglu(g, u) [M, H] when ``write_h`` (for
    dW_down), else a 0-element tensor. The fused Triton kernel where the forward's would run, else cuBLAS + the
    pointwise backward; the rounding is eager's either way."""
    _check_down_dgeglu(dy, w_down, gu, approximate)
    H = w_down.shape[1]
    if _fused_kernel_applies(dy):
        h = _kernels().down_dgeglu(dy, _unit_last(w_down), gu, approximate == "tanh", write_h)
        return h if write_h else dy.new_empty(_EMPTY)
    g, u = gu[:, :H], gu[:, H:]
    h = dy.new_empty(_EMPTY)
    if write_h:
        h = torch.empty((dy.shape[0], H), dtype=dy.dtype, device=dy.device)
        _pw._forward_into(h, g, u, approximate)  # before g, u are overwritten
    _pw._backward_into(g, u, dy @ w_down, g, u, approximate)
    return h


@geglu_mlp_down_dgeglu_.register_fake
def _(dy, w_down, gu, approximate, write_h):
    _check_down_dgeglu(dy, w_down, gu, approximate)
    return dy.new_empty((dy.shape[0], w_down.shape[1])) if write_h else dy.new_empty(_EMPTY)


def _check_down_dgeglu(dy: Tensor, w_down: Tensor, gu: Tensor, approximate: str) -> None:
    check_approximate(approximate)
    if dy.dim() != 2 or w_down.dim() != 2 or gu.dim() != 2:
        raise ValueError("geglu_mlp_down_dgeglu_: dy [M, D], w_down [D, H] and gu [M, 2H] must be 2-D.")
    if w_down.shape[0] != dy.shape[1] or gu.shape != (dy.shape[0], 2 * w_down.shape[1]):
        raise ValueError(f"geglu_mlp_down_dgeglu_: shapes dy {tuple(dy.shape)}, w_down {tuple(w_down.shape)}, "
                         f"gu {tuple(gu.shape)} do not fit dy [M, D], w_down [D, H], gu [M, 2H].")
    if not (dy.dtype == w_down.dtype == gu.dtype) or not (dy.device == w_down.device == gu.device):
        raise ValueError("geglu_mlp_down_dgeglu_: dy, w_down and gu need one dtype and device.")
    if gu.stride(-1) != 1 or dy.stride(-1) != 1:
        raise ValueError("geglu_mlp_down_dgeglu_: dy and gu need a unit last-dim stride.")


# --- autograd -------------------------------------------------------------------------------------------------


def _setup(ctx, inputs, output):
    x, w_gate, w_up, w_down, approximate, save, fused_backward = inputs
    y, gu, h = output
    if not save:
        raise RuntimeError("geglu_mlp_fused: differentiating needs save_for_backward=True (the forward must keep "
                           "the gate/up pre-activations); fused_geglu_mlp_forward sets it when grad is enabled.")
    ctx.mark_non_differentiable(gu, h)
    ctx.set_materialize_grads(False)  # no zero-filled [M, 2H] gradients for the internal outputs
    ctx.save_for_backward(x, w_gate, w_up, w_down, gu, h)
    ctx.approximate = approximate
    ctx.has_down = w_down is not None
    ctx.fused_backward = fused_backward


def _backward(ctx, dy, _d_gu, _d_h):
    x, w_gate, w_up, w_down, gu, h = ctx.saved_tensors
    need_x, need_wg, need_wu, need_wd = ctx.needs_input_grad[:4]
    if dy is None:
        return None, None, None, None, None, None, None
    H, D = w_gate.shape
    dy2 = _rows2d(dy)
    dx = dwg = dwu = dwd = None
    eager = type(gu) is Tensor  # traced (torch.compile / AOTAutograd: functional or fake tensors) otherwise
    if ctx.has_down and ctx.fused_backward:
        # d_h = dY @ Wd with the dGeGLU in its epilogue: [d_g | d_u] written over gu, h recomputed for dW_down.
        d_gu = gu if eager else gu.clone()  # traced: gu may also be a graph output (see below)
        h_b = geglu_mlp_down_dgeglu_(dy2, w_down, d_gu, ctx.approximate, bool(need_wd))
        if need_wd:
            dwd = dy2.t() @ h_b  # [D_out, H]
        del h_b
    else:
        if ctx.has_down:
            d_h = dy2 @ w_down  # [M, H]
            if need_wd:
                dwd = dy2.t() @ h  # [D_out, H]
        else:
            d_h = dy2
        if eager:
            # [d_g | d_u] over gu, in place (nothing else reads gu): no second [M, 2H] buffer.
            _pw.geglu_packed_backward_(d_h, gu, ctx.approximate, True)
            d_gu = gu
        else:
            # Out of place: gu is also a forward output, which the traced graph may return; the compiler may
            # re-inplace it.
            d_gu = _pw.geglu_packed_backward(d_h, gu, ctx.approximate, True)
        del d_h
    d_g, d_u = d_gu[:, :H], d_gu[:, H:]
    x2 = _rows2d(x)
    if need_x:
        dx2 = d_g @ w_gate
        dx2 = dx2.addmm_(d_u, w_up)
        dx = dx2.view(x.shape)
    if need_wg or need_wu:
        dw = d_gu.t() @ x2  # [2H, D]: dW_gate and dW_up in one GEMM
        dwg, dwu = dw[:H], dw[H:]
    return dx, dwg, dwu, dwd, None, None, None


geglu_mlp_fused.register_autograd(_backward, setup_context=_setup)


# --- public function ------------------------------------------------------------------------------------------


def fused_geglu_mlp_forward(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Optional[Tensor] = None,
                            approximate: str = "none") -> Tensor:
    """``F.linear(gelu(F.linear(x, w_gate), approximate) * F.linear(x, w_up), w_down)`` (or the GeGLU hidden state
    ``h`` when ``w_down`` is None), with the gate/up projections and the GeGLU in one fused GEMM.

    x: [..., D]; w_gate, w_up: [H, D]; w_down: [D_out, H] (nn.Linear weights, no bias); one dtype and device.
    Saves the packed pre-activations for the backward only when a gradient will be needed."""
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w_gate, w_up, w_down))
    y, _, _ = geglu_mlp_fused(x, w_gate, w_up, w_down, approximate, save, FUSED_BACKWARD and w_down is not None)
    return y


# --- GeGLUMLP's inference path ---------------------------------------------------------------------------------
# On by default (GEGLU_FUSED_MLP=0 turns it off): where the fused forward is faster, inference takes it. Its fast
# epilogue is more accurate than eager (error against an fp32 reference below eager bf16's) but not bit-identical to
# it; the path that is (cuBLAS + our pointwise kernel) runs wherever fused is not measured faster. Each (M bucket,
# D, H, dtype, device) is timed once, fused against that path, on the caller's own tensors.

def _enabled(setting: Optional[str]) -> bool:
    """GEGLU_FUSED_MLP: unset or "1" on, "0" off; anything else is a mistake worth naming."""
    return env_switch("GEGLU_FUSED_MLP", setting, True, "use the fused MLP forward where it is faster", "never")


ENABLED = _enabled(os.environ.get("GEGLU_FUSED_MLP"))
_DECISIONS: dict = {}  # (M bucket, D, H, dtype, device) -> bool (fused is faster)
DECISION_TIMES: dict = {}  # the same keys -> {"fused_ms", "regular_ms"}: the medians each decision compared
_MARGIN = 0.99  # fused must be at least 1 % faster: below that, the bit-exact path wins (2 % until the paired
#                 kernel: at 8192x4096x14336 the rule then timed fused 1.7 % faster, do_bench 4.6 %)


def _inference_config(M: int):
    kt = _kernels()
    base = kt.INTERPRETER if kt.INTERPRET else (kt.MEDIUM if M <= 256 else kt.PAIRED_LARGE)
    return base._replace(fast_epi=True)


def _fused_is_faster(fused, regular, rounds: int = 11, record: Optional[dict] = None) -> bool:
    """Times both (after two warm-up calls each: the first compiles the Triton kernel on first use) one call at a
    time, with L2 flushed before each (in a model, the layers between two MLPs evict its weights), in alternating
    rounds, all enqueued before one synchronization (as in a model, the host runs ahead of the GPU, so its launch
    cost is hidden; a synchronization per call would time the fused path's larger host cost instead); compares the
    medians (GEMM timings drift by a few % with the GPU's clocks). This is how the benchmark
    (triton.testing.do_bench) times them. Eleven rounds (~0.1 s once per shape at 8192x4096x14336): with five,
    single-call noise made the benchmark's process choose the regular path at that shape although do_bench has
    fused 4.6 % faster. ``record`` receives the two medians (ms)."""
    for _ in range(2):
        fused()
        regular()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    scratch = torch.empty(2 * max(int(getattr(props, "L2_cache_size", 0)), 64 << 20), dtype=torch.uint8,
                          device="cuda")
    marks = []
    for _ in range(rounds):
        for fn in (fused, regular):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            scratch.zero_()
            start.record()
            fn()
            end.record()
            marks.append((fn, start, end))
    marks[-1][2].synchronize()
    del scratch
    times = {fused: [], regular: []}
    for fn, start, end in marks:
        times[fn].append(start.elapsed_time(end))
    med = {fn: sorted(ts)[len(ts) // 2] for fn, ts in times.items()}
    if record is not None:
        record.update(fused_ms=med[fused], regular_ms=med[regular])
    return med[fused] < _MARGIN * med[regular]


def _regular(x, w_gate, w_up, w_down, approximate):
    h = torch.empty(x.shape[:-1] + (w_gate.shape[0],), dtype=x.dtype, device=x.device)
    _pw._forward_into(h, x @ w_gate.t(), x @ w_up.t(), approximate, True)
    return h @ w_down.t()


def inference_forward(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, approximate: str) -> Optional[Tensor]:
    """The MLP forward through the fused kernel when enabled (the default), in inference (no gradient recorded,
    not under torch.compile), at sizes the fused kernel takes, and measured faster for this shape on this device;
    None when the caller should run its regular path."""
    if not ENABLED or torch.is_grad_enabled() or torch.compiler.is_compiling() or x.dim() < 2:
        return None
    D, H = x.shape[-1], w_gate.shape[0]
    if (w_gate.dim() != 2 or w_gate.shape != w_up.shape or w_gate.shape[1] != D or w_down.dim() != 2
            or w_down.shape[1] != H or not (x.dtype == w_gate.dtype == w_up.dtype == w_down.dtype)):
        return None
    x2 = _rows2d(x)
    if not _fused_kernel_applies(x2):
        return None
    M = x2.shape[0]
    kt = _kernels()
    key = (kt.m_bucket(M), D, H, x.dtype, x.device)
    use = _DECISIONS.get(key)
    if use is None:
        if x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return None  # nothing to time here (decisions for CPU tests are set by hand)
        kt.TUNED[key[:4] + (False,)] = _inference_config(M)
        timing: dict = {}
        with torch.cuda.device(x.device):  # the events, the L2 flush and the kernels on x's GPU
            use = _DECISIONS[key] = _fused_is_faster(
                lambda: fused_geglu_mlp_forward(x, w_gate, w_up, w_down, approximate),
                lambda: _regular(x, w_gate, w_up, w_down, approximate), record=timing)
        DECISION_TIMES[key] = timing
    if not use:
        return None
    kt.TUNED.setdefault(key[:4] + (False,), _inference_config(M))
    return fused_geglu_mlp_forward(x, w_gate, w_up, w_down, approximate)


__all__ = ["fused_geglu_mlp_forward", "geglu_mlp_fused", "geglu_mlp_down_dgeglu_", "use_fused", "DECODE_MAX_M",
           "FUSED_BACKWARD", "inference_forward", "ENABLED"]
