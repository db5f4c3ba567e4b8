"""Which implementation runs a call (``impl_for``) and through which path (``call_mode``).

By the ``backend`` setting: ``auto``: CUDA tensors use the Triton kernels, or the compiled library (where this variant
has it) below ``CUDA_LIB_BELOW`` elements; CPU tensors use eager's kernels. ``cuda``: CUDA tensors always use the
compiled library (an error if the variant has none). ``triton``: always the Triton kernels, CPU tensors too (under
``TRITON_INTERPRET=1``). Paths: ``PLAIN`` / ``AUTOGRAD`` for plain eager calls, ``OP`` (the ``torch.library`` op)
under graph capture, tracing, functorch transforms and for tensor subclasses.
"""

import functools
import importlib

import torch
from torch import Tensor

from . import config as _config
from .._ops import HAS_CUDA_LIB

BACKENDS = _config.BACKENDS
CUDA_LIB_BELOW = 1 << 21

# Under 'auto', eager CUDA calls that record a gradient below this many elements run PyTorch's own ops
# (``F.gelu(gate) * up``, bit-identical values and gradients): there the step is host-bound.
AUTOGRAD_EAGER_BELOW = 1 << 26
# The same for GeGLUMLP's training step as one node ([M, H] elements).
NODE_EAGER_BELOW = 1 << 21

OP, PLAIN, AUTOGRAD = 0, 1, 2
_is_compiling = torch.compiler.is_compiling
_is_tracing = torch._C._is_tracing
_functorch_active = torch._C._are_functorch_transforms_active
_grad_enabled = torch.is_grad_enabled
_Parameter = torch.nn.Parameter


def traced() -> bool:
    """Inside torch.compile / torch.jit tracing / a functorch transform: the ops must be called."""
    return _is_compiling() or _is_tracing() or _functorch_active()


def call_mode(*tensors: Tensor) -> int:
    """``PLAIN`` / ``AUTOGRAD`` for a plain eager call (no graph capture or tracing, no tensor subclass, no
    functorch transform; ``AUTOGRAD`` when a gradient is recorded), ``OP`` otherwise."""
    if traced():
        return OP
    needs_grad = False
    for t in tensors:
        if type(t) is not Tensor and type(t) is not _Parameter:
            return OP
        needs_grad = needs_grad or t.requires_grad
    return AUTOGRAD if needs_grad and _grad_enabled() else PLAIN


def lazy_module(name: str, package: str):
    """A function returning module ``name`` (relative to ``package``), imported on its first call."""
    return functools.cache(lambda: importlib.import_module(name, package))


def set_backend(name: str) -> None:
    """Choose the implementation: 'auto', 'cuda' or 'triton' (same as ``configure(backend=name)``)."""
    _config.configure(backend=_config.parse_backend(name, "geglu.set_backend(name)"))


def get_backend() -> str:
    return _config.current.backend


def eager_autograd(numel: int, below: int = AUTOGRAD_EAGER_BELOW) -> bool:
    """True when a CUDA call of ``numel`` elements that records a gradient should run PyTorch's own ops."""
    return _config.current.backend == "auto" and numel < below


def impl_for(device_type: str, numel: int) -> str:
    """The implementation that runs for ``numel``-element tensors on ``device_type``: 'cuda', 'triton' or 'cpu'."""
    backend = _config.current.backend
    if backend == "triton":
        return "triton"
    if device_type == "cuda":
        if HAS_CUDA_LIB:
            return "cuda" if backend == "cuda" or numel < CUDA_LIB_BELOW else "triton"
        if backend == "cuda":
            raise RuntimeError("geglu: the backend is 'cuda' (GEGLU_BACKEND or geglu.configure) but this build variant "
                               "has no compiled CUDA library; load the torch-stable-abi* variant, or choose 'triton' / "
                               "'auto'.")
        return "triton"
    if device_type == "cpu":
        return "cpu"
    raise NotImplementedError(f"geglu: tensors on {device_type!r} are not supported; expected CUDA or CPU tensors.")


# --- shipped rules -------------------------------------------------------------------------------------------------

_CAPABILITY: dict = {}


def capability_major(device: torch.device) -> int:
    """The compute capability major of a CUDA device (cached per device index)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    cap = _CAPABILITY.get(idx)
    if cap is None:
        cap = _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)[0]
    return cap


def shipped_rule(rules: dict, device: torch.device, **measures) -> bool:
    """Whether a call meets a shipped rule: ``rules`` maps a compute capability major to the least value of each
    measure, e.g. ``{9: {"min_m": 1024}}`` with ``min_m=M``. False on an architecture the rules do not list; True on
    non-CUDA tensors."""
    if device.type != "cuda":
        return True
    rule = rules.get(capability_major(device))
    return rule is not None and all(value >= rule[name] for name, value in measures.items())
