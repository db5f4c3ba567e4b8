"""Gemma 4 MoE experts: the gate between the grouped GEMMs (transformers' ``_apply_gate``) and the whole experts
block, ours (the kernelized ``Gemma4TextExperts``) against eager transformers and torch.compile.

Shape (the default): google/gemma-4-26B-A4B's text config, hidden_size 2816, num_experts 128, top_k_experts 8,
moe_intermediate_size 704, gelu_pytorch_tanh, bf16. transformers 5.22.2's ``Gemma4TextConfig`` leaves the MoE
fields unset (None); these are the values of that checkpoint's config.json (the checkpoint that Gemma4TextConfig's
expert-parallel plan names). Token counts: prefill 8 x 2048 = 16384 tokens (131072 routed rows), decode with batch
1 and 8 (8 and 64 rows). The routing is a random softmax top-8, normalised as Gemma 4's router does, so the experts
get about equal shares; the experts implementation is transformers' default, grouped_mm.

Rows:
- gate: ``[S, 2I] -> [S, I]`` on a bf16 tensor: eager is transformers' ``_default_apply_gate`` (chunk, GELU,
  product), torch.compile compiles that function, ours is the experts module's kernelized gate layer. Bytes: read
  ``[S, 2I]``, write ``[S, I]``; % of the copy floor measured in the same run with a large device copy.
- block: the experts module's forward (routing sort, both grouped GEMMs, gate, weighting, un-permute, sum): eager
  transformers, torch.compile of it, ours; each with its ratio to eager.

Every time is the median of ``triton.testing.do_bench`` medians (L2 flushed between runs) over interleaved rounds:
each round times every implementation of a row, in an order that rotates from round to round, and the ratio to
eager is the median of the per-round ratios. The outputs are compared with eager's (``equal``: bit for bit).
On CPU (``--quick`` shapes; for the tests) the times are medians of wall-clock calls: a smoke run, not a measurement.

    python -m kerneltools.bench.moe [--build-dir build] [--out benchmarks/results] [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .common import median, timer


@dataclass(frozen=True)
class MoEShape:
    hidden: int
    experts: int
    top_k: int
    intermediate: int  # moe_intermediate_size
    source: str


GEMMA4_26B_A4B = MoEShape(2816, 128, 8, 704, "google/gemma-4-26B-A4B text_config (config.json)")
QUICK = MoEShape(64, 8, 2, 64, "tiny CPU smoke shape")
TOKENS = [("prefill 8x2048", 8 * 2048), ("decode batch 1", 1), ("decode batch 8", 8)]
QUICK_TOKENS = [("prefill 2x16", 32), ("decode batch 1", 1), ("decode batch 8", 8)]
IMPLS = ("eager", "torch.compile", "ours")


def copy_floor_gbs(torch, device: str, time_us) -> float:
    """Device copy bandwidth, bytes read + written per second (GB/s): the floor a pointwise pass is held to."""
    n = (1 << 29) if device == "cuda" else (1 << 22)  # 1 GiB of bf16 on the GPU
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    t = time_us(lambda: dst.copy_(src))
    del src, dst
    return 2 * n * 2 / (t * 1e-6) / 1e9


def percent_of(reference_us: float, us: float) -> float:
    """``reference_us`` as a percentage of ``us``: exactly 100.0 when the two are equal (the reference row).

    The ratio is taken first: ``t / t`` is exactly 1.0 in floating point, while ``(100 * t) / t`` rounds to
    100.00000000000001 or 99.99999999999999 for about one value of ``t`` in ten."""
    return 100 * (reference_us / us)


def _experts(torch, shape: MoEShape, device: str, dtype, impl: str):
    """A Gemma4TextExperts of ``shape`` with random weights (std 0.02), configured for ``impl``."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    config = Gemma4TextConfig(hidden_size=shape.hidden, num_experts=shape.experts, top_k_experts=shape.top_k,
                              moe_intermediate_size=shape.intermediate, enable_moe_block=True,
                              hidden_activation="gelu_pytorch_tanh")
    config._experts_implementation = impl
    with torch.device(device):
        mod = Gemma4TextExperts(config).to(dtype)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0.0, 0.02)
    return mod.eval()


def _routing(torch, shape: MoEShape, tokens: int, device: str, dtype, gen):
    """Hidden states, top-k expert ids and weights as Gemma 4's router makes them (fp32 weights normalised to 1)."""
    x = torch.randn(tokens, shape.hidden, generator=gen, device=device).to(dtype)
    probs = torch.randn(tokens, shape.experts, generator=gen, device=device).softmax(-1)
    weights, index = probs.topk(shape.top_k, dim=-1)
    return x, index, weights / weights.sum(-1, keepdim=True)


def _kernelized(kernel_dir: Path, mod, device: str):
    """``mod`` (built after register_geglu_kernels) with our layers, loaded from the local build ``kernel_dir``."""
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    from kerneltools.transformers_kernels import GEGLU_CLASSES

    row = next(h for h in GEGLU_CLASSES if h.name == type(mod).__name__)
    mapping = {key: {device: LocalLayerRepository(kernel_dir, layer_name=layer)}
               for key, layer in ((row.key, row.layer), (row.gate_key, row.gate_layer))}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(mod, mode=Mode.INFERENCE, device=device)
    return mod, row.gate_key


def _packed_calls(kernel, fn) -> int:
    """How often one call of ``fn`` runs the kernel's packed GeGLU (``geglu_packed``, as its hub layers call it
    through ``functional.gated_packed``)."""
    functional, inner, n = kernel.functional, kernel.functional.geglu_packed, [0]

    def counted(*a, **k):
        n[0] += 1
        return inner(*a, **k)

    functional.geglu_packed = counted
    try:
        fn()
    finally:
        functional.geglu_packed = inner
    return n[0]


def _fused_gate_up(kernel):
    """The kernel's fused gate/up grouped GEMM module (``experts.kernels``), or None without Triton."""
    try:
        return importlib.import_module(kernel.__name__ + ".experts.kernels")
    except ImportError:
        return None


def _unfused(kernel, fn):
    """``fn()`` with the kernel's ``fused_mlp`` setting off (the experts block's gate only)."""
    with kernel.configure(fused_mlp=False):
        return fn()


def _forward_name(fn) -> str:
    return getattr(fn, "__func__", fn).__qualname__


def run(build_dir: Path, *, quick: bool = False, rounds: int = 3, device: str | None = None,
        compile_backend: str | None = "inductor", log=print) -> tuple[dict, str]:
    """Time the gate and the experts block per token count; returns (result, its markdown).
    ``compile_backend=None`` leaves out the torch.compile rows (and their compile time)."""
    import torch
    import kernels
    from transformers.integrations.moe import _default_apply_gate

    from kerneltools.transformers_kernels import register_geglu_kernels

    register_geglu_kernels(register=False)  # the classes' keys and gate layers (the mapping is _kernelized's)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kernel_dir = Path(build_dir).resolve()
    kernel = kernels.get_local_kernel(kernel_dir)
    shape, token_counts = (QUICK, QUICK_TOKENS) if quick else (GEMMA4_26B_A4B, TOKENS)
    dtype = torch.bfloat16
    time_us = timer(device == "cuda", rep_ms=100)
    floor = copy_floor_gbs(torch, device, time_us)
    log(f"copy floor {floor:.0f} GB/s on {device}")

    host = _experts(torch, shape, device, dtype, "grouped_mm")
    ours = _experts(torch, shape, device, dtype, "grouped_mm")
    ours.load_state_dict(host.state_dict())
    ours, gate_key = _kernelized(kernel_dir, ours, device)
    gate_layer = ours._kernel_funcs[gate_key]
    checks = {"experts_forward": _forward_name(ours.forward), "gate_forward": _forward_name(gate_layer.forward),
              "kernel": kernel.__name__}
    act = host.act_fn

    def eager_gate(x):
        return _default_apply_gate(host, x)

    impls = IMPLS if compile_backend else tuple(i for i in IMPLS if i != "torch.compile")
    if compile_backend:  # one compile per token count (static shapes, as a served model's are)
        compiled_gate = torch.compile(eager_gate, backend=compile_backend, fullgraph=True, dynamic=False)
        compiled_block = torch.compile(host, backend=compile_backend, fullgraph=True, dynamic=False)
    fused_kernel = _fused_gate_up(kernel)
    experts_mod = importlib.import_module(kernel.__name__ + ".experts.ops")  # transformers' routing, as the block has it
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for label, tokens in token_counts:
        S, I = tokens * shape.top_k, shape.intermediate
        x, index, weights = _routing(torch, shape, tokens, device, dtype, gen)
        gate_up = torch.randn(S, 2 * I, generator=gen, device=device).to(dtype)
        _, x_g, offsets = experts_mod.sorted_rows(x, index, shape.experts)
        w_t = host.gate_up_proj.transpose(-2, -1)
        steps = {"gate": {"eager": lambda: eager_gate(gate_up), "ours": lambda: gate_layer(act, gate_up)},
                 "gate_up": {"eager": lambda: eager_gate(experts_mod.grouped_mm(x_g, w_t, offsets)),
                             "grouped_mm alone": lambda: experts_mod.grouped_mm(x_g, w_t, offsets)},
                 "block": {"eager": lambda: host(x, index, weights), "ours": lambda: ours(x, index, weights),
                           "ours, fused_mlp off": lambda: _unfused(kernel, lambda: ours(x, index, weights))}}
        if fused_kernel is not None and fused_kernel.applies(x_g, host.gate_up_proj):  # sm_90+ or the interpreter
            steps["gate_up"]["ours"] = lambda: fused_kernel.grouped_gate_up_geglu(x_g, host.gate_up_proj, offsets,
                                                                                 True)
        if compile_backend:
            steps["gate"]["torch.compile"] = lambda: compiled_gate(gate_up)
            steps["block"]["torch.compile"] = lambda: compiled_block(x, index, weights)
        with torch.no_grad():
            for step, fns in steps.items():
                names = [n for n in impls if n in fns] + [n for n in fns if n not in impls]
                ref = fns["eager"]()
                outs = {name: fn() for name, fn in fns.items()}  # also compiles (and decides), before any timing
                packed = {n: _packed_calls(kernel, fn) for n, fn in fns.items() if n.startswith("ours")}
                times = {name: [] for name in fns}
                ratios = {name: [] for name in fns}
                for r in range(rounds):
                    order = names[r % len(names):] + names[:r % len(names)]
                    if r % 2:
                        order.reverse()
                    got = {name: time_us(fns[name]) for name in order}
                    for name, t in got.items():
                        times[name].append(t)
                        ratios[name].append(t / got["eager"])
                for name in names:
                    t = median(times[name])
                    same_shape = outs[name].shape == ref.shape
                    row = dict(tokens=tokens, label=label, rows=S, step=step, impl=name, us=round(t, 2),
                               vs_eager=round(median(ratios[name]), 3),
                               equal=bool(same_shape and torch.equal(outs[name], ref)),
                               max_abs=float((outs[name].float() - ref.float()).abs().max()) if same_shape else None)
                    if name in packed and step != "gate_up":
                        row["packed_calls"] = packed[name]
                    if step == "gate":
                        moved = (S * 2 * I + S * I) * x.element_size()
                        gbs = moved / (t * 1e-6) / 1e9
                        row["gbs"], row["pct_floor"] = gbs, 100 * gbs / floor  # rounded in the markdown
                    if step == "gate_up":  # the rate of transformers' grouped GEMM alone, as a percentage
                        row["pct_grouped_mm"] = percent_of(median(times["grouped_mm alone"]), t)
                    rows.append(row)
                    log(f"{label} {step} {name}: {t:.1f} us ({row['vs_eager']:.3f}x eager"
                        + (f", {row['pct_floor']:.1f}% of floor" if step == "gate" else "")
                        + (f", {row['pct_grouped_mm']:.1f}% of grouped_mm's rate" if step == "gate_up" else "")
                        + f"), equal={row['equal']}")
    result = dict(meta=_meta(torch, device, floor, shape, rounds, compile_backend), checks=checks, rows=rows)
    return result, to_markdown(result)


def _meta(torch, device, floor, shape, rounds, compile_backend) -> dict:
    from .common import git_commit as _git_commit

    meta = dict(device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
                torch=torch.__version__, python=platform.python_version(), copy_floor_gbs=floor,
                shape=asdict(shape), rounds=rounds, compile_backend=compile_backend,
                date=_dt.date.today().isoformat(), commit=_git_commit())
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta


def to_markdown(result: dict) -> str:
    m, s = result["meta"], result["meta"]["shape"]
    lines = [f"# Gemma 4 MoE experts on {m['device']}", "",
             f"{m['date']}, commit {m['commit']}, torch {m['torch']}; {s['source']}: hidden {s['hidden']}, "
             f"{s['experts']} experts, top-{s['top_k']}, moe_intermediate_size {s['intermediate']}, bf16, "
             f"gelu_pytorch_tanh, experts implementation grouped_mm. Copy floor {m['copy_floor_gbs']:.0f} GB/s measured "
             f"in the same run; medians over {m['rounds']} interleaved rounds; torch.compile backend "
             f"{m['compile_backend'] or '(not run)'}. gate: transformers' _apply_gate on [S, 2I] -> [S, I] (% of the copy floor: "
             "read 2I, write I per row); block: the whole experts forward. '/ eager': median of the per-round "
             "ratios; 'equal': output bit-identical to eager's. gate_up: the first grouped GEMM and the gate, "
             "[S, D] -> [S, I]: eager is torch's grouped GEMM then transformers' gate, ours the fused kernel (the "
             "GeGLU in the grouped GEMM's epilogue); '% of grouped_mm' is the grouped GEMM alone's time over the "
             "row's (its share of that GEMM's rate).", "",
             "| tokens | rows S | step | impl | µs | / eager | % of copy floor | % of grouped_mm | equal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        pct = f"{r['pct_floor']:.1f}" if "pct_floor" in r else "—"
        gmm = f"{r['pct_grouped_mm']:.1f}" if "pct_grouped_mm" in r else "—"
        equal = "—" if r["max_abs"] is None else ("yes" if r["equal"] else "no")
        lines.append(f"| {r['label']} | {r['rows']} | {r['step']} | {r['impl']} | {r['us']} | {r['vs_eager']} | "
                     f"{pct} | {gmm} | {equal} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kerneltools.bench.moe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", type=Path, default=Path("build"), help="the kernel's build tree (kernels loads it)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="writes moe.json and moe.md there")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke run)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compiled rows")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    args = ap.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA GPU.", file=sys.stderr)
        return 2
    if device == "cpu" and not args.quick:
        print("error: the full shapes need a GPU (1.5 GB of bf16 experts, 16384 tokens); on CPU pass --quick.",
              file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"error: --rounds must be at least 1, got {args.rounds}.", file=sys.stderr)
        return 2
    if not args.build_dir.is_dir():
        print(f"error: no build tree at {args.build_dir}: run `python -m kerneltools build` first.", file=sys.stderr)
        return 2
    result, markdown = run(args.build_dir, quick=args.quick, rounds=args.rounds, device=device,
                           compile_backend=None if args.no_compile else args.compile_backend)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe.json").write_text(json.dumps(result, indent=1))
    (args.out / "moe.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
