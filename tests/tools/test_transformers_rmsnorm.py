"""Gemma's RMSNorm in transformers models: the classes of NORM_CLASSES, swapped by kernels' kernelize for the hub
layers GemmaRMSNorm and Gemma3nRMSNorm of a local build of this checkout (``kernels.LocalLayerRepository``: no Hub
needed, so the checks run in this process).

* The table: every supported class has its layer's host forward (GemmaRMSNorm's or Gemma3nRMSNorm's, source
  compared), the unsupported ones differ from both, and no other class of transformers 5.22.2 has either.
* Every supported class as a single module (Gemma 3n's form also with ``with_scale=False``), and tiny random
  Gemma 3, Gemma 2 and Gemma 4 (MoE) models (their GeGLU MLPs and experts kernelized too): on CPU bit-exact with eager (logits, loss, every gradient); with the Triton kernels (the
  interpreter here, the GPU where there is one) each norm within its bound (docs/rmsnorm.md) and the model's
  outputs and gradients within RTOL of eager's, normwise: ``max|ours - eager| <= RTOL * max|eager|`` per tensor.
* Each check counts the calls of the loaded kernel's implementations: a test cannot pass because nothing ran.
"""

from __future__ import annotations

import ast
import copy
import importlib
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping  # noqa: E402

from kerneltools.transformers_kernels import (  # noqa: E402
    KEY_PREFIX, NORM_CLASSES, NOT_SUPPORTED, register_geglu_kernels)
from tests.kernel._rmsnorm_reference import Calls, assert_bwd_bound, assert_fwd_bound, data, seed_of  # noqa: E402
from tests.kernel._rmsnorm_reference import norm_impl  # noqa: E402, F401  (the fixture)
from toolhelpers import class_methods, methods_of  # noqa: E402

RTOL = 1e-5  # observed worst case under the interpreter: logits 3.7e-7, loss 9.8e-8, gradients 1.6e-6
SUPPORTED = [h for h in NORM_CLASSES if h.status != NOT_SUPPORTED]
GROUPED = {"Qwen4ExpTextRMSNorm"}  # Gemma's forward when group_size is None (the registration's condition)


# each layer's host class, and a text that every file defining a class with that forward contains
FORMS = {"GemmaRMSNorm": ("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm", "1.0 + self.weight.float()"),
         "Gemma3nRMSNorm": ("transformers.models.gemma3n.modeling_gemma3n", "Gemma3nRMSNorm",
                            "torch.pow(mean_squared, -0.5)")}
SCALED = "Gemma3nRMSNorm"  # the layer of Gemma 3n's form: scale w, offset 0, optional weight


def _form_methods(layer: str) -> dict:
    module, name, _ = FORMS[layer]
    m = class_methods(getattr(importlib.import_module(module), name))
    return {k: m[k] for k in ("__init__", "forward", "_norm") if k in m and (k != "__init__" or layer == SCALED)}


def test_the_table_is_every_class_with_a_layers_forward():
    refs = {layer: _form_methods(layer) for layer in FORMS}
    for h in NORM_CLASSES:
        cls = h.load()
        assert cls is not None, f"{h.module}.{h.name} is missing from transformers {transformers.__version__}"
        m = class_methods(cls)
        same = {layer: {k: m.get(k) == v for k, v in ref.items()} for layer, ref in refs.items()}
        if h.status == NOT_SUPPORTED:
            assert not any(all(v.values()) for v in same.values()), f"{h.name} has a layer's forward: support it"
        elif h.name in GROUPED:
            assert same[h.layer]["forward"] and not same[h.layer]["_norm"], h.name
        else:
            assert all(same[h.layer].values()), f"{h.name}'s methods differ from {h.layer}'s: {same[h.layer]}"
    # no other class of transformers has either (the text filter keeps the scan to the files that can)
    for layer, ref in refs.items():
        found = set()
        for path in sorted(Path(transformers.__file__).parent.glob("models/*/modeling_*.py")):
            text = path.read_text()
            if FORMS[layer][2] not in text:
                continue
            for node in ast.parse(text).body:
                if isinstance(node, ast.ClassDef):
                    m = methods_of(node)
                    if all(m.get(k) == v for k, v in ref.items()):
                        found.add(node.name)
        assert found == {h.name for h in SUPPORTED if h.layer == layer} - GROUPED, layer


def test_registration_maps_the_norms_unless_told_not_to():
    from kernels import Mode

    reg = register_geglu_kernels(register=False)
    for layer in FORMS:  # the eager modes only: under torch.compile a norm keeps the host's forward (COMPILE_LAYERS)
        key = KEY_PREFIX + layer
        assert set(reg.mapping[key]) == {"cuda", "cpu"}
        assert set(reg.mapping[key]["cpu"]) == {Mode.INFERENCE, Mode.TRAINING}, reg.mapping[key]["cpu"]
    assert {f"{h.module}.{h.name}" for h in SUPPORTED} <= set(reg.classes)
    assert all(h.load().kernel_layer_name == KEY_PREFIX + h.layer for h in SUPPORTED)
    off = register_geglu_kernels(register=False, norms=False)
    assert not any(KEY_PREFIX + layer in off.mapping for layer in FORMS)
    assert not any("RMSNorm" in c for c in off.classes)
    assert KEY_PREFIX + "GeGLUMLP" in off.mapping


# ----------------------------------------------------------------------------------------------------------------
# kernelize with the local build
# ----------------------------------------------------------------------------------------------------------------


def _mapping(build_dir, device):
    register_geglu_kernels(register=False)  # gives the classes their keys; the mapping is the local build's
    return {KEY_PREFIX + layer: {device: LocalLayerRepository(repo_path=build_dir, layer_name=layer)}
            for layer in (*FORMS, "GeGLUMLP", "GeGLUExperts", "GeGLUExpertsGate")}


def _expected(name: str, count: int, backward: bool, layer: str = "GemmaRMSNorm") -> dict:
    if name == "cpu":  # eager autograd records the CPU implementation's ops: no backward of ours
        return {"rmsnorm.ops.scaled_host_forward" if layer == SCALED else "rmsnorm.ops.cpu_forward": count}
    return {"rmsnorm.kernels.forward": count, **({"rmsnorm.kernels.backward": count} if backward else {})}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0


# (class, with_scale): Gemma 3n's form also without its weight
CASES = [(h, True) for h in SUPPORTED] + [(h, False) for h in SUPPORTED if h.layer == SCALED]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("row,with_scale", CASES,
                         ids=[h.name + ("" if ws else "-no-scale") for h, ws in CASES])
def test_every_supported_class_as_a_module(norm_impl, build_dir, monkeypatch, row, with_scale, dtype):
    name, device = norm_impl
    seed = seed_of("module", row.name, with_scale, dtype)
    x, w, dy = data((2, 5, 48), dtype, dtype, 1.0, seed, device)
    ref = row.load()(48, eps=1e-6, **({} if with_scale else {"with_scale": False})).to(device=device, dtype=dtype)
    if with_scale:
        with torch.no_grad():
            ref.weight.copy_(w)
    else:
        w = torch.ones(48, device=device)  # the bound's scale
    offset = 0.0 if row.layer == SCALED else 1.0
    mod = copy.deepcopy(ref)
    with use_kernel_mapping(_mapping(build_dir, device), inherit_mapping=False):
        kernelize(mod, mode=Mode.TRAINING, device=device)
    assert mod.forward.__func__.__qualname__ == f"{row.layer}.forward"
    calls = Calls(mod.forward.__func__.__module__.split(".", 1)[0], monkeypatch)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_ref = mod(xa), ref(xb)
    y.backward(dy)
    y_ref.backward(dy)
    assert calls.take() == _expected(name, 1, True, row.layer)
    dw, dw_ref = (mod.weight.grad, ref.weight.grad) if with_scale else (None, None)
    if name == "cpu":
        assert torch.equal(y, y_ref) and torch.equal(xa.grad, xb.grad)
        assert not with_scale or torch.equal(dw, dw_ref)
        return
    what = f"{row.name} with_scale={with_scale} seed {seed}"
    assert_fwd_bound(y.detach(), x, w, 1e-6, offset, what=what)
    assert_bwd_bound(xa.grad, dw, x, w, dy, 1e-6, offset, what=what)


def test_grouped_norm_keeps_its_own_forward(norm_impl, build_dir):
    name, device = norm_impl
    cls = next(h for h in SUPPORTED if h.name in GROUPED).load()
    grouped, plain = cls(48, group_size=16).to(device), cls(48).to(device)
    with use_kernel_mapping(_mapping(build_dir, device), inherit_mapping=False):
        kernelize(grouped, mode=Mode.INFERENCE, device=device)
        kernelize(plain, mode=Mode.INFERENCE, device=device)
    assert "forward" not in grouped.__dict__, "a grouped norm was swapped"
    assert plain.forward.__func__.__qualname__ == "GemmaRMSNorm.forward"


L = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
         head_dim=16, vocab_size=128, max_position_embeddings=64, sliding_window=16, query_pre_attn_scalar=16)
# (config, model, config kwargs, norm class, norms per forward)
MODELS = {
    # per layer: input, post-attention, pre- and post-feedforward norms, q_norm, k_norm; then the final norm
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(L, layer_types=["sliding_attention", "full_attention"]),
               "Gemma3RMSNorm", 2 * 6 + 1),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", L, "Gemma2RMSNorm", 2 * 4 + 1),
    # per layer: input, post-attention, pre- and post-feedforward norms, q/k/v_norm, the router's, the experts'
    # pre-norm and the two post-norms of the dense MLP and the experts; then the final norm
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM",
               dict(L, layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                    enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                    hidden_activation="gelu_pytorch_tanh"),
               "Gemma4RMSNorm", 2 * 11 + 1),
}


def _model(family, device, seed):
    cfg_name, model_name, kwargs, norm_name, _ = MODELS[family]
    config = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    ref = getattr(transformers, model_name)(config).to(device).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in ref.modules():  # transformers starts Gemma's norm weights at 0 (a scale of 1): make them count
            if type(m).__name__ == norm_name and getattr(m, "weight", None) is not None:
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.5)
    return ref, copy.deepcopy(ref), norm_name


@pytest.mark.parametrize("family", list(MODELS))
def test_tiny_model_inference_and_training(norm_impl, build_dir, monkeypatch, family):
    name, device = norm_impl
    seed = seed_of("model", family)
    ref, model, norm_name = _model(family, device, seed)
    count = MODELS[family][4]
    mapping = _mapping(build_dir, device)
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(model, mode=Mode.INFERENCE, device=device)
    layer = next(h.layer for h in SUPPORTED if h.name == norm_name)
    norms = [m for m in model.modules() if type(m).__name__ == norm_name]
    assert len(norms) == count and all(m.forward.__func__.__qualname__ == f"{layer}.forward" for m in norms)
    calls = Calls(norms[0].forward.__func__.__module__.split(".", 1)[0], monkeypatch)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (2, 8), generator=g).to(device)
    labels = torch.randint(3, 128, (2, 8), generator=g).to(device)

    with torch.no_grad():
        logits, ref_logits = model(ids).logits, ref(ids).logits
    assert calls.take() == _expected(name, count, False, layer)

    model.train(), ref.train()
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(model, mode=Mode.TRAINING, device=device)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    assert calls.take() == _expected(name, count, True, layer)
    ref_loss = ref(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    grads = [(n, p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), ref.parameters())]
    assert all(a is not None and b is not None for _, a, b in grads)
    if name == "cpu":
        assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)
        for n, a, b in grads:
            assert torch.equal(a, b), f"gradient of {n}"
        return
    assert _rel(logits, ref_logits) <= RTOL, f"logits: {_rel(logits, ref_logits):.3g}"
    assert _rel(loss, ref_loss) <= RTOL
    worst = max(grads, key=lambda t: _rel(t[1], t[2]))
    assert _rel(worst[1], worst[2]) <= RTOL, f"gradient of {worst[0]}: {_rel(worst[1], worst[2]):.3g}"
