"""The MoE experts' fused gate/up grouped GEMM (``experts.kernels``) and the inference block that uses it
(``experts.ops.fused_forward``, reached through ``layers.GeGLUExperts`` with transformers' grouped_mm implementation).

Without a GPU the kernel runs under the Triton interpreter on CPU tensors (backend 'triton', the row threshold
lowered); with one, the same tests run on CUDA, plus a `gpu` test at Gemma 4 26B-A4B's expert shape.

Exactness. The kernel accumulates in fp32 in its own order and applies the GeGLU to the fp32 accumulators, rounded
once: each element is held to one unit of the storage dtype of the fp64 GeGLU of the same inputs, plus the fp32
accumulation's bound (``test_fused_mlp._assert_within_fp64_bound``). Everything after it in the block is
transformers' grouped_mm forward op for op, which is checked bit for bit by handing transformers' forward the
kernel's output as its gate.
"""

import importlib
import weakref

import pytest
import torch

from .test_fused_mlp import _assert_within_fp64_bound

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
APPROX = ["none", "tanh"]

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def et(geglu):
    return importlib.import_module(geglu.__name__ + ".experts.kernels")


@pytest.fixture
def experts_mod(geglu, monkeypatch):
    """The package's ``experts.ops`` with the shipped rule saying fused at every row count (tiny shapes take the fused
    path where it applies), and the Triton backend on CPU (the interpreter)."""
    mod = importlib.import_module(geglu.__name__ + ".experts.ops")
    monkeypatch.setattr(mod, "fused_rule", lambda rows, device: True)
    restore = geglu.configure(backend="auto" if HAS_CUDA else "triton")
    try:
        yield mod
    finally:
        restore.__exit__()


def _operands(E, D, I, counts, dtype, tail=0):
    """x [S + tail, D] (rows sorted by expert: ``counts[e]`` rows for expert e, then ``tail`` rows past the last
    offset), gate_up_proj [E, 2I, D] scaled like Gemma 4's init, offsets [E] int32; fresh data from the test's
    seeded generator."""
    S = sum(counts)
    x = (torch.randn(S + tail, D) * 2.0).to(dtype).to(DEVICE)
    w = (torch.randn(E, 2 * I, D) * D ** -0.5).to(dtype).to(DEVICE)
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(DEVICE)
    return x, w, offsets


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_experts_rows_within_one_unit_of_fp64(et, dtype, approximate):
    """Experts with no rows, fewer rows than a tile, and rows that end inside a tile (so a tile's last rows belong
    to the next expert), an intermediate size that is not a multiple of the tile: every expert's rows are its own
    fp64 GeGLU within one unit of the dtype plus the accumulation's bound. Computing every row with one expert's
    weights, or a tile's rows with the wrong expert's, fails this."""
    E, D, I = 5, 64, 40
    counts = [37, 0, 5, 70, 19]
    x, w, offsets = _operands(E, D, I, counts, dtype)
    assert et.applies(x, w)
    h = et.grouped_gate_up_geglu(x, w, offsets, approximate == "tanh")
    assert h.shape == (sum(counts), I) and h.dtype == dtype
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            _assert_within_fp64_bound(h[rows], x[rows], w[e, :I], w[e, I:], approximate, f"expert {e}")
        start += n


def test_rows_past_the_last_offset_are_not_written(et):
    """Rows past offsets[-1] (expert parallelism's sentinels) are left as they were, as torch._grouped_mm leaves
    them: the kernel writes no row outside its experts' ranges."""
    x, w, offsets = _operands(3, 32, 32, [9, 20, 4], torch.bfloat16, tail=11)
    sentinel = torch.full((x.shape[0], 32), 7.0, dtype=x.dtype, device=x.device)
    h = et.grouped_gate_up_geglu(x, w, offsets, True, out=sentinel)
    assert h is sentinel
    assert (h[33:] == 7.0).all() and not (h[:33] == 7.0).all(dim=1).any()
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.bfloat16 tensor of shape \(44, 32\)"):
        et.grouped_gate_up_geglu(x, w, offsets, True, out=sentinel[:, :16])


def test_no_expert_writes_nothing(et):
    """E = 0 experts (an expert-parallel rank holding none): no row is written and nothing is launched."""
    x = torch.randn(5, 32).to(torch.bfloat16).to(DEVICE)
    w = torch.empty(0, 64, 32, dtype=x.dtype, device=x.device)
    sentinel = torch.full((5, 32), 7.0, dtype=x.dtype, device=x.device)
    offsets = torch.empty(0, dtype=torch.int32, device=x.device)
    assert et.grouped_gate_up_geglu(x, w, offsets, False, out=sentinel) is sentinel
    assert (sentinel == 7.0).all()


def test_offsets_past_the_rows_write_nothing_outside_them(et):
    """Offsets whose last count runs past x's rows (a caller's bug) make the kernel neither write past the output
    (the store is masked at S, the tile loop stops at the listed tiles) nor read past the schedule."""
    x, w, offsets = _operands(3, 32, 32, [9, 20, 4], torch.bfloat16)
    big = torch.full((x.shape[0] + 40, 32), 7.0, dtype=x.dtype, device=x.device)
    past = offsets.clone()
    past[-1] += 40
    et.grouped_gate_up_geglu(x, w, past, True, out=big[:x.shape[0]])
    assert (big[x.shape[0]:] == 7.0).all()
    assert torch.equal(big[:29], et.grouped_gate_up_geglu(x, w, offsets, True)[:29])  # the experts before the last


def test_schedule_lists_every_tile_once(et):
    """The device-side tile list: expert e owns ceil(rows_e / BLOCK_M) * ceil(I / BLOCK_N) consecutive tile ids,
    the ids past the last tile map to E (the kernel's loop stops at the on-device tile count)."""
    counts = [0, 130, 1, 0, 256, 255]
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    tile_expert, tiles_end, m_tiles, _, bound = et.schedule(offsets, sum(counts), 200, 128, 64)
    expected_m = [(n + 127) // 128 for n in counts]
    assert m_tiles.tolist() == expected_m
    per_expert = [m * 4 for m in expected_m]  # ceil(200 / 64) = 4 column tiles
    assert tiles_end.tolist() == torch.cumsum(torch.tensor(per_expert), 0).tolist()
    total = sum(per_expert)
    assert bound >= total
    assert tile_expert[:total].tolist() == [e for e, n in enumerate(per_expert) for _ in range(n)]
    assert (tile_expert[total:] == len(counts)).all()


# --- the experts block ----------------------------------------------------------------------------------------


def _gemma4_experts(impl="grouped_mm", act="gelu_pytorch_tanh", E=4, D=64, I=64, dtype=torch.bfloat16):
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    config = Gemma4TextConfig(hidden_size=D, num_experts=E, top_k_experts=2, moe_intermediate_size=I,
                              enable_moe_block=True, hidden_activation=act)
    config._experts_implementation = impl
    with torch.device(DEVICE):
        mod = Gemma4TextExperts(config).to(dtype)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0.0, 0.1)
    return mod.eval()


def _routing(mod, tokens):
    D, E, k = mod.gate_up_proj.shape[2], mod.num_experts, 2
    x = torch.randn(tokens, D).to(mod.gate_up_proj.dtype).to(DEVICE)
    probs = torch.randn(tokens, E).softmax(-1)
    w, idx = probs.topk(k, dim=-1)
    return x, idx.to(DEVICE), (w / w.sum(-1, keepdim=True)).to(DEVICE)


def _layer_forward(geglu, mod, *args):
    """The hub layer's forward on the host module, as kernelize binds it."""
    return geglu.layers.GeGLUExperts.forward(mod, *args)


def _always(monkeypatch, experts_mod, answer, calls):
    """The shipped rule answering ``answer``; each question (routed rows, device) goes to ``calls``."""
    def decide(rows, device):
        calls.append((rows, device))
        return answer

    monkeypatch.setattr(experts_mod, "fused_rule", decide)


@pytest.mark.parametrize("approximate", APPROX)
def test_fused_block_is_transformers_grouped_mm_around_the_kernel(geglu, et, experts_mod, monkeypatch,
                                                                  approximate):
    """Where the rule says fused, the block's output is transformers' grouped_mm forward, bit for bit, when that
    forward is handed the kernel's h as its gate (sort, gather, the down grouped GEMM, the routing weights, the
    un-permute and the sum are its own ops); the rule is asked with the routed rows, and nothing is timed."""
    calls = []
    _always(monkeypatch, experts_mod, True, calls)
    act = "gelu_pytorch_tanh" if approximate == "tanh" else "gelu"
    mod = _gemma4_experts(act=act)
    x, idx, w = _routing(mod, 48)
    with torch.no_grad():
        y = _layer_forward(geglu, mod, x, idx, w)
        y2 = _layer_forward(geglu, mod, x, idx, w)
        expert_ids, perm = torch.sort(idx.reshape(-1))
        ids = expert_ids.int() if x.is_cuda else expert_ids.float()
        offsets = torch.cumsum(torch.histc(ids, bins=4, min=0, max=3), 0, dtype=torch.int32)
        h = et.grouped_gate_up_geglu(x[perm // 2], mod.gate_up_proj, offsets, approximate == "tanh")
        mod._apply_gate = lambda gate_up: h
        ref = type(mod).forward(mod, x, idx, w)
    assert [rows for rows, _ in calls] == [idx.numel()] * 2 and torch.equal(y, y2)
    assert torch.equal(y, ref), f"{(y != ref).sum().item()} of {y.numel()} differ"


def test_fused_block_releases_its_buffers_early(geglu, et, experts_mod, monkeypatch):
    """The sorted rows are released before the down projection and h and the down projection's output before the
    un-permute, so that the block's peak memory stays below transformers' (which keeps all three to its end)."""
    refs, alive = {}, {}
    kernel, down, empty_like = et.grouped_gate_up_geglu, experts_mod.grouped_mm, torch.empty_like

    def kernel_spy(x, *args, **kwargs):
        refs["rows"] = weakref.ref(x)
        h = kernel(x, *args, **kwargs)
        refs["h"] = weakref.ref(h)
        return h

    def down_spy(h, w, offsets):
        alive["rows"] = refs["rows"]() is not None
        out = down(h, w, offsets)
        refs["out"] = weakref.ref(out)
        return out

    def empty_like_spy(t, *args, **kwargs):
        if "out" in refs and "h" not in alive:  # the block's inverse permutation
            alive["h"], alive["out"] = refs["h"]() is not None, refs["out"]() is not None
        return empty_like(t, *args, **kwargs)

    monkeypatch.setattr(et, "grouped_gate_up_geglu", kernel_spy)
    monkeypatch.setattr(experts_mod, "grouped_mm", down_spy)
    monkeypatch.setattr(torch, "empty_like", empty_like_spy)
    mod = _gemma4_experts()
    x, idx, w = _routing(mod, 40)
    with torch.no_grad():
        _layer_forward(geglu, mod, x, idx, w)
    assert alive == {"rows": False, "h": False, "out": False}, alive


def test_fused_block_only_where_the_rule_allows(geglu, experts_mod, monkeypatch):
    """transformers' own block (with our packed gate) runs, bit-exact with the host, when the shipped rule says the
    fused block is not faster, with the fused_mlp setting off, with a gradient, with another experts implementation
    and with an activation the kernel does not compute (the rule is not even asked then); only grouped_mm in
    inference takes the fused block, where the rule says so."""
    calls = []
    _always(monkeypatch, experts_mod, False, calls)
    mod = _gemma4_experts()
    x, idx, w = _routing(mod, 48)
    with torch.no_grad():
        host = type(mod).forward(mod, x, idx, w)
        assert torch.equal(_layer_forward(geglu, mod, x, idx, w), host) and len(calls) == 1  # the rule says no
    _always(monkeypatch, experts_mod, True, calls)
    with torch.no_grad(), geglu.configure(fused_mlp=False):
        assert torch.equal(_layer_forward(geglu, mod, x, idx, w), host) and len(calls) == 1
    leaf = x.detach().clone().requires_grad_()
    y = _layer_forward(geglu, mod, leaf, idx, w)
    assert torch.equal(y.detach(), host) and len(calls) == 1 and y.grad_fn is not None
    for impl in ("batched_mm", "eager"):
        other = _gemma4_experts(impl=impl)
        with torch.no_grad():
            _layer_forward(geglu, other, x, idx, w)
        assert len(calls) == 1, impl
    relu = _gemma4_experts(act="relu")
    with torch.no_grad():
        assert torch.equal(_layer_forward(geglu, relu, x, idx, w), type(relu).forward(relu, x, idx, w))
    assert len(calls) == 1
    with torch.no_grad():
        y = _layer_forward(geglu, mod, x, idx, w)
    assert len(calls) == 2 and not torch.equal(y, host)  # the fused block: its own (more accurate) bits


def test_shipped_rows_rule(geglu, monkeypatch):
    """The shipped rule: from FUSED_RULES' min_rows routed rows for the GPU's architecture, never on one without an
    entry; always on CPU tensors (the interpreter)."""
    mod = importlib.import_module(geglu.__name__ + ".experts.ops")
    backend = importlib.import_module(geglu.__name__ + ".runtime.backend")
    monkeypatch.setattr(backend, "capability_major", lambda device: 9)
    cuda = torch.device("cuda", 0)
    rows = mod.FUSED_RULES[9]["min_rows"]
    assert not mod.fused_rule(rows - 1, cuda) and mod.fused_rule(rows, cuda)
    monkeypatch.setattr(backend, "capability_major", lambda device: 8)
    assert not mod.fused_rule(1 << 30, cuda)
    assert mod.fused_rule(1, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("approximate", APPROX)
def test_gpu_gemma4_26b_expert_shape_within_bound(et, approximate):
    """Gemma 4 26B-A4B's experts (hidden 2816, I = 704: 5.5 tiles of 128 columns) with 2048 tokens routed top-8 over
    128 experts (uneven row counts, some experts empty): every row within the fp64 bound, on the device's default
    tile."""
    E, D, I = 128, 2816, 704
    counts = torch.multinomial(torch.rand(E) ** 2, 2048 * 8, replacement=True).bincount(minlength=E)
    counts[:3] = 0
    x, w, offsets = _operands(E, D, I, counts.tolist(), torch.bfloat16)
    h = et.grouped_gate_up_geglu(x, w, offsets, approximate == "tanh")
    for e in range(0, E, 9):  # a sample of experts (fp64 GEMMs on the GPU)
        n = int(counts[e])
        s = int(offsets[e]) - n
        if n:
            _assert_within_fp64_bound(h[s:s + n], x[s:s + n], w[e, :I], w[e, I:], approximate, f"expert {e}")
