"""GeGLU kernels: ``out = gelu(gate) * up`` (exact and tanh GELU), forward and backward, fp32/fp16/bf16.

CUDA tensors run the compiled CUDA library when this build variant ships it, else Triton kernels; CPU tensors run
a CPU implementation with eager PyTorch's numerics. ``configure`` (or the ``GEGLU_*`` environment variables) sets
which implementation runs and whether the MLP layer may use its fused kernels.
"""

from . import _aot, _sharding, layers  # _sharding: DTensor sharding rules for the ops, where torch.distributed exists
from ._backend import get_backend, set_backend
from ._config import Config, configure, get_config
from ._ops import HAS_CUDA_LIB, ops
from .functional import geglu, geglu_backward, geglu_packed, gelu_and_mul, gelu_tanh_and_mul
from ._rmsnorm import rms_norm
from ._transformers import register_transformers, transformers_kernel_config

prebuilt_kernels = _aot.info

if HAS_CUDA_LIB:  # the compiled variant: import its Triton kernel modules (and Triton) and read the index of its
    # prebuilt kernels now, when the model loads, not in its first call
    try:
        from . import _fused_mlp_triton, _rmsnorm_triton, _triton  # noqa: F401

        _aot.preload()
    except ImportError:  # no Triton: the compiled library and PyTorch's ops serve every call
        pass

__all__ = [
    "geglu",
    "geglu_packed",
    "geglu_backward",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "configure",
    "get_config",
    "Config",
    "rms_norm",
    "prebuilt_kernels",
    "set_backend",
    "get_backend",
    "HAS_CUDA_LIB",
    "ops",
    "layers",
    "register_transformers",
    "transformers_kernel_config",
]
