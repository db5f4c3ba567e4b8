"""Which host activations are a GELU the kernels compute, and which flavour ('none' or 'tanh').

transformers' GELU classes are listed by name. Its tanh-formula variants (``gelu_new``, ``gelu_fast``,
``gelu_accurate``) compute in the input dtype, so the kernel's fp32 result differs from theirs by their roundings.
Imports only torch and the standard library: the tooling loads this file on its own.
"""

import sys
from typing import Optional

import torch

TANH_CLASSES = frozenset({"GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh", "NewGELUActivation",
                          "FastGELUActivation", "AccurateGELUActivation"})
ERF_CLASSES = frozenset({"GELUActivation"})
APPROXIMATIONS = ("none", "tanh")


# Classes met so far, by flavour: matched with isinstance, which Dynamo guards more cheaply than the class name.
# Filled at import from transformers.activations (if loaded), else on a class's first eager call.
_TANH_TYPES: tuple = ()
_ERF_TYPES: tuple = ()


def _learn(cls: type, flavour: str) -> None:
    global _TANH_TYPES, _ERF_TYPES
    if flavour == "tanh" and cls not in _TANH_TYPES:
        _TANH_TYPES = _TANH_TYPES + (cls,)
    elif flavour == "none" and cls not in _ERF_TYPES:
        _ERF_TYPES = _ERF_TYPES + (cls,)


def _by_name(cls: type) -> Optional[str]:
    name = cls.__name__
    return "tanh" if name in TANH_CLASSES else "none" if name in ERF_CLASSES else None


def _scan_transformers() -> None:
    module = sys.modules.get("transformers.activations")
    for name in sorted(TANH_CLASSES | ERF_CLASSES):
        cls = getattr(module, name, None)
        flavour = _by_name(cls) if isinstance(cls, type) else None
        if flavour is not None:
            _learn(cls, flavour)


def gelu_approximation(act) -> Optional[str]:
    """'none' (erf) or 'tanh' when ``act`` is a GELU the kernels compute, else None. transformers' classes count by
    name (``TANH_CLASSES``, ``ERF_CLASSES``); a subclass of a class met before counts as that class."""
    if isinstance(act, torch.nn.GELU):
        return act.approximate if act.approximate in APPROXIMATIONS else None
    if act is torch.nn.functional.gelu:
        return "none"
    if isinstance(act, _TANH_TYPES):
        return "tanh"
    if isinstance(act, _ERF_TYPES):
        return "none"
    cls = type(act)
    flavour = _by_name(cls)
    if flavour is not None and not torch.compiler.is_compiling():
        _learn(cls, flavour)
    return flavour


_scan_transformers()
