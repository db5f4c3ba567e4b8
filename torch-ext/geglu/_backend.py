"""Which implementation runs: the compiled CUDA library, the Triton kernels, or the CPU implementation.

* ``auto`` (default): CUDA tensors use Triton, except small problems (under ``CUDA_LIB_BELOW`` elements), which
  use the compiled library when this build variant has it: its launch costs the host far less, and at decode
  sizes the launch is the cost. At prefill sizes the Triton kernels measured faster on an H200 (bf16 forward 96%
  vs 87% of the copy floor at 8192x14336; benchmarks/results). CPU tensors use the CPU implementation.
* ``cuda``: CUDA tensors must use the compiled library (an error if this variant has none).
* ``triton``: always the Triton kernels, CPU tensors too (meaningful under ``TRITON_INTERPRET=1``; for tests).

Set it with :func:`set_backend` or the environment variable ``GEGLU_BACKEND``.
"""

import os

from ._ops import HAS_CUDA_LIB

BACKENDS = ("auto", "cuda", "triton")

_backend = os.environ.get("GEGLU_BACKEND", "auto").strip().lower() or "auto"
if _backend not in BACKENDS:
    raise ValueError(f"GEGLU_BACKEND={_backend!r} is not a backend; expected one of {', '.join(BACKENDS)}.")


def set_backend(name: str) -> None:
    """Choose the implementation: 'auto', 'cuda' (the compiled library) or 'triton'."""
    global _backend
    name = name.strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"geglu.set_backend({name!r}): expected one of {', '.join(BACKENDS)}.")
    if name == "cuda" and not HAS_CUDA_LIB:
        raise RuntimeError(
            "geglu.set_backend('cuda'): this build variant has no compiled CUDA library (it is a Triton/CPU "
            "variant). Load the torch-stable-abi* variant, or use 'triton' / 'auto'."
        )
    _backend = name


def get_backend() -> str:
    return _backend


CUDA_LIB_BELOW = 1 << 21

# Under 'auto', eager calls that record a gradient on CUDA tensors below this many elements run PyTorch's own ops
# (``F.gelu(gate) * up``: bit-identical results and gradients, the tests check it). There the fused kernels save
# under ~7 µs of GPU time per forward+backward, while a Python autograd node costs the host tens of µs more than
# eager's C++ ones (measured on the H200's host: benchmarks/results/h200/autograd-overhead.txt); small training
# steps are host-bound, so the fused kernels would make them slower. 'cuda' and 'triton' always run the kernels.
AUTOGRAD_EAGER_BELOW = 1 << 21


def eager_autograd(numel: int) -> bool:
    """True when a CUDA call of ``numel`` elements that records a gradient should run PyTorch's own ops."""
    return _backend == "auto" and numel < AUTOGRAD_EAGER_BELOW


def impl_for(device_type: str, numel: int) -> str:
    """The implementation that runs for ``numel``-element tensors on ``device_type``: 'cuda', 'triton' or 'cpu'."""
    if _backend == "triton":
        return "triton"
    if device_type == "cuda":
        if HAS_CUDA_LIB:
            return "cuda" if _backend == "cuda" or numel < CUDA_LIB_BELOW else "triton"
        if _backend == "cuda":
            raise RuntimeError(
                "geglu: the backend is 'cuda' (GEGLU_BACKEND) but this build variant has no compiled CUDA library; "
                "load the torch-stable-abi* variant, or choose 'triton' / 'auto'."
            )
        return "triton"
    if device_type == "cpu":
        return "cpu"
    raise NotImplementedError(
        f"geglu: tensors on {device_type!r} are not supported; expected CUDA or CPU tensors."
    )
