"""``GeGLUMLP``'s training step as one autograd node: ``y = down(gelu(x @ Wg^T) * (x @ Wu^T))`` with eager's own
GEMM calls and our bit-exact pointwise kernels, and a backward that reuses the activations' memory.

Why one node (docs/fused-mlp.md, "Training"):

* **Same bits as eager.** The forward calls ``torch.mm`` exactly as ``F.linear`` does (2-D rows, ``W.t()``), the
  GeGLU kernel equals ``F.gelu(g) * u`` bit for bit, and the backward makes the GEMM calls autograd's
  ``MmBackward`` makes (``dy @ W`` for the input, ``dy^T @ input`` for the weight) and sums x's two gradients with
  one add, as autograd does; our dGeGLU kernel has eager's rounding. So output and every gradient equal eager's
  (unless the opt-in fused kernels, FUSED_FORWARD / FUSED_BACKWARD below, are switched on).
* **Less memory.** Eager holds g, gelu(g), u and h until the backward, and its down projection's backward
  allocates d_h while g, u and h are alive (4 [M, H] buffers; Liger's GEGLU MLP too). Here the forward holds g, u and
  h; the backward computes dW_down first, then writes d_h over h (which nothing needs any more), then d_g, d_u over
  g, u, and frees each buffer as soon as its last GEMM has read it: at most 3 [M, H] buffers live.
* **Where.** Large CUDA steps and CPU. Below ``_backend.AUTOGRAD_EAGER_BELOW`` [M, H] elements under the 'auto'
  backend, CUDA steps are host-bound and this Python node costs the host more than eager's C++ nodes (measured on
  the H200's host at M=16: ~20 % slower although it issues fewer calls), so the caller runs eager's ops there.

The activations are kept as attributes of the node (so that the backward can free them one by one) unless
saved-tensor hooks are active (activation checkpointing, CPU offloading, ...): then they go through
``save_for_backward`` as usual, and the hooks see them. Either way the backward overwrites what it unpacks, so the
node cannot run backward twice (``retain_graph=True``): that raises an error that says so.

Used only for plain eager tensors (not under torch.compile, tracing, functorch transforms or autocast); the caller
keeps its regular path otherwise.
"""

import contextlib
import os
from typing import Optional

import torch
from torch import Tensor

from . import _backend
from . import _custom_ops as _pw
from ._checks import env_switch

# The fused kernels in the training step, opt-in. FUSED_FORWARD: the gate/up GEMM with the GeGLU in its epilogue,
# writing g, u and h (`_fused_mlp_triton.gate_up_geglu`, TRAIN_FWD_CONFIG). FUSED_BACKWARD: dY @ Wd with the dGeGLU
# in its epilogue, writing d_g, d_u over g, u, so d_h never reaches memory: True, the Triton kernel
# (`down_dgeglu_into`, TRAIN_BWD_CONFIG); "gluon", the warp-specialised Gluon kernel (`_gluon_bwd.down_dgeglu_ws`, the
# Triton kernel's bits) where it runs (sm_90, a Triton with Gluon, TMA-aligned tensors), else the Triton kernel;
# "gluon-fast", the same with its fast tanh dGeGLU (fp32 math with hardware approximations, one rounding per output;
# with the erf GELU as "gluon").
# They apply only to fp16/bf16 CUDA steps the Triton kernels take (sm_90+ with TMA, more than DECODE_MAX_M rows; or
# the Triton interpreter in tests), and none is eager's bits (error against fp32 no worse than eager's:
# tests/kernel/test_fused_mlp.py). Off by default: on the H200 (benchmarks/results/h200/bwd-probe.txt) the Triton
# backward is slower than cuBLAS + our dGeGLU; the Gluon one is 9-13 % faster at 8192x2304x9216 and 3-4 % at
# 8192x4096x14336. With it, the fused forward and SAVE_DERIVATIVE or ACCUMULATE_DX below, the step is 2.6-3.7 %
# faster than torch.compile's at 8192x2304x9216 and 1-2 % at 8192x4096x14336 (median per-round ratios; the default
# node: level with it), gains within about one rounds' spread that cost eager's bits (docs/fused-mlp.md).
FUSED_FORWARD = False
FUSED_BACKWARD = False  # False, True (Triton), "gluon" or "gluon-fast"
TRAIN_FWD_CONFIG = None  # None: the kernel module's choice for the shape
TRAIN_BWD_CONFIG = None
# ACCUMULATE_DX, opt-in (read when the forward runs, as the other flags): dx = d_g @ Wg, then d_u @ Wu accumulated
# into it by the second GEMM (addmm_) instead of a second [M, D] output and a bf16 add (one kernel and one buffer
# fewer; on the CPU also one rounding fewer, while on the H200 cuBLAS gave the same bits); and where d_g, d_u are the
# halves of one [M, 2H] buffer (the fused forward), dW_gate and dW_up as one GEMM with N = 2H. Not guaranteed to be
# eager's bits, no less accurate.
ACCUMULATE_DX = False
# SAVE_DERIVATIVE, opt-in, with FUSED_FORWARD and the Gluon backward (FUSED_BACKWARD "gluon"/"gluon-fast" where it
# runs; otherwise ignored): the forward's epilogue saves gelu(g) and u * gelu'(g) (from its fp32 accumulators, each
# rounded once) instead of g and u, so the backward's dGeGLU is two products, d_up = d_h * gelu(g) and
# d_gate = d_h * (u * gelu'(g)), in the Gluon kernel's epilogue (or, for TMA-unaligned dY, after cuBLAS's d_h). The
# math moves to the forward's epilogue, where the sigmoid is already in registers (no slower there), out of the Gluon
# backward, where it slows the other warpgroup's main loop (93 % of cuBLAS's dY @ Wd instead of 88 %). Not eager's
# bits; more accurate (docs/fused-mlp.md).
SAVE_DERIVATIVE = False


def _switch(setting: Optional[str]) -> bool:
    """GEGLU_FUSED_TRAINING: unset or "0" off, "1" on; anything else is a mistake worth naming."""
    return env_switch("GEGLU_FUSED_TRAINING", setting, False, "GeGLUMLP's training step with the fused kernels where "
                      "the Gluon backward runs", "eager's bits")


# FUSED_TRAINING (GEGLU_FUSED_TRAINING=1), opt-in: one switch for the fastest measured combination, where it runs.
# Where the Gluon backward runs (sm_90, a Triton with Gluon) the step takes FUSED_FORWARD, FUSED_BACKWARD = "gluon",
# SAVE_DERIVATIVE and ACCUMULATE_DX, whatever those four say; elsewhere the four flags as they are (by default the
# node with eager's bits: there the Triton fused backward is slower than cuBLAS + our dGeGLU). On the H200 the step
# is then 2.6-3.7 % faster than torch.compile's at 8192x2304x9216 and 1-2 % at 8192x4096x14336 (bwd-probe.txt runs
# 10-12), with gradients more accurate than eager's against fp32 (not eager's bits).
FUSED_TRAINING = _switch(os.environ.get("GEGLU_FUSED_TRAINING"))


def _settings(dev: torch.device):
    """(FUSED_FORWARD, FUSED_BACKWARD, SAVE_DERIVATIVE, ACCUMULATE_DX) for a step on ``dev``."""
    if FUSED_TRAINING and _gluon_backward(dev) is not None:
        return True, "gluon", True, True
    return FUSED_FORWARD, FUSED_BACKWARD, SAVE_DERIVATIVE, ACCUMULATE_DX

_PLAIN = (Tensor, torch.nn.Parameter)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_is_compiling = torch.compiler.is_compiling
_is_tracing = torch._C._is_tracing
_functorch_active = torch._C._are_functorch_transforms_active
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _hooks_active() -> bool:
    """Saved-tensor hooks (checkpointing, offloading) in force: they must see the activations."""
    return _top_hooks is None or _top_hooks(False) is not None


def host_bound(x: Tensor, w_gate: Tensor) -> bool:
    """A small CUDA step under the 'auto' backend (fewer than ``_backend.AUTOGRAD_EAGER_BELOW`` [M, H] elements):
    host-bound, and a Python autograd node costs the host more than eager's C++ ones (the H200's host, M=16:
    benchmarks/results/h200/mlp-small-m-node.txt), so the caller runs eager's own ops there."""
    return x.is_cuda and _backend.eager_autograd(x.numel() // max(x.shape[-1], 1) * w_gate.shape[0])


def applies(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> bool:
    """Whether the training step can run as one node here: a gradient to record, plain eager CUDA/CPU tensors of one
    float dtype and device, nn.Linear-shaped weights ([H, D], [H, D], [D_out, H]), no autocast."""
    if not torch.is_grad_enabled() or _is_compiling() or _is_tracing() or _functorch_active():
        return False
    if not (type(x) in _PLAIN and type(w_gate) in _PLAIN and type(w_up) in _PLAIN and type(w_down) in _PLAIN):
        return False
    if x.dim() < 2 or w_gate.dim() != 2 or host_bound(x, w_gate):
        return False
    if not (x.requires_grad or w_gate.requires_grad or w_up.requires_grad or w_down.requires_grad):
        return False
    dev = x.device
    if dev.type not in ("cuda", "cpu") or x.dtype not in _FLOATS or torch.is_autocast_enabled(dev.type):
        return False
    for w in (w_gate, w_up, w_down):
        if w.dtype != x.dtype or w.device != dev or w.dim() != 2:
            return False
    H, D = w_gate.shape
    return w_up.shape == w_gate.shape and D == x.shape[-1] and w_down.shape[1] == H and H > 0 and D > 0


def _fused_kernels(x2: Tensor):
    """The fused-MLP kernel module if its Triton kernels take this step (fp16/bf16, enough rows, TMA), else None."""
    from . import _fused_mlp as fm

    try:
        if not fm._fused_kernel_applies(x2):
            return None
        kt = fm._kernels()
    except ImportError:  # no triton
        return None
    return kt if kt.tma_supported(x2.device) else None


def _gluon_backward(dev: torch.device):
    """The Gluon backward kernel's module where it runs (sm_90 and a Triton with Gluon), else None."""
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] != 9:
        return None
    try:
        from . import _gluon_bwd
    except ImportError:  # a Triton without Gluon
        return None
    return _gluon_bwd


def _fused_backward(kt, dev: torch.device, mode, deriv: bool):
    """The backward's `dY @ Wd` + dGeGLU kernel for FUSED_BACKWARD = ``mode`` as fn(dy, w_down, g, u, tanh) -> bool,
    writing d_g, d_u over g, u; False where it did not run (with ``deriv``, g, u holding the forward's derivative
    factors, only the Gluon kernel has that epilogue: elsewhere the caller takes cuBLAS and two products)."""
    if mode not in (True, "gluon", "gluon-fast"):
        raise ValueError(f"geglu._mlp.FUSED_BACKWARD is {mode!r}; expected False (cuBLAS + our dGeGLU), "
                         "True (the Triton fused kernel), 'gluon' or 'gluon-fast' (the warp-specialised Gluon kernel)")
    ws = _gluon_backward(dev) if mode in ("gluon", "gluon-fast") else None
    fast = mode == "gluon-fast"

    def run(dy, w_down, g, u, tanh):
        # the Gluon kernel reads dY and Wd through TMA descriptors (16-byte aligned base and rows); without `fast`
        # both kernels give the same bits
        if ws is not None and dy.shape[0] and all(kt._aligned(t) for t in (dy, w_down, g, u)):
            with torch.cuda.device(dy.device) if dy.is_cuda else contextlib.nullcontext():  # (CPU: tests' stand-in)
                ws.down_dgeglu_ws(dy, w_down, g, u, tanh, fast=fast, deriv=deriv)
        elif deriv:
            return False
        else:
            kt.down_dgeglu_into(dy, w_down, g, u, tanh, False, config=TRAIN_BWD_CONFIG)
        return True
    return run


class GeGLUMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, approximate):
        x2 = x.reshape(-1, x.shape[-1])  # what F.linear's matmul does with [..., D]
        fused_forward, fused_backward, save_derivative, ctx.accumulate_dx = _settings(x.device)
        kt = _fused_kernels(x2) if (fused_forward or fused_backward) else None
        deriv = False  # whether g, u hold gelu(g) and u * gelu'(g) (SAVE_DERIVATIVE)
        if kt is not None and fused_forward:
            H = w_gate.shape[0]
            # only where the Gluon backward will take it: elsewhere two strided in-place products after cuBLAS cost
            # more than our dGeGLU kernel (measured on the H200: bwd-probe.txt run 10)
            deriv = bool(save_derivative) and fused_backward in ("gluon", "gluon-fast") and (
                _gluon_backward(x.device) is not None)
            h, gu = kt.gate_up_geglu(x2.contiguous(), w_gate.contiguous(), w_up.contiguous(), approximate == "tanh",
                                     True, config=TRAIN_FWD_CONFIG, deriv=deriv)
            g, u = gu[:, :H], gu[:, H:]
        else:
            g = torch.mm(x2, w_gate.t())
            u = torch.mm(x2, w_up.t())
            h = torch.empty_like(g)
            _pw._forward_into(h, g, u, approximate, True)
        y = torch.mm(h, w_down.t())
        ctx.fused_backward = (_fused_backward(kt, x.device, fused_backward, deriv) if fused_backward and kt is not None
                              else None)
        ctx.deriv = deriv
        ctx.approximate = approximate
        ctx.ran = False
        if _hooks_active():
            ctx.save_for_backward(x, w_gate, w_up, w_down, g, u, h)
            ctx.held = None
        else:
            ctx.save_for_backward(x, w_gate, w_up, w_down)
            ctx.held = [g, u, h]
        return y.view(x.shape[:-1] + (w_down.shape[0],))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        if ctx.ran:
            raise RuntimeError(
                "GeGLUMLP: this training step's backward already ran, and it reuses the saved activations' memory "
                "for the gradients, so it cannot run twice (retain_graph=True). Run the forward again, or compute "
                "both gradients in one backward call.")
        ctx.ran = True
        if ctx.held is None:
            x, w_gate, w_up, w_down, g, u, h = ctx.saved_tensors
        else:
            x, w_gate, w_up, w_down = ctx.saved_tensors
            g, u, h = ctx.held
            ctx.held = None  # from here on the locals are the only references: `del` frees each buffer
        need_x, need_wg, need_wu, need_wd = ctx.needs_input_grad[:4]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dwd = torch.mm(dy2.t(), h) if need_wd else None  # h's last reader
        # d_h = dy @ Wd in a GEMM whose epilogue writes [d_g, d_u] over g and u: no d_h in memory
        if ctx.fused_backward is not None and ctx.fused_backward(dy2.contiguous(), w_down.contiguous(), g, u,
                                                                 ctx.approximate == "tanh"):
            del h
        else:
            d_h = torch.mm(dy2, w_down, out=h)  # written over h
            del h
            if ctx.deriv:  # g, u hold gelu(g), u * gelu'(g): d_gate = d_h * the second, d_up = d_h * the first
                u.mul_(d_h)
                g.mul_(d_h)
                g, u = u, g  # d_g is in u's buffer and d_u in g's (then no packed weight-gradient GEMM)
            else:
                _pw._backward_into(g, u, d_h, g, u, ctx.approximate)  # [d_g, d_u] written over g and u
            del d_h
        x2 = x.reshape(-1, x.shape[-1])
        if ctx.accumulate_dx:
            held = [g, u]  # the helper's list is then the only reference: it frees d_g after its last GEMM
            del g, u
            return _grads_accumulated(held, x, x2, w_gate, w_up, need_x, need_wg, need_wu) + (dwd, None)
        d_g, d_u = g, u
        del g, u
        dx = dwg = dwu = None
        if need_x:
            dx = torch.mm(d_g, w_gate)
        if need_wg:
            dwg = torch.mm(d_g.t(), x2)
        del d_g
        if need_x:
            dx = dx.add_(torch.mm(d_u, w_up)).view(x.shape)  # one bf16 add, as autograd sums the two branches
        if need_wu:
            dwu = torch.mm(d_u.t(), x2)
        return dx, dwg, dwu, dwd, None


def _packed(d_g: Tensor, d_u: Tensor) -> Optional[Tensor]:
    """[d_g | d_u] as one [M, 2H] tensor when the two are its column halves (the fused forward's buffer), else None."""
    M, H = d_g.shape
    if (d_u.shape == d_g.shape and d_g.stride() == d_u.stride() == (2 * H, 1)
            and d_u.data_ptr() == d_g.data_ptr() + H * d_g.element_size()):
        return d_g.as_strided((M, 2 * H), (2 * H, 1))
    return None


def _grads_accumulated(held, x, x2, w_gate, w_up, need_x, need_wg, need_wu):
    """(dx, dW_gate, dW_up) from held = [d_g, d_u] with ACCUMULATE_DX: x's two gradient terms summed in the second
    GEMM's fp32 accumulator (addmm_), and the weight gradients as one GEMM with N = 2H where d_g, d_u are the halves of
    one buffer. Frees d_g after its last GEMM (as the default path does)."""
    d_g, d_u = held
    held.clear()
    gu = _packed(d_g, d_u) if need_wg and need_wu else None
    H = d_g.shape[1]
    dx = dwg = dwu = None
    if need_x:
        dx = torch.mm(d_g, w_gate)
    if need_wg and gu is None:
        dwg = torch.mm(d_g.t(), x2)
    del d_g  # its last reader (packed, gu still holds the buffer for the one weight-gradient GEMM)
    if dx is not None:
        dx = dx.addmm_(d_u, w_up).view(x.shape)
    if gu is not None:
        dw = torch.mm(gu.t(), x2)  # [2H, D]: rows [0, H) are dW_gate, [H, 2H) dW_up (contiguous halves)
        return dx, dw[:H], dw[H:]
    if need_wu:
        dwu = torch.mm(d_u.t(), x2)
    return dx, dwg, dwu


# autograd.Function.apply's Python wrapper (argument binding, functorch checks) is skipped: `applies` has already
# excluded functorch transforms, and the arguments are positional.
_apply = super(torch.autograd.Function, GeGLUMLPFunction).apply


def training_forward(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, approximate: str) -> Optional[Tensor]:
    """The MLP's training step as one node (see the module's docstring), or None where it does not apply (the caller
    runs its regular path)."""
    if not applies(x, w_gate, w_up, w_down):
        return None
    return _apply(x, w_gate, w_up, w_down, approximate)


__all__ = ["GeGLUMLPFunction", "applies", "host_bound", "training_forward", "FUSED_TRAINING", "FUSED_FORWARD",
           "FUSED_BACKWARD", "ACCUMULATE_DX", "SAVE_DERIVATIVE"]
