"""Which host activations are a GELU the kernels compute, and which flavour.

The one list of transformers' activation classes by the GELU they compute (the tooling loads this file too, to
decide whether kernelize should swap a module's forward at all). Exact matches of ``F.gelu`` first; the tanh-formula
variants (``gelu_new``, ``gelu_fast``, ``gelu_accurate``) compute the same function op by op in the input dtype, so
the kernel's fp32 result differs from theirs by their roundings (it is closer to the true value).

This module imports only torch and the standard library: no relative imports.
"""

import sys
from typing import Optional

import torch

TANH_CLASSES = frozenset({"GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh", "NewGELUActivation",
                          "FastGELUActivation", "AccurateGELUActivation"})
ERF_CLASSES = frozenset({"GELUActivation"})
APPROXIMATIONS = ("none", "tanh")


# The classes met so far, by flavour. Under torch.compile ``isinstance(act, these)`` costs Dynamo one C++ type check
# per module; the class name, traced (``type(act).__name__``), made it add a Python-evaluated guard per module
# instance (``type(a) is type(b)`` between every two activations of one class), which a compiled model evaluates on
# every call. transformers' own classes are found when this module loads; classes of those names from elsewhere
# are learned on their first eager call.
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
    if name in TANH_CLASSES:
        return "tanh"
    if name in ERF_CLASSES:
        return "none"
    return None


def _scan_transformers() -> None:
    module = sys.modules.get("transformers.activations")
    for name in sorted(TANH_CLASSES | ERF_CLASSES):
        cls = getattr(module, name, None)
        flavour = _by_name(cls) if isinstance(cls, type) else None
        if flavour is not None:
            _learn(cls, flavour)


def gelu_approximation(act) -> Optional[str]:
    """'none' (erf) or 'tanh' when ``act`` is a GELU the kernels compute, else None (the host's own code runs).
    transformers' activation classes count by their name (``TANH_CLASSES``, ``ERF_CLASSES``); a subclass of a class
    met before counts as that class."""
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
