"""The host-side logic of the eager fast paths (runs on any machine; the GPU sweep in test_gpu.py runs the paths
themselves): the overlap rules of the ctypes path, the flat-kernel plan, the Triton direct launch's key and hook
check, and the `auto` routing of small autograd calls."""

import importlib

import pytest
import torch


@pytest.fixture(scope="module")
def mods(geglu):
    return {name: importlib.import_module(f"{geglu.__name__}.{name}")
            for name in ("runtime.direct", "pointwise.kernels", "runtime.launch", "runtime.backend")}


def test_output_overlap_rules(mods):
    safe = mods["runtime.direct"]._safe_output
    buf = torch.zeros(4, 64)
    gate, up = buf[:, :32], buf[:, 32:]  # the disjoint halves of a packed tensor (row stride 64)
    fresh = torch.empty(4, 32)
    assert safe(fresh, 4, 32, (gate, up))
    assert safe(gate, 4, 32, (gate, up)) is False  # exact alias of gate, but up's rows interleave (conservative)
    assert safe(gate, 4, 32, (gate,))  # exactly an input: allowed (each element is read before it is written)
    shifted = buf.as_strided((4, 32), (64, 1), 1)  # gate moved by one element: a partial overlap
    assert safe(shifted, 4, 32, (gate,)) is False
    rows_overlap = torch.zeros(200).as_strided((4, 32), (16, 1))  # row stride < d: rows overlap each other
    assert safe(rows_overlap, 4, 32, (fresh,)) is False
    other = torch.empty(4, 32)
    assert safe(fresh, 4, 32, (gate,), (other,))
    assert safe(fresh, 4, 32, (gate,), (fresh,)) is False  # two outputs on one buffer


def test_flat_plan(mods):
    tr = mods["pointwise.kernels"]
    a = torch.zeros(8, 64)
    assert tr._flat(8, 64, a, a.clone())
    packed = torch.zeros(8, 128)
    assert not tr._flat(8, 64, packed[:, :64], a)
    assert tr._flat(1, 64, packed[:1, :64], a[:1])  # one row: flat whatever the row stride
    tr._flat_plan.cache_clear()
    block = tr.FLAT_TILES[2][0]
    t = torch.zeros(2, dtype=torch.bfloat16)
    grid, blk, warps, even, wide = tr._flat_plan(4096 * block, t.element_size(), t.device)
    assert (blk, even, wide) == (block, True, False) and grid == (4096,)
    _, _, _, even, _ = tr._flat_plan(4096 * block + 3, t.element_size(), t.device)
    assert not even
    _, _, _, _, wide = tr._flat_plan(2**31, t.element_size(), t.device)
    assert wide  # 64-bit offsets from 2^31 - block elements on
    grid, blk, _, _, _ = tr._flat_plan(1000, t.element_size(), t.device)  # small: narrower blocks, so that several programs run
    assert blk < block and grid[0] * blk >= 1000


def test_direct_launch_key_and_hooks(mods, monkeypatch):
    tr = mods["runtime.launch"]
    base = torch.zeros(64, dtype=torch.bfloat16)
    assert tr._spec(base) == (torch.bfloat16, True)
    assert tr._spec(base[1:]) == (torch.bfloat16, False)  # 2-byte offset: not 16-byte aligned
    assert tr._spec(32) == (True, False, True, True) and tr._spec(1) == (False, True, True, True)
    assert tr._spec(2**40)[2] is False  # does not fit in 32 bits: Triton passes it as a 64-bit integer
    knobs = getattr(triton_module(), "knobs", None)
    if knobs is None:
        pytest.skip("this Triton has no knobs module")

    class Chain:
        def __init__(self, calls):
            self.calls = calls

    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", Chain([]))
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", Chain([]))
    assert not tr._hooks_set()  # empty chains (Triton >= 3.5's default): the direct path may run
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", Chain([print]))
    assert tr._hooks_set()  # a profiler's hook: Triton's own launch, which calls it
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    assert not tr._hooks_set()


def triton_module():
    import triton

    return triton


def test_auto_autograd_routing_rule(geglu, mods):
    be = mods["runtime.backend"]
    try:
        geglu.set_backend("auto")
        assert be.eager_autograd(be.AUTOGRAD_EAGER_BELOW - 1) and not be.eager_autograd(be.AUTOGRAD_EAGER_BELOW)
        geglu.set_backend("triton")
        assert not be.eager_autograd(16)  # an explicit backend always runs the kernels
    finally:
        geglu.set_backend("auto")
