"""The main job, end to end: build -> serve the loopback Hub -> publish -> get_kernel -> kernelize a small
Gemma-style transformers model -> report what happened.

    python -m kerneltools demo [--workdir DIR] [--keep] [--endpoint URL]

Everything runs on this machine: the Hub is our own server on 127.0.0.1, which gives the demo a write token for
geglu-kernels in HF_TOKEN (unless --endpoint names another Hub, e.g. huggingface.co, with your own HF_TOKEN set);
the model is built from a config with random weights.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .build.config import hub_repo_id

REPO_ID = hub_repo_id()  # build.toml's [general.hub] repo-id
ROOT = Path(__file__).resolve().parents[1]


class _Log:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.n = 0

    def step(self, msg: str) -> None:
        self.n += 1
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {self.n}. {msg}", flush=True)

    def info(self, msg: str) -> None:
        print(f"           {msg}", flush=True)


def _per_forward(fn, device: str) -> list[tuple[str, float]]:
    """(name, µs) of the GPU kernels one call launches; on a CPU, the top-level operators it runs."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    fn()  # warm up (Triton compiles on first use)
    if device == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    if device == "cuda":
        return [(e.name, e.device_time) for e in events
                if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Memset")]
    # metadata-only operators (views, allocation) run no kernel
    return [(e.name, e.cpu_time) for e in events if e.cpu_parent is None and "::" in e.name
            and e.name not in _NO_KERNEL_OPS]


_NO_KERNEL_OPS = {"aten::view", "aten::empty", "aten::reshape", "aten::as_strided", "aten::t", "aten::transpose",
                  "aten::slice", "aten::detach", "aten::_unsafe_view", "aten::expand"}


def tiny_gemma(device: str, seed: int = 0):
    import torch
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(seed)
    cfg = GemmaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=64, vocab_size=512, max_position_embeddings=256,
                      hidden_act="gelu_pytorch_tanh")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return GemmaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def run(workdir: Path, endpoint: str | None, keep: bool) -> int:
    log = _Log()
    workdir.mkdir(parents=True, exist_ok=True)
    build_dir = workdir / "build"

    # 1. build
    log.step(f"build the variants from {ROOT} into {build_dir}")
    from .build import build

    variants = ["cpu", "cuda"]
    if shutil.which("nvcc") and (ROOT / "geglu" / "geglu_kernels.cu").is_file():
        variants.append("cuda-compiled")
    # publish expects build/ beside build.toml: build into workdir and point publish at the repo's build.toml
    # one architecture's prebuilt kernels (GEGLU_DEMO_AOT_CAPABILITY): the demo shows the route, not the fleet
    built = build(ROOT, build_dir, variants=variants, capability=os.environ.get("GEGLU_DEMO_CAPABILITY", "9.0"),
                  aot_capability=os.environ.get("GEGLU_DEMO_AOT_CAPABILITY", "9.0"), log=lambda m: log.info(m))
    for v in built:
        log.info(f"{v.name}")

    # 2. the Hub
    from .hub import serve_hub

    hub_ctx = None
    if endpoint is None:
        log.step("start the loopback Hub server (git-backed, 127.0.0.1, port 0)")
        # as the server's owner: trust the kernel's org, and a write token for it (what HF_TOKEN is on huggingface.co)
        hub_ctx = serve_hub(workdir / "hub", trusted_orgs=[REPO_ID.split("/", 1)[0]])
        hub = hub_ctx.__enter__()
        endpoint = hub.url
        os.environ["HF_TOKEN"] = hub.token
        log.info(f"HF_ENDPOINT={endpoint}, HF_TOKEN=<a write token of user 'publisher' in geglu-kernels>")
    else:
        log.step(f"use the Hub at {endpoint} (token: HF_TOKEN or `hf auth login`)")
    # huggingface_hub and kernels read these at import: set them before the first import
    os.environ["HF_ENDPOINT"] = endpoint
    os.environ["KERNELS_CACHE"] = str(workdir / "kernels-cache")
    os.environ["HF_HOME"] = str(workdir / "hf-home")
    try:
        return _rest(log, build_dir, endpoint)
    finally:
        if hub_ctx is not None:
            hub_ctx.__exit__(None, None, None)
        if not keep:
            shutil.rmtree(workdir / "hub", ignore_errors=True)


def _rest(log: _Log, build_dir: Path, endpoint: str) -> int:
    import logging

    class _NoMappingNoise(logging.Filter):  # transformers decorates other layers we do not map: not news here
        def filter(self, record):
            return "No kernel mapping found for layer" not in record.getMessage()

    for name in ("kernels._internals.layer.layer", "kernels.layer.layer"):  # kernels 0.18+, 0.17
        logging.getLogger(name).addFilter(_NoMappingNoise())
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    # 3. publish
    from .build import source_id
    from .publish import publish

    sid = source_id(ROOT)
    log.step(f"publish build/ to {REPO_ID} (branch v1)" + (" [dirty tree: forced, demo only]" if sid.dirty else ""))
    res = publish(build_dir, REPO_ID, endpoint=endpoint, build_toml=ROOT / "build.toml", force_dirty=sid.dirty,
                  progress=False)
    log.info(f"{res.repo_id}@{res.branch} -> commit {res.commit[:12]}: {', '.join(res.variants)}")

    # 4. get_kernel
    import torch
    import torch.nn.functional as F
    from kernels import Mode, get_kernel, kernelize

    device = "cuda" if torch.cuda.is_available() else "cpu"
    log.step(f'get_kernel("{REPO_ID}", version=1) on {device}')
    geglu = get_kernel(REPO_ID, version=1)
    ops_file = Path(geglu.__file__).parent
    log.info(f"variant {ops_file.name}, ops namespace {geglu.__name__}, compiled CUDA library: {geglu.HAS_CUDA_LIB}")
    g = torch.randn(64, 1024, device=device) * 3
    u = torch.randn(64, 1024, device=device)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    g, u = g.to(dt), u.to(dt)
    same = torch.equal(geglu.geglu(g, u, "tanh"), F.gelu(g, approximate="tanh") * u)
    log.info(f"geglu(gate, up, 'tanh') == F.gelu(gate, approximate='tanh') * up: {same}")

    # 5. kernelize a Gemma-style model
    log.step("kernelize a small Gemma model (GemmaMLP -> hub layer GeGLUMLP), via geglu.register_transformers()")
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    model = tiny_gemma(device)
    ids = torch.randint(0, model.config.vocab_size, (2, 48), device=device)
    with torch.no_grad():
        ref_logits = model(ids).logits
        ref_tokens = model.generate(ids[:1, :8], max_new_tokens=8, do_sample=False)
    mlp = model.model.layers[0].mlp
    sizes = {"decode (1 token)": (1, 1), "prefill (8 x 2048 tokens)": (8, 2048)}
    xs = {k: torch.randn(*v, model.config.hidden_size, device=device, dtype=ref_logits.dtype)
          for k, v in sizes.items()}
    with torch.no_grad():
        before = {k: _per_forward(lambda x=x: mlp(x), device) for k, x in xs.items()}

    # the one call users make (the kernel ships it); norms=False: this demo checks the GeGLU MLPs bit for bit, and on
    # a GPU the fused Gemma RMSNorm is within one ulp of eager, not bit-exact (docs/rmsnorm.md)
    reg = geglu.register_transformers(devices=(device,), norms=False)
    log.info(f"geglu.register_transformers(): {len(reg.classes)} transformers classes mapped to the loaded kernel")
    kernelize(model, mode=Mode.INFERENCE, device=device)
    swapped = sum(isinstance(m, GemmaMLP) and "GeGLUMLP" in m.forward.__qualname__ for m in model.modules())
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids[:1, :8], max_new_tokens=8, do_sample=False)
        after = {k: _per_forward(lambda x=x: mlp(x), device) for k, x in xs.items()}
    exact = torch.equal(logits, ref_logits)
    log.info(f"{swapped} GemmaMLP modules now run {mlp.forward.__qualname__}")
    log.info(f"logits equal eager bit for bit: {exact} (max |diff| {(logits - ref_logits).abs().max().item():.3g})")
    log.info(f"greedy generate() tokens equal eager: {torch.equal(tokens, ref_tokens)}")

    # 6. report
    kind = "GPU kernels" if device == "cuda" else "top-level operators (CPU)"
    log.step(f"{kind} per MLP forward, eager and kernelized")
    for size in sizes:
        print(f"    {size}: eager {len(before[size])}, kernelized {len(after[size])}, Liger's GEGLU MLP 4 (its fused "
              "GELU-multiply and the three GEMMs, from the profiling analysis behind this project)")
    prefill = next(reversed(sizes))
    width = max(len(n) for n, _ in before[prefill] + after[prefill])
    for title, rows in (("eager", before[prefill]), ("kernelized", after[prefill])):
        print(f"    {title}, {prefill}:")
        for name, us in rows:
            print(f"      {name[:90]:<{min(width, 90)}}  {us:9.1f} µs")
    if device == "cpu":
        print("    (On a CPU the kernel runs eager's own CPU operators, so the count does not drop; on a GPU the GELU")
        print("     and the product are one kernel, and at prefill sizes the fused gate/up GEMM computes the GeGLU in")
        print("     its epilogue: the GELU result never goes through memory.)")
    ok = same and exact and swapped == model.config.num_hidden_layers
    print(f"\nRESULT: {'OK' if ok else 'MISMATCH'} — published {res.repo_id}@v1, loaded {ops_file.name}, "
          f"{swapped} MLPs kernelized, outputs {'bit-exact' if exact else 'DIFFERENT'}")
    return 0 if ok else 1


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="build -> loopback Hub -> publish -> get_kernel -> kernelize a model")
    p.add_argument("--workdir", type=Path, default=None, help="where build/, the Hub data and caches go (default: tmp)")
    p.add_argument("--endpoint", default=None, help="publish to and load from this Hub instead of a loopback one")
    p.add_argument("--keep", action="store_true", help="keep the Hub data in the workdir")
    p.set_defaults(_main=main)


def main(args) -> int:
    if "huggingface_hub" in sys.modules or "kernels" in sys.modules:
        print("error: run the demo in a fresh process (huggingface_hub reads HF_ENDPOINT at import).",
              file=sys.stderr)
        return 2
    if args.workdir is None:
        with tempfile.TemporaryDirectory(prefix="geglu-demo-") as d:
            return run(Path(d), args.endpoint, args.keep)
    return run(args.workdir, args.endpoint, args.keep)
