"""DTensor sharding rules (``register_sharding``) for the custom ops, so a DTensor input runs the kernel on each rank's
local shard; the rules per op are docs/distributed.md's table. ``RULES``: op name -> rule, a function of the op's
arguments (DTensor specs for tensors, ``None`` for others) returning ``[(output placements, input placements),
...]``, the placements per mesh dim under which the op is correct on local shards (:func:`pointwise`,
:func:`packed`). An op that writes into an argument keeps only the rules that leave it in place, else raises
``NotImplementedError`` naming the out-of-place form. Without ``torch.distributed``, ``AVAILABLE`` is False.
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


def _finish(op_name: str, out: Strategies, args: Sequence, n_in: int, n_out: int, extra: list,
            linear_in: Optional[int], writes: Sequence[int]) -> Strategies:
    """``out`` plus, for an out-of-place op linear in ``args[linear_in]``, that input Partial (the others Replicate)
    with Partial outputs; for an op with ``writes``, only the strategies that keep those arguments in place."""
    if linear_in is not None and not writes:
        for p in _partials(args[linear_in]):
            ins = [Replicate()] * n_in
            ins[linear_in] = p
            out.append(([p] * n_out, ins + extra))
    return _keep_placements(op_name, out, args, writes) if writes else out


def pointwise(n_tensors: int, n_out: int, linear_in: Optional[int] = None, writes: Sequence[int] = ()) -> Rule:
    """Rule of an elementwise op whose first ``n_tensors`` arguments and ``n_out`` outputs share one shape: all
    Replicate or all Shard(d); with ``linear_in`` (and no ``writes``), that input Partial and the others Replicate give
    Partial outputs. ``writes``: indices of the arguments the op writes into."""

    def rule(*args, **kwargs) -> Strategies:
        ref = args[0]
        extra = [None] * (len(args) - n_tensors)
        out: Strategies = [([Replicate()] * n_out, [Replicate()] * n_tensors + extra)]
        for d in range(ref.ndim):
            out.append(([Shard(d)] * n_out, [Shard(d)] * n_tensors + extra))
        return _finish(rule.op_name, out, args, n_tensors, n_out, extra, linear_in, writes)

    return rule


def packed(roles: Sequence[str], outs: Sequence[str], linear_in: Optional[int] = None,
           writes: Sequence[int] = ()) -> Rule:
    """Rule of a packed op; ``roles`` (leading tensor arguments) and ``outs``: ``"x"`` for last dim ``2d``, ``"h"`` for
    ``d``. All Replicate, or all Shard on a leading dim; on the last dim ``_StridedShard(-1, split_factor=2)`` for
    ``"x"`` with ``Shard(-1)`` for ``"h"``; ``linear_in`` and ``writes`` as in :func:`pointwise`."""
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
        return _finish(rule.op_name, out, args, n, len(outs), extra, linear_in, writes)

    return rule


# op name -> rule; arguments and outputs in schema order (pointwise/ops.py)
RULES: Dict[str, Rule] = {
    "geglu": pointwise(2, 1, linear_in=1),  # (gate, up, approximate, inplace_backward) -> out
    "geglu_out": pointwise(3, 0, writes=(0,)),  # (out, gate, up, approximate) -> None
    "geglu_backward": pointwise(3, 2, linear_in=0),  # (grad, gate, up, approximate) -> (d_gate, d_up)
    "geglu_backward_": pointwise(3, 0, writes=(1, 2)),  # (grad, gate, up, approximate) -> None; d_gate, d_up in place
    "geglu_packed": packed(("x",), ("h",)),  # (x, approximate, act_first, inplace_backward) -> out
    "geglu_packed_backward": packed(("h", "x"), ("x",), linear_in=0),  # (grad, x, approximate, act_first) -> dx
    "geglu_packed_backward_": packed(("h", "x"), (), writes=(1,)),  # (grad, x, approximate, act_first) -> None; dx in x
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
