"""Operator definition (:func:`op`), :func:`fast_apply` for autograd Functions and :class:`HubLayer`, the Hub
layers' base.

:func:`op` defines an operator with ``Library.define`` / ``Library.impl``: the schema is inferred from the type hints
(``torch.library.infer_schema``); fake implementation and autograd formula register through ``register_fake`` /
``register_autograd``. Unlike ``torch.library.custom_op`` there is no per-call aliasing check: implementations must
return new tensors (``opcheck``'s ``test_schema`` checks that). An op without an autograd formula uses PyTorch's C++
autograd fallback: call it without a gradient. Call sites pass ``add_op_namespace_prefix("name")`` as the qualname.
"""

from typing import Callable, Dict, Sequence

import torch
from torch import nn
from torch.library import Library

_LIBS: Dict[str, Library] = {}


class Op:
    """A defined operator: call it like the function it was made from (positional arguments); ``default`` is its
    ``OpOverload``."""

    def __init__(self, qualname: str, overload, lib: Library):
        self.qualname, self.default, self._lib = qualname, overload, lib

    def __call__(self, *args):
        return self.default(*args)

    def register_fake(self, fn: Callable) -> Callable:
        torch.library.register_fake(self.qualname, fn, lib=self._lib)
        return fn

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        torch.library.register_autograd(self.qualname, backward, setup_context=setup_context, lib=self._lib)


def op(qualname: str, mutates_args: Sequence[str] = ()) -> Callable[[Callable], Op]:
    """Decorator: define ``qualname`` with the function as its ``CompositeExplicitAutograd`` implementation."""

    def define(fn: Callable) -> Op:
        ns, short = qualname.split("::")
        lib = _LIBS.get(ns)
        if lib is None:
            lib = _LIBS[ns] = Library(ns, "FRAGMENT")
        lib.define(short + torch.library.infer_schema(fn, mutates_args=tuple(mutates_args)))
        lib.impl(short, fn, "CompositeExplicitAutograd")
        return Op(qualname, getattr(getattr(torch.ops, ns), short).default, lib)
    return define


def fast_apply(function: type) -> Callable:
    """The C++ ``apply`` of a ``torch.autograd.Function``, skipping the Python wrapper (no default-argument binding,
    no functorch unwrapping). Callers pass every argument positionally, outside functorch transforms
    (``runtime.backend.call_mode`` is not OP)."""
    return super(torch.autograd.Function, function).apply


class HubLayer(nn.Module):
    """The base of the package's Hub layers: kernelize may map them in every mode (``can_torch_compile``,
    ``has_backward``). A layer adds ``forward`` only (``kernels`` refuses other members); state comes from the host
    module, named by the class's annotations."""

    can_torch_compile = True
    has_backward = True
