"""Which host activations are a GELU the kernels compute, and which flavour.

The one list of transformers' activation classes by the GELU they compute (the tooling loads this file too, to
decide whether kernelize should swap a module's forward at all). Exact matches of ``F.gelu`` first; the tanh-formula
variants (``gelu_new``, ``gelu_fast``, ``gelu_accurate``) compute the same function op by op in the input dtype, so
the kernel's fp32 result differs from theirs by their roundings (it is closer to the true value).

This module imports only torch: no relative imports.
"""

from typing import Optional

import torch

TANH_CLASSES = frozenset({"GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh", "NewGELUActivation",
                          "FastGELUActivation", "AccurateGELUActivation"})
ERF_CLASSES = frozenset({"GELUActivation"})
APPROXIMATIONS = ("none", "tanh")


def gelu_approximation(act) -> Optional[str]:
    """'none' (erf) or 'tanh' when ``act`` is a GELU the kernels compute, else None (the host's own code runs)."""
    if isinstance(act, torch.nn.GELU):
        return act.approximate if act.approximate in APPROXIMATIONS else None
    if act is torch.nn.functional.gelu:
        return "none"
    return _by_class_name(act)


@torch.compiler.assume_constant_result
def _by_class_name(act) -> Optional[str]:
    """The flavour of a transformers activation module, by its class's name. A constant under torch.compile, guarded
    by the module's identity: traced, ``type(act).__name__`` made Dynamo add a Python guard per activation instance
    (``type(a) is type(b)`` for every pair of modules of one class), evaluated on every call of the compiled
    model."""
    name = type(act).__name__
    if name in TANH_CLASSES:
        return "tanh"
    if name in ERF_CLASSES:
        return "none"
    return None
