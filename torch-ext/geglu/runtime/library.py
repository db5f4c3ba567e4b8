"""The package's one way to define a Python operator (:func:`op`), and :func:`fast_apply` for its autograd
Functions.

``torch.library.custom_op`` wraps each call in two Python layers: an autograd kernel that runs even without a
gradient (it computes the dispatch key set and redispatches) and a backend wrapper that checks, after every call,
that no output aliases an input: a few µs a call more than an op defined with ``Library.define`` /
``Library.impl`` (benchmarks/results/development-notes.md gives the measurement). An Inductor graph calls the MLP
op once per layer, so where a compiled model is host-bound that cost is the difference to the model compiled
without kernels.

:func:`op` gives the same contract as ``custom_op`` where it matters: the schema is inferred from the type hints
(``torch.library.infer_schema``), the fake implementation and the autograd formula are registered with
``torch.library.register_fake`` / ``register_autograd``, and ``torch.library.opcheck`` tests the result. What it
drops is the aliasing check: the implementations return new tensors (``opcheck``'s ``test_schema`` checks that).
An op without an autograd formula has PyTorch's C++ autograd fallback: call it without a gradient. Every call
site passes ``add_op_namespace_prefix("name")`` itself, the form kernel-builder's torch-ops-check looks for.
"""

from typing import Callable, Dict, Sequence

import torch
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
    """Decorator: define ``qualname`` (``add_op_namespace_prefix("name")``) with the function as its implementation
    for every device (``CompositeExplicitAutograd``)."""

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
    """``function.apply`` (a ``torch.autograd.Function``) without its Python wrapper, which binds default arguments
    and unwraps functorch's dead wrappers: several µs a call that a decode-sized eager step pays. For callers that
    pass every argument positionally, outside functorch transforms (``runtime.backend.call_mode`` is not OP). It is
    the C++ ``apply`` that ``Function.apply`` ends in; tests/kernel/test_library.py fails if PyTorch moves it."""
    return super(torch.autograd.Function, function).apply


__all__ = ["Op", "op", "fast_apply"]
