"""DTensor sharding rules for the package's custom ops, so that a DTensor passed to an op runs our kernel on each
rank's local shard (``torch.distributed.tensor.experimental.register_sharding``) instead of failing with "does
not have a sharding strategy registered".

A rule lists, for one mesh dimension, the placements under which the op is correct on the local shards; DTensor
expands them over every mesh dimension, picks the one that costs the least communication for the inputs as they
are, redistributes inputs that do not match it, calls the op on the local tensors and wraps the results.

* **Pointwise forms** (``geglu``, ``geglu_backward``): every tensor with one placement: ``Replicate()`` or
  ``Shard(d)`` on any dim, the last one included (the op is elementwise). Also ``Partial`` in the one input the op
  is linear in: ``up`` for the forward (``gelu(gate) * up``, with ``gate`` replicated), ``grad`` for the backward;
  the outputs are then ``Partial`` too.
* **Packed forms** (``geglu_packed``, ``geglu_packed_backward``, ``x[..., 2d]``): ``Replicate()`` or ``Shard(d)``
  on any dim but the last, and on the last one only as ``_StridedShard(-1, split_factor=2)`` (each rank holds its
  slice of both halves side by side, ``[gate_r | up_r]``: the layout of transformers' ``packed_colwise`` and of a
  packed projection whose weight is sharded with ``_StridedShard(0, split_factor=2)``), which gives ``Shard(-1)``
  of the ``[..., d]`` side. A plain ``Shard(-1)`` of the packed dim would give each rank a piece of one half only,
  so it is not a rule: DTensor redistributes such an ``x`` to the cheapest valid placement (all-to-all into
  ``_StridedShard``, or an all-gather), with the correct result at the cost of that communication.
* **Ops that write into an argument** (``geglu_out``'s ``out``; the in-place backwards ``geglu_backward_`` and
  ``geglu_packed_backward_``, which write the gradients over ``gate``/``up`` or ``x``): a redistributed copy of
  that argument would receive the result and be thrown away, so only rules that keep the written arguments'
  placements are offered. DTensor also keeps the first argument of an op whose name ends in ``_`` (here ``grad``)
  where it is. On a one-dimensional mesh (tensor parallelism) that is exact; a multi-dimensional mesh whose
  written argument has different placements along its dims cannot be expressed by a per-dim rule and raises
  ``NotImplementedError`` naming the out-of-place op to use. An in-place backward whose ``grad`` is placed
  differently from ``gate``/``up`` has no valid placement either: DTensor raises, rather than losing the gradients.

Adding a rule for a new op is one entry in ``RULES`` (op name -> rule), e.g. for an op ``my_mlp(x, w_in, w_out,
approximate) -> y`` that is column-parallel in ``w_in`` and row-parallel in ``w_out``::

    "my_mlp": explicit(lambda x, w_in, w_out, approximate: [
        ([Replicate()], [Replicate(), Replicate(), Replicate(), None]),
        ([Partial()], [Replicate(), Shard(0), Shard(1), None]),
    ]),

``pointwise`` / ``packed`` build the rules of the GeGLU shapes; ``explicit`` takes a function of the op's arguments
(DTensor specs, with ``.placements``, ``.ndim`` and ``.shape``, in place of tensors) that returns
``[(output placements, input placements), ...]`` for one mesh dim, ``None`` for each non-tensor argument. Ops
missing from the build (a variant without them) are skipped. Everything here needs ``torch.distributed``; on a
torch without it the module only defines ``AVAILABLE = False``.
"""

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .pointwise import ops as _custom_ops  # noqa: F401  (defines the ops this module registers rules for)
from ._ops import ops

try:
    if not torch.distributed.is_available():
        raise ImportError("torch.distributed is not available")
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding
except ImportError:  # a torch built without distributed support
    AVAILABLE = False
else:
    AVAILABLE = True

try:  # private in torch (2.5+); transformers' packed_colwise uses it
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:
    _StridedShard = None

Strategies = List[Tuple[list, list]]
Rule = Callable[..., Strategies]

_LINEAR_REDUCE_OPS = ("sum", "avg")  # reductions that commute with multiplying by a replicated factor


def _is_spec(a) -> bool:
    return hasattr(a, "placements") and hasattr(a, "ndim")


def _partials(spec) -> list:
    """The Partial placements of ``spec`` whose reduction an op linear in that tensor commutes with."""
    return [p for p in spec.placements if isinstance(p, Partial) and p.reduce_op in _LINEAR_REDUCE_OPS]


def _keep_placements(op_name: str, strategies: Strategies, args: Sequence, written: Sequence[int]) -> Strategies:
    """The strategies that leave the written arguments (indices into ``args``) where they are."""
    specs = [args[i] for i in written]
    placements = specs[0].placements
    if len(placements) > 1 and (len(set(placements)) > 1 or any(s.placements != placements for s in specs[1:])):
        names = ", ".join(str(tuple(s.placements)) for s in specs)
        raise NotImplementedError(
            f"geglu: {op_name} writes its result into an argument, but on this {len(placements)}-dimensional mesh the "
            f"written DTensors have placements {names}, which a per-mesh-dim sharding rule cannot keep in place. "
            "Use the out-of-place form (geglu(..., inplace_backward=False), or no out=), or redistribute them to "
            "one placement first.")
    keep = placements[0]
    kept = [(outs, ins) for outs, ins in strategies if all(ins[i] == keep for i in written)]
    if not kept:
        raise NotImplementedError(
            f"geglu: {op_name} writes its result into an argument placed {keep}, and no sharding rule of the op "
            "keeps that placement (the packed last dim can only be split as _StridedShard(-1, split_factor=2)). Use "
            "the out-of-place form, or redistribute the argument first.")
    return kept


def pointwise(n_tensors: int, n_out: int, linear_in: Optional[int] = None,
              writes: Sequence[int] = ()) -> Rule:
    """Rule of an elementwise op whose first ``n_tensors`` arguments and ``n_out`` outputs share one shape:
    Replicate, or Shard(d) on any dim, for all of them; with ``linear_in`` (the index of the input the op is linear
    in), that input Partial and the other inputs Replicate give Partial outputs (not for ops that write into an
    argument). ``writes``: indices of arguments the op writes its result into."""

    def rule(*args, **kwargs) -> Strategies:
        ref = args[0]
        extra = [None] * (len(args) - n_tensors)
        out: Strategies = [([Replicate()] * n_out, [Replicate()] * n_tensors + extra)]
        for d in range(ref.ndim):
            out.append(([Shard(d)] * n_out, [Shard(d)] * n_tensors + extra))
        if linear_in is not None and not writes:
            for p in _partials(args[linear_in]):
                ins = [Replicate()] * n_tensors
                ins[linear_in] = p
                out.append(([p] * n_out, ins + extra))
        return _keep_placements(rule.op_name, out, args, writes) if writes else out

    return rule


def packed(roles: Sequence[str], outs: Sequence[str], linear_in: Optional[int] = None,
           writes: Sequence[int] = ()) -> Rule:
    """Rule of a packed op: tensors whose last dim is either the packed ``2d`` (role ``"x"``) or ``d`` (``"h"``),
    the leading dims shared. ``roles``: one per leading tensor argument; ``outs``: one per output. Replicate, or
    Shard on a leading dim, for all; on the last dim ``_StridedShard(-1, split_factor=2)`` for the packed tensors
    with ``Shard(-1)`` for the others; with ``linear_in``, that (``"h"``) input Partial and the rest Replicate give
    Partial outputs."""
    n = len(roles)

    def rule(*args, **kwargs) -> Strategies:
        extra = [None] * (len(args) - n)
        lead = args[roles.index("x")].ndim - 1  # DTensor wants placements with non-negative dims

        def last(role: str):
            return _StridedShard(lead, split_factor=2) if role == "x" else Shard(lead)

        out: Strategies = [([Replicate()] * len(outs), [Replicate()] * n + extra)]
        for d in range(lead):
            out.append(([Shard(d)] * len(outs), [Shard(d)] * n + extra))
        if _StridedShard is not None:
            out.append(([last(r) for r in outs], [last(r) for r in roles] + extra))
        if linear_in is not None and not writes:
            for p in _partials(args[linear_in]):
                ins = [Replicate()] * n
                ins[linear_in] = p
                out.append(([p] * len(outs), ins + extra))
        return _keep_placements(rule.op_name, out, args, writes) if writes else out

    return rule


def explicit(fn: Rule) -> Rule:
    """A rule given as a function of the op's arguments returning ``[(output placements, input placements)]``."""

    def rule(*args, **kwargs) -> Strategies:
        return fn(*args, **kwargs)

    return rule


# op name -> rule. Arguments and outputs in the ops' schema order (pointwise/ops.py).
RULES: Dict[str, Rule] = {
    # geglu(gate, up, approximate, inplace_backward) -> out
    "geglu": pointwise(2, 1, linear_in=1),
    # geglu_out(out, gate, up, approximate) -> None, writes out
    "geglu_out": pointwise(3, 0, writes=(0,)),
    # geglu_backward(grad, gate, up, approximate) -> (d_gate, d_up)
    "geglu_backward": pointwise(3, 2, linear_in=0),
    # geglu_backward_(grad, gate, up, approximate) -> None, writes d_gate over gate and d_up over up
    "geglu_backward_": pointwise(3, 0, writes=(1, 2)),
    # geglu_packed(x, approximate, act_first, inplace_backward) -> out
    "geglu_packed": packed(("x",), ("h",)),
    # geglu_packed_backward(grad, x, approximate, act_first) -> dx
    "geglu_packed_backward": packed(("h", "x"), ("x",), linear_in=0),
    # geglu_packed_backward_(grad, x, approximate, act_first) -> None, writes dx over x
    "geglu_packed_backward_": packed(("h", "x"), (), writes=(1,)),
}


def _register() -> List[str]:
    done = []
    for name, rule in RULES.items():
        if not hasattr(ops, name):
            continue
        packet = getattr(ops, name)
        rule.op_name = name
        register_sharding(packet.default)(rule)
        done.append(name)
    return done


REGISTERED: List[str] = _register() if AVAILABLE else []

__all__ = ["AVAILABLE", "RULES", "REGISTERED", "pointwise", "packed", "explicit"]
