"""The transformers checks, run in a fresh process by test_transformers_kernelize.py.

kernels and huggingface_hub read HF_ENDPOINT, KERNELS_CACHE and DISABLE_KERNEL_MAPPING when first imported, and the
pytest process may have imported them already (tests/conftest.py loads kernels), so the checks that load the kernel
from the loopback Hub run here, in a process started with that environment. This script measures and reports JSON;
the assertions (and the tolerances) are in the test module.

    python transformers_worker.py full OUT.json        # HF_ENDPOINT, KERNELS_CACHE, GEGLU_REPO_ID, GEGLU_WORK_DIR set
    python transformers_worker.py disabled OUT.json    # the same with DISABLE_KERNEL_MAPPING=1

The tables below are plain data, so the test module imports this file (without torch or transformers) to
parametrize its tests.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

L = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
         head_dim=16, vocab_size=128, max_position_embeddings=64)
T5 = dict(vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, relative_attention_num_buckets=8,
          decoder_start_token_id=0, feed_forward_proj="gated-gelu")
GEMMA3N = dict(L, num_kv_shared_layers=0, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,
               altup_num_inputs=2, laurel_rank=4, activation_sparsity_pattern=[0.95, 0.0],
               layer_types=["sliding_attention", "full_attention"], sliding_window=16, intermediate_size=[64, 64])
MODERNBERT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  max_position_embeddings=64, local_attention=16, pad_token_id=0)
T5GEMMA_MODULE = dict(L, sliding_window=16, query_pre_attn_scalar=16,
                      layer_types=["sliding_attention", "full_attention"])

# Whole models: (config class, model class, config kwargs, host class, hub layer, kind). kind: causal (logits,
# generate), seq2seq (decoder inputs, generate), mlm (masked LM: no generate).
FAMILIES = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", L, "GemmaMLP", "GeGLUMLP", "causal"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(L, sliding_window=16, query_pre_attn_scalar=16),
               "Gemma2MLP", "GeGLUMLP", "causal"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(L, sliding_window=16, query_pre_attn_scalar=16,
                    layer_types=["sliding_attention", "full_attention"]), "Gemma3MLP", "GeGLUMLP", "causal"),
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM", GEMMA3N, "Gemma3nTextMLP", "Gemma3nGeGLUMLP", "causal"),
    "t5gemma": ("T5GemmaConfig", "T5GemmaForConditionalGeneration",
                dict(encoder=T5GEMMA_MODULE, decoder=T5GEMMA_MODULE, dropout_rate=0.1, vocab_size=128,
                     decoder_start_token_id=0, pad_token_id=0, bos_token_id=2, eos_token_id=1),
                "T5GemmaMLP", "GeGLUMLPWithDropout", "seq2seq"),
    "t5": ("T5Config", "T5ForConditionalGeneration", T5, "T5DenseGatedActDense", "T5GeGLUDense", "seq2seq"),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration", T5, "MT5DenseGatedActDense", "T5GeGLUDense", "seq2seq"),
    "umt5": ("UMT5Config", "UMT5ForConditionalGeneration", T5, "UMT5DenseGatedActDense", "T5GeGLUDense", "seq2seq"),
    "modernbert": ("ModernBertConfig", "ModernBertForMaskedLM", MODERNBERT, "ModernBertMLP", "ModernBertGeGLUMLP",
                   "mlm"),
    "modernbert_decoder": ("ModernBertDecoderConfig", "ModernBertDecoderForCausalLM",
                           dict(MODERNBERT, bos_token_id=1, eos_token_id=2),
                           "ModernBertDecoderMLP", "ModernBertGeGLUMLP", "causal"),
}

# Models whose activation is not a GELU: (family, config overrides). Their MLPs must keep their own forward.
NON_GELU = {
    "gemma_relu": ("gemma", dict(hidden_act="relu")),
    "t5_gated_relu": ("t5", dict(feed_forward_proj="gated-relu")),
    "modernbert_silu": ("modernbert", dict(hidden_activation="silu")),
}

V = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
RANDN = "<a random input shaped like x>"  # a forward keyword argument that check_module draws
# Single host modules, one per supported class of GEGLU_CLASSES (and a few variants, "Class[variant]"): (config
# class, config kwargs, constructor kwargs, forward kwargs[, options]). The host is built as cls(config, **ctor);
# options: dtype (default float32) and fp32 (submodules kept in float32).
MODULES = {
    "GemmaMLP": ("GemmaConfig", L, {}, {}),
    "Gemma2MLP": ("Gemma2Config", L, {}, {}),
    "Gemma3MLP": ("Gemma3TextConfig", L, {}, {}),
    "Gemma4TextMLP": ("Gemma4TextConfig", L, dict(layer_idx=0), {}),
    "Gemma4VisionMLP": ("Gemma4VisionConfig", dict(V, use_clipped_linears=True), {}, {}),
    "Gemma4UnifiedTextMLP": ("Gemma4UnifiedTextConfig", L, dict(layer_idx=0), {}),
    "EmbeddingGemma2MLP": ("EmbeddingGemma2TextConfig", L, {}, {}),
    "VaultGemmaMLP": ("VaultGemmaConfig", L, {}, {}),
    "DiffusionGemmaText4MLP": ("DiffusionGemmaTextConfig", L, dict(layer_idx=0), {}),
    "RecurrentGemmaMlp": ("RecurrentGemmaConfig", dict(hidden_size=32, intermediate_size=128), {}, {}),
    "ZambaMLP": ("ZambaConfig", dict(L, layers_block_type=["linear_attention", "hybrid"]), {}, {}),
    "PixtralMLP": ("PixtralVisionConfig", V, {}, {}),
    "DINOv3ViTGatedMLP": ("DINOv3ViTConfig", dict(V, use_gated_mlp=True, mlp_bias=True), {}, {}),
    "EomtDinov3GatedMLP": ("EomtDinov3Config", dict(V, use_gated_mlp=True), {}, {}),
    # forward(inputs_embeds, self_conditioning_signal): x is inputs_embeds, the signal a second random input
    "DiffusionGemmaSelfConditioning": ("DiffusionGemmaTextConfig", L, {}, dict(self_conditioning_signal=RANDN)),
    "T5GemmaMLP": ("T5GemmaModuleConfig", dict(L, dropout_rate=0.1), {}, {}),
    "T5Gemma2MLP": ("T5Gemma2TextConfig", dict(L, dropout_rate=0.1), {}, {}),
    "GteMLP": ("GteConfig", dict(V, hidden_dropout_prob=0.1), {}, {}),
    "Gemma3nTextMLP[sparse]": ("Gemma3nTextConfig", GEMMA3N, dict(layer_idx=0), {}),
    "Gemma3nTextMLP": ("Gemma3nTextConfig", GEMMA3N, dict(layer_idx=1), {}),
    "T5DenseGatedActDense": ("T5Config", T5, {}, {}),
    # bf16 with wo kept in fp32, as T5's _keep_in_fp32_modules does: the cast to wo.weight.dtype must happen
    # (gelu_pytorch_tanh, so that the bf16 result is bit-exact too)
    "T5DenseGatedActDense[bf16]": ("T5Config", dict(T5, feed_forward_proj="gated-gelu_pytorch_tanh"), {}, {},
                                   dict(dtype="bfloat16", fp32=["wo"])),
    "GemmaMLP[bf16]": ("GemmaConfig", L, {}, {}, dict(dtype="bfloat16")),
    "MT5DenseGatedActDense": ("MT5Config", T5, {}, {}),
    "UMT5DenseGatedActDense": ("UMT5Config", T5, {}, {}),
    "LongT5DenseGatedActDense": ("LongT5Config", T5, {}, {}),
    "UdopDenseGatedActDense": ("UdopConfig", T5, {}, {}),
    "Pix2StructTextDenseGatedActDense": ("Pix2StructTextConfig", dict(hidden_size=32, d_ff=64), {}, {}),
    "Pix2StructVisionMlp": ("Pix2StructVisionConfig", dict(hidden_size=32, d_ff=64), {}, {}),
    "Kosmos2_5VisionMlp": ("Kosmos2_5VisionConfig", V, {}, {}),
    "ModernBertMLP": ("ModernBertConfig", dict(MODERNBERT, mlp_bias=True), {}, {}),
    "ModernBertDecoderMLP": ("ModernBertDecoderConfig", MODERNBERT, {}, {}),
    "Zamba2MLP": ("Zamba2Config", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_mem_blocks=1,
                                      layers_block_type=["linear_attention", "hybrid"] * 2, adapter_rank=4,
                                      mamba_d_state=8, num_attention_heads=2, vocab_size=128),
                  dict(num_fwd_mem_blocks=2, block_id=0), dict(layer_idx=1)),
    "ClvpGatedLinearUnit": ("ClvpEncoderConfig", dict(hidden_size=32, intermediate_size=64), {}, {}),
    "CpmAntDenseGatedACT": ("CpmAntConfig", dict(hidden_size=32, dim_ff=64), {}, {}),
}


# MoE (Gemma 4 with its MoE block, DiffusionGemma's encoder): moe_intermediate_size 64, a multiple of 32 (as Gemma 4
# 26B-A4B's 704): eager's CPU kernels round the last (width mod 32) elements of each strided chunk row like the
# contiguous tensors the kernel computes on only then (the test module says more).
MOE = dict(L, num_experts=4, top_k_experts=2, moe_intermediate_size=64, sliding_window=16,
           layer_types=["sliding_attention", "full_attention"])
GEMMA4_MOE = dict(MOE, enable_moe_block=True, hidden_size_per_layer_input=0)
# Whole models: (config class, model class, config kwargs, host experts class, kind). kind: causal (logits, loss
# from labels, generate) or encoder (last hidden state; the loss is a fixed random projection of it).
MOE_FAMILIES = {
    "gemma4_moe": ("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4_MOE, "Gemma4TextExperts", "causal"),
    "gemma4_moe_erf": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(GEMMA4_MOE, hidden_activation="gelu"),
                       "Gemma4TextExperts", "causal"),
    "diffusion_gemma_encoder": ("DiffusionGemmaTextConfig", "DiffusionGemmaEncoderTextModel", MOE,
                                "DiffusionGemmaTextExperts", "encoder"),
}
# A MoE model whose activation is not a GELU: the experts keep their forward, and the gate layer runs the host's math.
MOE_NON_GELU = {"gemma4_moe_silu": ("gemma4_moe", dict(hidden_activation="silu"))}
EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
# Experts modules alone: (config class, config kwargs, dtype). torch.compile is checked on the bf16 ones: in fp32
# transformers' grouped_mm takes its fallback op under torch.compile, which does not compile for the host either.
EXPERTS_MODULES = {
    "Gemma4TextExperts": ("Gemma4TextConfig", GEMMA4_MOE, "float32"),
    "Gemma4TextExperts[bf16]": ("Gemma4TextConfig", GEMMA4_MOE, "bfloat16"),
    "DiffusionGemmaTextExperts": ("DiffusionGemmaTextConfig", MOE, "float32"),
    "DiffusionGemmaTextExperts[bf16]": ("DiffusionGemmaTextConfig", MOE, "bfloat16"),
}


def host_name(module_key: str) -> str:
    return module_key.split("[")[0]


# ----------------------------------------------------------------------------------------------------------------
# measuring
# ----------------------------------------------------------------------------------------------------------------


class Calls:
    """Counts runs of the loaded kernel's CPU implementation (forward and backward), by wrapping the functions
    that its ops call at run time. Zero calls means the kernel did not run, whatever the outputs say."""

    def __init__(self, kernel_module_name: str):
        self.namespace = kernel_module_name  # also the torch.ops namespace of its ops (docs/design.md)
        self.cpu = importlib.import_module(kernel_module_name + ".pointwise.cpu")
        self.fwd = self.bwd = 0
        fwd, bwd = self.cpu.geglu_fwd, self.cpu.geglu_bwd

        def counted_fwd(*a, **k):
            self.fwd += 1
            return fwd(*a, **k)

        def counted_bwd(*a, **k):
            self.bwd += 1
            return bwd(*a, **k)

        self.cpu.geglu_fwd, self.cpu.geglu_bwd = counted_fwd, counted_bwd

    def reset(self):
        self.fwd = self.bwd = 0

    def take(self):
        out = {"fwd": self.fwd, "bwd": self.bwd}
        self.reset()
        return out


class PackedCalls:
    """Counts calls of the packed kernel function (``geglu_packed``) made by the loaded kernel's hub layers through
    ``functional.gated_packed``: the experts' gate calls it for a GELU (the dense MLP layers call
    ``gated_proj``/``geglu``, so they do not count here). Works on every device (Calls counts the CPU implementation
    only). ``layers``: the loaded kernel's ``layers`` module."""

    def __init__(self, layers):
        import sys

        functional = sys.modules[layers.__name__.rpartition(".")[0] + ".functional"]
        self.n = 0
        inner = functional.geglu_packed

        def counted(*a, **k):
            self.n += 1
            return inner(*a, **k)

        functional.geglu_packed = counted

    def take(self) -> int:
        n, self.n = self.n, 0
        return n


def compare(a, b):
    """a (kernelized) vs b (eager): bitwise equality, max |a - b| and max |b| (the test turns these into a
    normwise relative error)."""
    import torch

    a, b = a.detach().float(), b.detach().float()
    return {"equal": bool(torch.equal(a, b)), "max_abs": float((a - b).abs().max()) if a.numel() else 0.0,
            "ref_absmax": float(b.abs().max()) if b.numel() else 0.0, "shape": list(a.shape)}


def rel(c) -> float:
    return c["max_abs"] / c["ref_absmax"] if c["ref_absmax"] else (0.0 if c["max_abs"] == 0 else float("inf"))


def compare_grads(model, ref):
    """Every parameter's gradient: all bitwise equal?, the worst normwise relative error and where."""
    ref_params = dict(ref.named_parameters())
    out = {"n": 0, "equal": True, "worst_rel": 0.0, "worst": None, "missing": []}
    for name, p in model.named_parameters():
        q = ref_params[name]
        if q.grad is None and p.grad is None:
            continue
        if q.grad is None or p.grad is None:
            out["missing"].append(name)
            continue
        c = compare(p.grad, q.grad)
        out["n"] += 1
        out["equal"] &= c["equal"]
        if rel(c) > out["worst_rel"] or out["worst"] is None:
            out["worst_rel"], out["worst"] = max(out["worst_rel"], rel(c)), name
    return out


def recording_backend(graphs):
    """aot_eager, recording the ops of each graph dynamo hands over (one graph per compiled frame)."""
    import torch

    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return aot_eager(gm, example_inputs)

    return backend


def hosts_of(model, cls_name):
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ == cls_name]


def forward_name(module) -> str:
    return getattr(module.forward, "__func__", module.forward).__qualname__


def first_linear(module):
    import torch

    return next(m for m in module.modules() if isinstance(m, torch.nn.Linear))


def in_features(module) -> int:
    return first_linear(module).in_features


def in_dtype(module):
    return first_linear(module).weight.dtype


# ----------------------------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------------------------


def _instantiate(cfg_name, model_name, kwargs, overrides, save_dir):
    """(reference, model under test): the same random weights, the second saved and reloaded when ``save_dir``."""
    import torch
    import transformers

    config = getattr(transformers, cfg_name)(**dict(kwargs, **(overrides or {})))
    model_cls = getattr(transformers, model_name)
    torch.manual_seed(0)
    ref = model_cls(config).eval()
    if save_dir is None:
        return ref, copy.deepcopy(ref)
    ref.save_pretrained(save_dir)
    assert (Path(save_dir) / "model.safetensors").is_file(), os.listdir(save_dir)
    # use_kernels=False: from transformers 5.25, from_pretrained kernelizes by default, and model.train() then
    # kernelizes again with transformers' own mapping on the model's device (kernels-community layers on CUDA, whose
    # publisher check the loopback Hub cannot answer). These checks kernelize explicitly, with this kernel's mapping.
    model = model_cls.from_pretrained(save_dir, use_kernels=False).eval()
    assert not model.use_kernels, "from_pretrained(use_kernels=False) left transformers' kernelize on"
    return ref, model


def build(name, overrides=None, save_dir=None):
    cfg_name, model_name, kwargs, host, layer, kind = FAMILIES[name]
    return _instantiate(cfg_name, model_name, kwargs, overrides, save_dir)


def inputs_for(kind, vocab=128, train=False):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, 8), generator=g)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if kind == "seq2seq":
        out["decoder_input_ids"] = torch.randint(3, vocab, (2, 5), generator=g)
    if train:
        labels = torch.randint(3, vocab, out.get("decoder_input_ids", ids).shape, generator=g)
        if kind == "seq2seq":
            del out["decoder_input_ids"]
        out["labels"] = labels
    return out


def check_family(name, calls, work: Path, kernelize, Mode):
    import torch

    calls.reset()  # a check that failed half-way must not leave counts behind

    cfg_name, model_name, kwargs, host, layer, kind = FAMILIES[name]
    res = {}
    ref, model = build(name, save_dir=work / f"model-{name}")
    kernelize(model, mode=Mode.INFERENCE, device="cpu")
    hosts = hosts_of(model, host)
    res["hosts"] = len(hosts)
    res["swapped"] = sum(forward_name(m) == f"{layer}.forward" for _, m in hosts)

    inputs = inputs_for(kind)
    calls.reset()
    with torch.no_grad():
        out = model(**inputs).logits
        res["forward_calls"] = calls.take()
        ref_out = ref(**inputs).logits
    res["forward"] = compare(out, ref_out)

    if kind != "mlm":
        gen = dict(max_new_tokens=4, do_sample=False, num_beams=1)
        ids = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
        tokens = model.generate(**ids, **gen)
        res["generate_calls"] = calls.take()
        res["generate"] = {"tokens": tokens.tolist(), "ref_tokens": ref.generate(**ids, **gen).tolist()}

    # training: dropout on (same seed, so the same masks), gradients of every parameter
    model.train()
    ref.train()
    kernelize(model, mode=Mode.TRAINING, device="cpu")
    res["train_swapped"] = sum(forward_name(m) == f"{layer}.forward" for _, m in hosts)
    tin = inputs_for(kind, train=True)
    torch.manual_seed(123)
    loss = model(**tin).loss
    loss.backward()
    res["train_calls"] = calls.take()
    torch.manual_seed(123)
    ref_loss = ref(**tin).loss
    ref_loss.backward()
    res["loss"] = compare(loss, ref_loss)
    res["grads"] = compare_grads(model, ref)

    # torch.compile of one MLP under Mode.INFERENCE | Mode.TORCH_COMPILE
    model.eval()
    ref.eval()
    kernelize(model, mode=Mode.INFERENCE | Mode.TORCH_COMPILE, device="cpu")
    mlp_name, mlp = hosts[-1]
    ref_mlp = dict(ref.named_modules())[mlp_name]
    res["compile"] = check_compile(mlp, ref_mlp, {}, calls)
    res["layer"] = layer
    return res


def check_compile(mlp, ref_mlp, fwd_kwargs, calls, train=False):
    """torch.compile(fullgraph=True) of a kernelized host (a graph break raises), run once; with train=True the
    backward too, gradients compared with eager's."""
    import torch

    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(mlp, fullgraph=True, backend=recording_backend(graphs))
    x = torch.randn(2, 5, in_features(mlp), generator=torch.Generator().manual_seed(2)).to(in_dtype(mlp))
    calls.reset()
    res = {}
    if train:
        mlp.zero_grad(set_to_none=True), ref_mlp.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        y = compiled(x, **fwd_kwargs)
        y.backward(torch.ones_like(y))
        res["calls"] = calls.take()
        torch.manual_seed(7)
        y_ref = ref_mlp(x, **fwd_kwargs)
        y_ref.backward(torch.ones_like(y_ref))
        res["grads"] = compare_grads(mlp, ref_mlp)
    else:
        with torch.no_grad():
            y = compiled(x, **fwd_kwargs)
            res["calls"] = calls.take()
            y_ref = ref_mlp(x, **fwd_kwargs)
    ops = [op for g in graphs for op in g]
    ours = [op for op in ops if op.startswith(calls.namespace + ".")]
    res.update(graphs=len(graphs), kernel_ops=len(ours), ops=sorted(set(ops)), out=compare(y, y_ref))
    return res


def check_module(key, calls, kernelize, Mode, compile_train=False):
    import torch
    import transformers

    calls.reset()  # a check that failed half-way must not leave counts behind

    from kerneltools.transformers_kernels import GEGLU_CLASSES

    cfg_name, kwargs, ctor, fwd_kwargs, *opts = MODULES[key]
    opts = opts[0] if opts else {}
    dtype = getattr(torch, opts.get("dtype", "float32"))
    row = next(h for h in GEGLU_CLASSES if h.name == host_name(key))
    cls = row.load()
    config = getattr(transformers, cfg_name, None) or getattr(
        importlib.import_module(f"transformers.models.{row.model}.configuration_{row.model}"), cfg_name)
    config = config(**kwargs)
    torch.manual_seed(0)
    ref = cls(config, **ctor)
    if key == "Gemma4VisionMLP":  # make the clamps bite
        for lin in (ref.gate_proj, ref.up_proj, ref.down_proj):
            lin.input_min.fill_(-1.5), lin.input_max.fill_(1.5), lin.output_min.fill_(-0.4), lin.output_max.fill_(0.4)
    ref.to(dtype)
    for sub in opts.get("fp32", []):
        getattr(ref, sub).float()
    mod = copy.deepcopy(ref)
    res = {}
    kernelize(mod, mode=Mode.TRAINING, device="cpu")
    res["forward_name"] = forward_name(mod)
    mod.train(), ref.train()
    x = torch.randn(2, 5, in_features(ref), generator=torch.Generator().manual_seed(3)).to(in_dtype(ref))
    fwd_kwargs = {k: torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(x.dtype) if v is RANDN else v
                  for k, v in fwd_kwargs.items()}
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(7)
    y = mod(xa, **fwd_kwargs)
    torch.manual_seed(7)
    y_ref = ref(xb, **fwd_kwargs)
    res["dtypes"] = [str(y.dtype), str(y_ref.dtype)]
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4)).to(y.dtype)
    y.backward(dy)
    y_ref.backward(dy)
    res["calls"] = calls.take()
    res["forward"] = compare(y, y_ref)
    res["grads"] = compare_grads(mod, ref)
    res["input_grad"] = compare(xa.grad, xb.grad)
    if compile_train:  # once per hub layer: compiling the backward is the slow part
        kernelize(mod, mode=Mode.TRAINING | Mode.TORCH_COMPILE, device="cpu")
        res["compile_train"] = check_compile(mod, ref, fwd_kwargs, calls, train=True)
    mod.eval(), ref.eval()
    kernelize(mod, mode=Mode.INFERENCE | Mode.TORCH_COMPILE, device="cpu")
    res["compile"] = check_compile(mod, ref, fwd_kwargs, calls)
    return res


GATE_KEY = "geglu.GeGLUExpertsGate"


def gate_name(experts) -> str:
    """The forward of an experts module's gate function layer."""
    return forward_name(experts._kernel_funcs[GATE_KEY])


def build_moe(name, overrides=None, save_dir=None):
    cfg_name, model_name, kwargs, host, kind = MOE_FAMILIES[name]
    return _instantiate(cfg_name, model_name, kwargs, overrides, save_dir)


class ExpertsHits:
    """Per call of an experts module, the number of distinct experts its tokens went to: the eager loop runs the
    gate once per such expert, the other implementations once per call."""

    def __init__(self, model, host):
        self.hits = []
        for _, m in hosts_of(model, host):
            m.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        import torch

        self.hits.append(int(torch.unique(args[1]).numel()))

    def take(self, impl) -> int:
        n = sum(self.hits) if impl == "eager" else len(self.hits)
        self.hits = []
        return n


def moe_output(model, inputs, kind):
    out = model(**inputs)
    return out.logits if kind == "causal" else out.last_hidden_state


def moe_loss(model, inputs, kind):
    if kind == "causal":
        return model(**inputs).loss
    import torch

    out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.device, out.dtype)
    return (out * proj).sum()


def _moe_inputs(kind, device, train=False):
    inputs = inputs_for("causal", train=train and kind == "causal")
    return {k: v.to(device) for k, v in inputs.items()}


def check_moe_family(name, calls, packed, work, kernelize, Mode, device="cpu", dtype="float32", overrides=None,
                     backend=None):
    """A saved and reloaded MoE model, kernelized: per experts implementation, the output against the same model
    unkernelized, greedy generate, and (Mode.TRAINING) the loss and every gradient; how often the packed kernel ran
    against how often the gate runs (ExpertsHits). ``backend``: the kernel's backend for the training part (the
    GPU run sets 'triton', so that tiny training steps run the kernel rather than PyTorch's ops)."""
    import torch

    calls.reset(), packed.take()
    cfg_name, model_name, kwargs, host, kind = MOE_FAMILIES[name]
    ref, model = build_moe(name, overrides, save_dir=work / f"model-{name}-{device}-{dtype}")
    dt = getattr(torch, dtype)
    ref.to(device, dt), model.to(device, dt)
    res = {"impls": {impl: {} for impl in EXPERTS_IMPLEMENTATIONS}}
    kernelize(model, mode=Mode.INFERENCE, device=device)
    experts = [m for _, m in hosts_of(model, host)]
    res["hosts"] = len(experts)
    res["swapped"] = sum(forward_name(m) == "GeGLUExperts.forward" for m in experts)
    res["gates_swapped"] = sum(gate_name(m) == "GeGLUExpertsGate.forward" for m in experts)
    # kernelize swaps the gates of the model it is given only: the reference (same class) keeps its own
    res["ref_gates_swapped"] = sum(gate_name(m) == "GeGLUExpertsGate.forward" for _, m in hosts_of(ref, host))
    res["dense"] = sum(forward_name(m) == "GeGLUMLP.forward" for m in model.modules())
    hits = ExpertsHits(model, host)
    inputs = _moe_inputs(kind, device)
    for impl, r in res["impls"].items():
        model.set_experts_implementation(impl), ref.set_experts_implementation(impl)
        r["config"] = model.config._experts_implementation
        with torch.no_grad():
            calls.reset(), packed.take(), hits.take(impl)
            out = moe_output(model, inputs, kind)
            r["forward_calls"] = dict(calls.take(), packed=packed.take(), gates=hits.take(impl))
            r["forward"] = compare(out, moe_output(ref, inputs, kind))
        if kind == "causal":
            gen = dict(max_new_tokens=4, do_sample=False, num_beams=1)
            ids = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
            tokens = model.generate(**ids, **gen)
            r["generate_calls"] = dict(calls.take(), packed=packed.take(), gates=hits.take(impl))
            r["generate"] = {"tokens": tokens.tolist(), "ref_tokens": ref.generate(**ids, **gen).tolist()}

    model.train(), ref.train()
    kernelize(model, mode=Mode.TRAINING, device=device)
    res["train_swapped"] = sum(forward_name(m) == "GeGLUExperts.forward" for m in experts)
    tin = _moe_inputs(kind, device, train=True)
    kernel = importlib.import_module(calls.namespace)
    if backend:
        kernel.set_backend(backend)
    try:
        for impl, r in res["impls"].items():
            model.set_experts_implementation(impl), ref.set_experts_implementation(impl)
            model.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
            calls.reset(), packed.take(), hits.take(impl)
            loss = moe_loss(model, tin, kind)
            loss.backward()
            r["train_calls"] = dict(calls.take(), packed=packed.take(), gates=hits.take(impl))
            ref_loss = moe_loss(ref, tin, kind)
            ref_loss.backward()
            r["loss"] = compare(loss, ref_loss)
            r["grads"] = compare_grads(model, ref)
    finally:
        kernel.set_backend("auto")
    return res


def check_moe_non_gelu(name, calls, packed, kernelize, Mode):
    """A MoE model with a non-GELU activation: the experts keep their own forward; the gate layer is swapped (it
    has no host to ask) and runs the host's math; the kernel never runs."""
    import torch

    calls.reset(), packed.take()
    family, overrides = MOE_NON_GELU[name]
    cfg_name, model_name, kwargs, host, kind = MOE_FAMILIES[family]
    ref, model = build_moe(family, overrides)
    kernelize(model, mode=Mode.INFERENCE, device="cpu")
    experts = [m for _, m in hosts_of(model, host)]
    res = {"hosts": len(experts), "own_forward": sum("forward" not in m.__dict__ for m in experts),
           "gates_swapped": sum(gate_name(m) == "GeGLUExpertsGate.forward" for m in experts), "impls": {}}
    inputs = _moe_inputs(kind, "cpu")
    for impl in EXPERTS_IMPLEMENTATIONS:
        model.set_experts_implementation(impl), ref.set_experts_implementation(impl)
        with torch.no_grad():
            out = moe_output(model, inputs, kind)
            c = dict(calls.take(), packed=packed.take())
            res["impls"][impl] = {"calls": c, "equal": bool(torch.equal(out, moe_output(ref, inputs, kind)))}
    return res


def _experts_inputs(config, device, dtype, tokens=12):
    import torch

    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, config.hidden_size, generator=g)
    weights, index = torch.randn(tokens, config.num_experts, generator=g).softmax(-1).topk(config.top_k_experts, -1)
    dy = torch.randn(tokens, config.hidden_size, generator=g)
    return x.to(device, dtype), index.to(device), weights.to(device, dtype), dy.to(device, dtype)


def _set_experts_implementation(impl, *modules):
    for m in modules:
        m.config._experts_implementation = impl


def check_experts_module(key, calls, packed, kernelize, Mode, device="cpu", backend=None):
    """An experts class alone, per experts implementation: Mode.TRAINING forward and backward against the same
    module unkernelized (output, weight and input gradients, kernel calls); for bf16, torch.compile under
    Mode.INFERENCE | TORCH_COMPILE and Mode.TRAINING | TORCH_COMPILE (fullgraph for grouped_mm and batched_mm; the
    eager implementation's loop breaks the graph in the host too, so it is compiled without fullgraph). ``backend``: the kernel's backend for the whole check (as in check_moe_family)."""
    kernel = importlib.import_module(calls.namespace)
    if backend:
        kernel.set_backend(backend)
    try:
        return _check_experts_module(key, calls, packed, kernelize, Mode, device)
    finally:
        kernel.set_backend("auto")


def _check_experts_module(key, calls, packed, kernelize, Mode, device):
    import torch
    import transformers

    from kerneltools.transformers_kernels import GEGLU_CLASSES

    calls.reset(), packed.take()
    cfg_name, kwargs, dtype = EXPERTS_MODULES[key]
    dt = getattr(torch, dtype)
    cls = next(h for h in GEGLU_CLASSES if h.name == host_name(key)).load()
    config = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(0)
    ref = cls(config)
    with torch.no_grad():  # the class allocates its weights with torch.empty; the model's _init_weights fills them
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    ref.to(device, dt)
    mod = copy.deepcopy(ref)
    x, index, weights, dy = _experts_inputs(config, device, dt)
    gates = {impl: (int(torch.unique(index).numel()) if impl == "eager" else 1) for impl in EXPERTS_IMPLEMENTATIONS}
    kernelize(mod, mode=Mode.TRAINING, device=device)
    res = {"forward_name": forward_name(mod), "gate_name": gate_name(mod), "gates": gates, "impls": {}}
    for impl in EXPERTS_IMPLEMENTATIONS:
        _set_experts_implementation(impl, mod, ref)
        mod.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        calls.reset(), packed.take()
        y = mod(xa, index, weights)
        y.backward(dy)
        r = {"calls": dict(calls.take(), packed=packed.take())}
        y_ref = ref(xb, index, weights)
        y_ref.backward(dy)
        r.update(forward=compare(y, y_ref), grads=compare_grads(mod, ref), input_grad=compare(xa.grad, xb.grad),
                 dtypes=[str(y.dtype), str(y_ref.dtype)])
        res["impls"][impl] = r
    if dt == torch.bfloat16:
        res["compile"] = {}
        for train in (False, True):
            mode = (Mode.TRAINING if train else Mode.INFERENCE) | Mode.TORCH_COMPILE
            mod.train(train), ref.train(train)
            kernelize(mod, mode=mode, device=device)
            for impl in EXPERTS_IMPLEMENTATIONS:
                _set_experts_implementation(impl, mod, ref)
                c = check_experts_compile(mod, ref, (x, index, weights, dy), calls, train, fullgraph=impl != "eager")
                res["compile"][f"{'train' if train else 'inference'}-{impl}"] = c
    return res


def check_experts_compile(mod, ref, inputs, calls, train, fullgraph):
    """torch.compile of a kernelized experts module, run once against the unkernelized module in eager mode."""
    import torch

    x, index, weights, dy = inputs
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(mod, fullgraph=fullgraph, backend=recording_backend(graphs))
    mod.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
    xa, xb = x.clone().requires_grad_(train), x.clone().requires_grad_(train)
    calls.reset()
    with torch.set_grad_enabled(train):
        y = compiled(xa, index, weights)
        if train:
            y.backward(dy)
        res = {"calls": calls.take()}
        y_ref = ref(xb, index, weights)
        if train:
            y_ref.backward(dy)
    ops = [op for g in graphs for op in g]
    res.update(graphs=len(graphs), kernel_ops=sum(op.startswith(calls.namespace + ".") for op in ops),
               out=compare(y, y_ref))
    if train:
        res.update(grads=compare_grads(mod, ref), input_grad=compare(xa.grad, xb.grad))
    return res


def check_moe_cuda(calls, packed, work, kernelize, Mode):
    """The MoE checks on the GPU, in bf16, with deterministic algorithms (transformers' experts accumulate with
    index_add_ / index backward, which are atomic, so not reproducible, on CUDA otherwise). The mapping has no
    norms (``norms=False``): the fused Gemma 4 norms are within their bound of eager's on CUDA, not bit-exact
    (tests/tools/test_transformers_rmsnorm.py checks them), and these checks hold the experts to eager's bits."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS reads it when its first handle is made
    import torch
    from kernels import use_kernel_mapping

    from kerneltools.transformers_kernels import register_geglu_kernels

    no_norms = register_geglu_kernels(os.environ["GEGLU_REPO_ID"], version=1, register=False, norms=False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with use_kernel_mapping(no_norms.mapping, inherit_mapping=False):
            out = {"families": {n: guarded(check_moe_family, n, calls, packed, work, kernelize, Mode,
                                           device="cuda", dtype="bfloat16", backend="triton")
                                for n in ("gemma4_moe", "gemma4_moe_erf")}}
            out["experts_modules"] = {k: guarded(check_experts_module, k, calls, packed, kernelize, Mode,
                                                 device="cuda", backend="triton")
                                      for k in EXPERTS_MODULES if k.endswith("[bf16]")}
    finally:
        torch.use_deterministic_algorithms(False)
    return out


def check_non_gelu(name, calls, kernelize, Mode):
    import torch

    calls.reset()  # a check that failed half-way must not leave counts behind

    family, overrides = NON_GELU[name]
    cfg_name, model_name, kwargs, host, layer, kind = FAMILIES[family]
    ref, model = build(family, overrides)
    kernelize(model, mode=Mode.INFERENCE, device="cpu")
    hosts = hosts_of(model, host)
    inputs = inputs_for(kind)
    calls.reset()
    with torch.no_grad():
        out = model(**inputs).logits
        c = calls.take()
        ref_out = ref(**inputs).logits
    return {"hosts": len(hosts), "own_forward": sum("forward" not in m.__dict__ for _, m in hosts),
            "calls": c, "equal": bool(torch.equal(out, ref_out))}


def check_activation_table(layers):
    """The helper's condition (is_kernel_gelu) and the kernel's gelu_approximation agree on every transformers
    activation."""
    from transformers.activations import ACT2CLS, ACT2FN

    from kerneltools.transformers_kernels import is_kernel_gelu

    table = {}
    for key in ACT2CLS:
        try:
            act = ACT2FN[key]
        except Exception as e:  # noqa: BLE001 (an activation that cannot be built without arguments)
            table[key] = f"skipped: {type(e).__name__}"
            continue
        table[key] = [layers.gelu_approximation(act), is_kernel_gelu(act)]
    return table


def check_lockfile(repo_id, work: Path, calls, kernelize, Mode):
    """kernels lock (the CLI, against the loopback Hub) then register_geglu_kernels(lockfile=...)."""
    import torch
    from kernels import use_kernel_mapping

    from kerneltools.transformers_kernels import register_geglu_kernels

    proj = work / "locked-project"
    proj.mkdir(exist_ok=True)
    (proj / "pyproject.toml").write_text(
        f'[project]\nname = "uses-geglu"\nversion = "0.1"\n\n[tool.kernels.dependencies]\n"{repo_id}" = 1\n')
    cli = Path(sys.executable).parent / "kernels"
    if not cli.exists():  # kernels installed elsewhere (e.g. pip --target): its CLI is on PATH
        cli = Path(shutil.which("kernels") or cli)
    r = subprocess.run([str(cli), "lock", str(proj)], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"kernels lock failed: {r.stdout}\n{r.stderr}")
    lock = json.loads((proj / "kernels.lock").read_text())
    reg = register_geglu_kernels(repo_id, lockfile=proj / "kernels.lock", register=False)
    ref, model = build("gemma")
    calls.reset()
    with use_kernel_mapping(reg.mapping, inherit_mapping=False):
        kernelize(model, mode=Mode.INFERENCE, device="cpu")
    inputs = inputs_for("causal")
    with torch.no_grad():
        out = model(**inputs).logits
        c = calls.take()
        equal = bool(torch.equal(out, ref(**inputs).logits))
    repo_types = sorted({type(r).__name__ for dev in reg.mapping.values() for modes in dev.values()
                         for r in modes.values()})
    return {"lock": lock, "repo_types": repo_types, "calls": c, "equal": equal,
            "swapped": sum(forward_name(m) == "GeGLUMLP.forward" for _, m in hosts_of(model, "GemmaMLP"))}


def check_kernel_config(work: Path):
    """transformers' own route: KernelConfig. On CPU transformers refuses it; on CUDA it kernelizes."""
    import torch
    import transformers

    from kerneltools.transformers_kernels import geglu_kernel_config

    out = {}
    ref, model = build("gemma")
    cfg = geglu_kernel_config(model)
    out["mapping"] = {k: [v[0], v[1]] for k, v in cfg.kernel_mapping.items()}
    # a MoE model: the experts' class layer and their gate layers (found in _kernel_funcs), from the instance and
    # from the class
    _, moe = build_moe("gemma4_moe")
    out["moe_mapping"] = {k: v[0] for k, v in geglu_kernel_config(moe).kernel_mapping.items()}
    out["moe_class_keys"] = sorted(geglu_kernel_config(type(moe)).kernel_mapping)
    try:
        model.set_use_kernels(True, cfg)
        out["set_use_kernels"] = "ok"
    except ValueError as e:
        out["set_use_kernels"] = f"ValueError: {e}"
    path = work / "model-gemma"
    try:
        transformers.GemmaForCausalLM.from_pretrained(
            path, use_kernels=True, kernel_config=geglu_kernel_config(transformers.GemmaForCausalLM))
        out["from_pretrained"] = "ok"
    except ValueError as e:
        out["from_pretrained"] = f"ValueError: {e}"
    if torch.cuda.is_available():  # the route transformers supports: a CUDA model
        ref = transformers.GemmaForCausalLM.from_pretrained(path, use_kernels=False).cuda().eval()
        model = transformers.GemmaForCausalLM.from_pretrained(
            path, use_kernels=True, kernel_config=geglu_kernel_config(transformers.GemmaForCausalLM),
            device_map="cuda").eval()
        ids = inputs_for("causal")["input_ids"].cuda()
        with torch.no_grad():
            out["cuda"] = {"swapped": sum(forward_name(m) == "GeGLUMLP.forward"
                                          for _, m in hosts_of(model, "GemmaMLP")),
                           "equal": bool(torch.equal(model(ids).logits, ref(ids).logits))}
    return out


def check_reregister(repo_id):
    """A second register_geglu_kernels (here: by revision) replaces the entries of the first, on CUDA (an
    interval tree by capability) and on CPU (read through kerneltools.kernels_api: kernels has no public view)."""
    from kerneltools.kernels_api import mapped_repos
    from kerneltools.transformers_kernels import KEY_PREFIX, register_geglu_kernels

    register_geglu_kernels(repo_id, revision="v1")
    key = KEY_PREFIX + "GeGLUMLP"
    def spec(r):  # the repository's own fields (its str() resolves a version on the Hub in kernels 0.17)
        return f"revision={r._revision}" if r._version is None else f"version={r._version}"

    return {"cuda": sorted({spec(r) for r in mapped_repos(key, "cuda", 90).values()}),
            "cpu": sorted({spec(r) for r in mapped_repos(key, "cpu").values()})}


def describe_mapping(mapping):
    """{key: {device: {mode: "Repo(layer)"}}} plus how many distinct repository objects there are."""
    repos = {}
    out = {}
    for key, devices in mapping.items():
        out[key] = {}
        for device, modes in devices.items():
            out[key][device] = {}
            for mode, repo in modes.items():
                repos[id(repo)] = repo
                out[key][device][str(mode)] = f"{type(repo).__name__}({repo.layer_name})"
    return {"keys": out, "distinct_repos": len(repos)}


def guarded(fn, *a, **k):
    t = time.time()
    try:
        res = fn(*a, **k)
    except Exception:  # noqa: BLE001 (reported to the test, which fails with the traceback)
        res = {"error": traceback.format_exc()}
    res["seconds"] = round(time.time() - t, 2)
    return res


def main_full(out_path: Path) -> None:
    import torch
    from kernels import Mode, get_kernel, kernelize

    from kerneltools.transformers_kernels import GEGLU_CLASSES, register_geglu_kernels

    torch.set_num_threads(1)  # one thread each: the two workers run side by side
    repo_id = os.environ["GEGLU_REPO_ID"]
    work = Path(os.environ["GEGLU_WORK_DIR"])
    t0 = time.time()
    reg = register_geglu_kernels(repo_id, version=1)
    kernel = get_kernel(repo_id, version=1)
    calls = Calls(kernel.__name__)
    report = {"kernel": kernel.__name__, "registered": sorted(reg.classes), "skipped": reg.skipped,
              "mapping": describe_mapping(reg.mapping),
              "layers": sorted(n for n in dir(kernel.layers) if not n.startswith("_")),
              "activations": guarded(check_activation_table, kernel.layers)}
    report["families"] = {n: guarded(check_family, n, calls, work, kernelize, Mode)
                          for n in FAMILIES}
    layer_of = {h.name: h.layer for h in GEGLU_CLASSES}
    first_of_layer = {}
    for k in MODULES:
        first_of_layer.setdefault(layer_of.get(host_name(k)), k)
    report["modules"] = {k: guarded(check_module, k, calls, kernelize, Mode,
                                    compile_train=k in first_of_layer.values()) for k in MODULES}
    report["non_gelu"] = {n: guarded(check_non_gelu, n, calls, kernelize, Mode) for n in NON_GELU}
    packed = PackedCalls(kernel.layers)
    report["moe"] = {n: guarded(check_moe_family, n, calls, packed, work, kernelize, Mode) for n in MOE_FAMILIES}
    report["moe_non_gelu"] = {n: guarded(check_moe_non_gelu, n, calls, packed, kernelize, Mode) for n in MOE_NON_GELU}
    report["experts_modules"] = {k: guarded(check_experts_module, k, calls, packed, kernelize, Mode)
                                 for k in EXPERTS_MODULES}
    if torch.cuda.is_available():
        report["moe_cuda"] = guarded(check_moe_cuda, calls, packed, work, kernelize, Mode)
    report["kernel_config"] = guarded(check_kernel_config, work)
    report["lockfile"] = guarded(check_lockfile, repo_id, work, calls, kernelize, Mode)
    report["reregister"] = guarded(check_reregister, repo_id)  # last: it changes the global mapping
    report["seconds"] = time.time() - t0
    out_path.write_text(json.dumps(report, indent=1))


def main_disabled(out_path: Path) -> None:
    """DISABLE_KERNEL_MAPPING=1: kernelize keeps every original forward and never loads the kernel."""
    import torch
    from kernels import Mode, kernelize

    from kerneltools.transformers_kernels import register_geglu_kernels

    torch.set_num_threads(1)
    # the MoE references come first, from transformers' classes as they are before registration
    moe_refs = {}
    for name, (cfg, model_cls, kwargs, host, kind) in MOE_FAMILIES.items():
        ref, _ = build_moe(name)
        inputs = _moe_inputs(kind, "cpu")
        with torch.no_grad():
            for impl in EXPERTS_IMPLEMENTATIONS:
                ref.set_experts_implementation(impl)
                moe_refs[name, impl] = moe_output(ref, inputs, kind)
    register_geglu_kernels(os.environ["GEGLU_REPO_ID"], version=1)
    report = {}
    for name, (cfg, model_cls, kwargs, host, layer, kind) in FAMILIES.items():
        def one():
            ref, model = build(name)
            kernelize(model, mode=Mode.INFERENCE, device="cpu")
            hosts = hosts_of(model, host)
            inputs = inputs_for(kind)
            with torch.no_grad():
                equal = bool(torch.equal(model(**inputs).logits, ref(**inputs).logits))
            return {"hosts": len(hosts), "original": sum(forward_name(m) == f"{type(m).__name__}.forward"
                                                         for _, m in hosts), "equal": equal}
        report[name] = guarded(one)
    for name, (cfg, model_cls, kwargs, host, kind) in MOE_FAMILIES.items():
        def one_moe():
            _, model = build_moe(name)
            kernelize(model, mode=Mode.INFERENCE, device="cpu")
            experts = [m for _, m in hosts_of(model, host)]
            inputs = _moe_inputs(kind, "cpu")
            equal = {}
            with torch.no_grad():
                for impl in EXPERTS_IMPLEMENTATIONS:
                    model.set_experts_implementation(impl)
                    equal[impl] = bool(torch.equal(moe_output(model, inputs, kind), moe_refs[name, impl]))
            return {"hosts": len(experts),
                    "original": sum(forward_name(m) == f"{host}.forward" for m in experts),
                    "gate_original": sum(gate_name(m) == "ExpertsGate.forward" for m in experts),
                    "equal": equal}
        report["moe:" + name] = guarded(one_moe)
    report["loaded_kernel_modules"] = sorted(m for m in sys.modules if m.startswith("_geglu"))
    out_path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    what, out = sys.argv[1], Path(sys.argv[2])
    if what == "full":
        main_full(out)
    elif what == "disabled":
        main_disabled(out)
    else:
        raise SystemExit(f"unknown mode {what!r}")
