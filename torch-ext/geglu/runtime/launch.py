"""Launching the Triton kernels: the variant's prebuilt binary (``aot``) where there is one, else Triton's JIT."""

import contextlib

import torch
import triton

from . import aot as _aot
from . import config as _config
from .gelu_math import INTERPRET

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: pointer loads only
    TensorDescriptor = None

_SM_COUNT = {}


def sm_count(device: torch.device) -> int:
    """The device's multiprocessor count (cached per device index); 8 for non-CUDA tensors (the interpreter)."""
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


# --- launching -----------------------------------------------------------------------------------------------------
# The first JIT launch of a specialisation goes through Triton; later ones call the compiled kernel's launcher
# directly. The cache key is at least as fine as Triton's specialisation (pointer dtype and 16-byte alignment; integer
# divisibility by 16, == 1 and width), plus constexprs, warps, stages, device and the prebuilt setting. Launches with
# TMA descriptors go through Triton each time. A CompiledKernel without the expected attributes turns the direct JIT
# path off for the process.
_DIRECT_LAUNCH = {}
_direct_ok = not INTERPRET
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _spec(a):
    if isinstance(a, int):
        return a % 16 == 0, a == 1, -(2**31) <= a < 2**31, 0 <= a < 2**63
    if isinstance(a, float):
        return float
    if isinstance(a, _aot.Desc):
        return a.base.dtype, tuple(a.block)
    return a.dtype, a.data_ptr() % 16 == 0


def _hook_active(hook) -> bool:
    """A launch hook in force: a function, or a HookChain with calls."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime is None or _hook_active(runtime.launch_enter_hook) or _hook_active(runtime.launch_exit_hook)


def clear_caches() -> None:
    """Forget every launch looked up so far (the next launches look up their kernels again)."""
    _DIRECT_LAUNCH.clear()


_JIT = (None, None, None)  # a launch key's entry where Triton's JIT call itself runs the kernel


def launch(fn, grid, args, consts, num_warps: int, device: torch.device, num_stages: int = 3) -> None:
    """``fn[grid](*args, *consts, num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False)`` on the
    current device: the variant's prebuilt kernel where there is one, else Triton's JIT. ``args``: the runtime
    arguments in order (an ``aot.Desc`` for a TMA descriptor); ``consts``: the constexprs after them."""
    global _direct_ok
    key = None
    if not INTERPRET:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        key = (fn, num_warps, num_stages, idx, consts, _config.current.prebuilt) + tuple(_spec(a) for a in args)
        hit = _DIRECT_LAUNCH.get(key)
        if hit is None:
            run = _aot.find(fn.__name__, args, consts, num_warps, num_stages, idx)
            hit = _JIT if run is None else (run, None, None)
            if len(_DIRECT_LAUNCH) < 4096:
                _DIRECT_LAUNCH[key] = hit
        if hit is not _JIT:
            run, function, meta = hit
            if function is None:  # prebuilt
                run(grid, args, _raw_stream(idx))
                return
            if not _hooks_set():
                run(grid[0], grid[1] if len(grid) > 1 else 1, 1, _raw_stream(idx), function, meta, None, None, None,
                    *args, *consts)
                return
    descs = any(isinstance(a, _aot.Desc) for a in args)
    if descs:
        args = [TensorDescriptor(a.base, a.shape, a.strides, a.block) if isinstance(a, _aot.Desc) else a for a in args]
    compiled = fn[grid](*args, *consts, num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False)
    if key is not None and _direct_ok and not descs and key in _DIRECT_LAUNCH:
        try:
            _DIRECT_LAUNCH[key] = (compiled.run, compiled.function, compiled.packed_metadata)
        except Exception:  # another Triton's CompiledKernel: keep its own launch path
            _direct_ok = False


def device_guard(t: torch.Tensor):
    """A context making ``t``'s CUDA device current, or ``NULL_CONTEXT`` when it already is (or ``t`` is not CUDA)."""
    if t.device.type == "cuda" and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return NULL_CONTEXT


NULL_CONTEXT = contextlib.nullcontext()


def pow2_up_to(n: int) -> list:
    """1, 2, 4, ... up to ``n``: the tile sizes a plan can choose."""
    return [1 << i for i in range(max(n, 0).bit_length())]


def prebuild(fn, consts, num_warps: int, num_stages: int = 3, *, dtype: str = "", hinted=(), types=None) -> dict:
    """One entry of a kernel module's ``prebuild_launches()``: the kernel's name, its runtime arguments (the
    parameters before the constexprs ``consts``) in order as ``(name, signature type, hinted)``, the constexprs, warps
    and stages. An argument ``*_ptr`` is a 16-byte aligned ``*<dtype>`` pointer, any other an ``i32``, divisible by 16
    where named in ``hinted``; ``types`` gives another type by name (a pointer of it is hinted, a :func:`desc_type`
    or ``fp32`` never)."""
    types = types or {}
    args = []
    for name in fn.arg_names[:len(fn.arg_names) - len(consts)]:
        t = types.get(name) or (f"*{dtype}" if name.endswith("_ptr") else "i32")
        args.append((name, t, t.startswith("*") or name in hinted))
    return dict(fn=fn.__name__, args=args, consts=list(consts), num_warps=num_warps, num_stages=num_stages)


def desc_type(dtype: str, block) -> str:
    """The signature type of a TMA tensor-descriptor argument of a ``prebuild_launches()`` entry."""
    return f"tensordesc<{dtype}[{', '.join(map(str, block))}]>"
