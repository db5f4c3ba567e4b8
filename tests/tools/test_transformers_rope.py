"""The Gemma rotary embeddings (ROPE_CLASSES), swapped by kernels' kernelize for the hub layers RotaryEmbedding and
LayerTypeRotaryEmbedding of a local build of this checkout.

* The table: every class's forward is one of the two host forms op for op (source compared), so the op computes
  its formula.
* Eager: a kernelized model's rotary embedding runs the host's forward (same bits, the op not called).
* torch.compile: from ``ROPE_OP_MIN_ROWS`` positions on, the traced graph calls the op ``rope_cos_sin`` (Inductor
  then reads cos and sin instead of recomputing them per layer), whose outputs equal the host's eager cos and sin
  bit for bit; fewer positions trace the host's forward (no op); with dynamic shapes each side of the rule gets its
  graph. The compiled kernelized model's logits equal those of the host compiled with the same backend.
* A dynamic rope table keeps its own forward (its inv_freq changes inside the host's forward).
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")
from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping  # noqa: E402

from kerneltools.transformers_kernels import KEY_PREFIX, ROPE_CLASSES, register_geglu_kernels  # noqa: E402
from toolhelpers import class_methods  # noqa: E402

# each layer's host form: the class whose forward every class of the layer has
FORMS = {"RotaryEmbedding": ("transformers.models.gemma2.modeling_gemma2", "Gemma2RotaryEmbedding"),
         "LayerTypeRotaryEmbedding": ("transformers.models.gemma3.modeling_gemma3", "Gemma3RotaryEmbedding")}


def test_every_class_has_its_layers_host_forward():
    refs = {layer: class_methods(getattr(importlib.import_module(m), n))["forward"] for layer, (m, n) in FORMS.items()}
    assert refs["RotaryEmbedding"] != refs["LayerTypeRotaryEmbedding"]
    for h in ROPE_CLASSES:
        cls = h.load()
        assert cls is not None, f"{h.module}.{h.name} is missing from transformers {transformers.__version__}"
        assert class_methods(cls)["forward"] == refs[h.layer], f"{h.name}'s forward differs from {FORMS[h.layer][1]}'s"


def test_registration_maps_every_class_unless_rope_is_off():
    reg = register_geglu_kernels(register=False)
    for h in ROPE_CLASSES:
        assert KEY_PREFIX + h.layer in reg.mapping and h.load().kernel_layer_name == KEY_PREFIX + h.layer
    off = register_geglu_kernels(register=False, rope=False)
    assert not any(KEY_PREFIX + layer in off.mapping for layer in FORMS)


def _mapping(build_dir):
    register_geglu_kernels(register=False)  # gives the classes their keys; the mapping is the local build's
    return {KEY_PREFIX + layer: {"cpu": LocalLayerRepository(repo_path=build_dir, layer_name=layer)}
            for layer in (*FORMS, "GeGLUMLP", "GemmaRMSNorm")}


def _tiny(family: str, rope_parameters=None):
    if family == "gemma3":
        cfg = transformers.Gemma3TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                            vocab_size=128, sliding_window=8)
        cls = transformers.Gemma3ForCausalLM
    else:
        cfg = transformers.Gemma2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=128,
                                        sliding_window=8, rope_parameters=rope_parameters)
        cls = transformers.Gemma2ForCausalLM
    torch.manual_seed(0)
    return cls(cfg).eval()


def _cos_sin(model, positions, x):
    rot = model.model.rotary_emb
    types_ = sorted(set(model.config.layer_types)) if isinstance(getattr(rot, "rope_type", None), dict) else [None]
    return {t: rot(x, positions) if t is None else rot(x, positions, t) for t in types_}


class _OpsCalled(TorchDispatchMode):
    """The names of the operators called inside the block."""

    def __enter__(self):
        self.ops = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _ours(module) -> bool:
    """Whether kernelize bound one of our rotary layers' forward to ``module``."""
    fwd = module.__dict__.get("forward")
    return fwd is not None and fwd.__func__.__qualname__.rpartition(".")[0] in FORMS


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 1024), (3, 17)], ids=["2048-positions", "51-positions"])
def test_eager_runs_the_hosts_forward_and_compile_the_op(build_dir, family, dtype, shape):
    host = _tiny(family).to(dtype)
    kern = copy.deepcopy(host)
    with use_kernel_mapping(_mapping(build_dir), inherit_mapping=False):
        kernelize(kern, mode=Mode.INFERENCE | Mode.TORCH_COMPILE, device="cpu")
    rot = kern.model.rotary_emb
    assert _ours(rot) and type(rot) is type(host.model.rotary_emb)
    g = torch.Generator().manual_seed(hash((family, str(dtype))) % 2**31)
    positions = torch.randint(0, 4096, shape, generator=g)
    x = torch.randn(*shape, 64, dtype=dtype, generator=g)
    want = _cos_sin(host, positions, x)
    with _OpsCalled() as called:
        got = _cos_sin(kern, positions, x)
    assert called.ops and not any("rope_cos_sin" in op for op in called.ops), called.ops  # the host's own ops
    for t in want:
        assert all(torch.equal(a, b) and a.dtype == dtype for a, b in zip(got[t], want[t])), t

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda p, x: _cos_sin(kern, p, x), backend=backend, fullgraph=True)
    got = compiled(positions, x)
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    own_cos = [t for t in targets if "cos" in t and "rope" not in t]
    if positions.numel() >= _min_rows(build_dir):
        assert sum("rope_cos_sin" in t for t in targets) == len(want), targets
        assert not own_cos, targets  # no cos of its own left in the graph
    else:  # the host's forward, traced
        assert not any("rope_cos_sin" in t for t in targets), targets
    for t in want:
        assert all(torch.equal(a, b) for a, b in zip(got[t], want[t])), t


def _min_rows(build_dir) -> int:
    """``ROPE_OP_MIN_ROWS`` of the build's package (the copy kernelize loads)."""
    import ast

    (rope,) = build_dir.glob("torch-cpu/_rope.py")
    tree = ast.parse(rope.read_text())
    (value,) = [n.value.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "ROPE_OP_MIN_ROWS"]
    return value


def test_dynamic_shapes_get_a_graph_per_side_of_the_rule(build_dir):
    """With dynamic positions the rule is one guard on the symbolic count: the lengths below it share the host's
    graph, those from it on the op's, and every output equals the host's eager cos and sin."""
    host = _tiny("gemma3")
    kern = copy.deepcopy(host)
    with use_kernel_mapping(_mapping(build_dir), inherit_mapping=False):
        kernelize(kern, mode=Mode.INFERENCE | Mode.TORCH_COMPILE, device="cpu")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda p, x: _cos_sin(kern, p, x), backend=backend, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(5)
    n = _min_rows(build_dir)
    for length in (17, 40, n - 1, n, n + 300, 23):
        positions = torch.randint(0, 4096, (1, length), generator=g)
        x = torch.randn(1, length, 64, generator=g)
        got, want = compiled(positions, x), _cos_sin(host, positions, x)
        for t in want:
            assert all(torch.equal(a, b) for a, b in zip(got[t], want[t])), (length, t)
    assert len(graphs) == 2, graphs
    assert [any("rope_cos_sin" in t for t in gr) for gr in graphs] == [False, True], graphs


def test_compiled_model_logits_equal_the_compiled_hosts(build_dir):
    host = _tiny("gemma3")
    kern = copy.deepcopy(host)
    with use_kernel_mapping({k: v for k, v in _mapping(build_dir).items() if "Rotary" in k}, inherit_mapping=False):
        kernelize(kern, mode=Mode.INFERENCE | Mode.TORCH_COMPILE, device="cpu")
    ids = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(7))
    torch._dynamo.reset()
    with torch.no_grad():
        want = torch.compile(host, backend="aot_eager")(ids).logits
        got = torch.compile(kern, backend="aot_eager")(ids).logits
    assert torch.equal(got, want)  # aot_eager runs eager's ops, and the op is the host's formula op for op


def test_dynamic_rope_keeps_its_own_forward(build_dir):
    model = _tiny("gemma2", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with use_kernel_mapping(_mapping(build_dir), inherit_mapping=False):
        kernelize(model, mode=Mode.INFERENCE | Mode.TORCH_COMPILE, device="cpu")
    assert model.model.rotary_emb.rope_type == "dynamic" and not _ours(model.model.rotary_emb)


def test_the_op_passes_opcheck(geglu):
    op = getattr(geglu.ops, "rope_cos_sin", None)
    assert op is not None, "the build's ops namespace lacks rope_cos_sin"
    g = torch.Generator().manual_seed(11)
    for shape, dtype in (((1, 9), torch.bfloat16), ((2, 5), torch.float32)):
        pos = torch.randint(0, 1000, shape, generator=g)
        inv = torch.rand(8, generator=g)
        torch.library.opcheck(op.default, (pos, inv, 0.5, dtype))
