"""GeGLU kernels: ``out = gelu(gate) * up`` (exact and tanh GELU), forward and backward, fp32/fp16/bf16.

CUDA tensors run the compiled CUDA library when this build variant ships it, else Triton; CPU tensors run eager
PyTorch's numerics. ``configure`` (or the ``GEGLU_*`` environment variables) sets the implementation and whether
the MLP layer may use its fused kernels.
"""

from . import _sharding, layers  # _sharding: DTensor sharding rules for the ops, where torch.distributed exists
from ._ops import HAS_CUDA_LIB, ops
from ._transformers import COMPILE_LAYERS, register_transformers, transformers_kernel_config
from .functional import geglu, geglu_backward, geglu_packed, gelu_and_mul, gelu_tanh_and_mul
from .rmsnorm.ops import rms_norm
from .runtime import aot as _aot
from .runtime.backend import get_backend, set_backend
from .runtime.config import Config, configure, get_config

prebuilt_kernels = _aot.info

if HAS_CUDA_LIB:  # load the Triton kernel modules and the prebuilt-kernel index at import, not on first call
    try:
        from .mlp import kernels as _mlp_kernels  # noqa: F401
        from .pointwise import kernels as _pointwise_kernels  # noqa: F401
        from .rmsnorm import kernels as _rmsnorm_kernels  # noqa: F401

        _aot.preload()
    except ImportError:  # no Triton: the compiled library and PyTorch's ops serve every call
        pass

__all__ = [
    "geglu", "geglu_packed", "geglu_backward", "gelu_and_mul", "gelu_tanh_and_mul", "configure", "get_config",
    "Config", "rms_norm", "prebuilt_kernels", "set_backend", "get_backend", "HAS_CUDA_LIB", "ops", "layers",
    "register_transformers", "transformers_kernel_config", "COMPILE_LAYERS",
]
