"""Where the fused gate/up GEMM wins: the measurement behind the package's shipped rules (``_mlp.FUSED_RULES``,
``_experts.FUSED_MIN_ROWS``), which decide from the shape alone so that nothing is timed on the user's machine.

For every MLP shape of the supported models (T5 v1.1, ModernBERT, Gemma 1-3 sizes) and a sweep of row counts, the
fused inference path (``_mlp._fused_forward``: the gate/up GEMM with the GeGLU in its epilogue, then cuBLAS's down
projection) is timed against the regular one (``_mlp.regular``: two cuBLAS GEMMs, the pointwise kernel, the down
GEMM) in alternating rounds, one call at a time with the L2 cache flushed before each (in a model the layers
between two MLPs evict its weights), all enqueued before one synchronisation; the Gemma 4 MoE experts block is
timed the same way with and without its fused grouped GEMM over routed-row counts. The report gives each shape's
fused / regular ratio (median of the per-round ratios) and whether the shipped rule takes the fused path there, so a
shape where the rule's choice is the slower one shows up.

    python -m kerneltools.bench.fused_rule --build-dir build [--out benchmarks/results/h200] [--rounds 11]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from .common import meta, median

# (model, D, H): the MLP widths of the supported families
MLP_SHAPES = [("T5 v1.1 base", 768, 2048), ("ModernBERT base", 768, 1152), ("T5 v1.1 large", 1024, 2816),
              ("ModernBERT large", 1024, 2624), ("Gemma 3 1B", 1152, 6912), ("Gemma 2B", 2048, 16384),
              ("Gemma 2 2B", 2304, 9216), ("Gemma 3 4B", 2560, 10240), ("Gemma 2 9B", 3584, 14336),
              ("Gemma 3 12B", 3840, 15360), ("Gemma 3 27B", 5376, 21504)]
ROWS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
MOE_TOKENS = [256, 512, 2048, 8192]  # x top-8 = routed rows 2048 .. 65536


def interleaved(torch, calls: dict, rounds: int, flush) -> dict:
    """Per-implementation event times (ms) of ``rounds`` alternating rounds, two warm-up calls each first."""
    for _ in range(2):
        for fn in calls.values():
            fn()
    marks = []
    for r in range(rounds):
        names = list(calls) if r % 2 == 0 else list(reversed(calls))
        for name in names:
            flush()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            calls[name]()
            e.record()
            marks.append((r, name, s, e))
    marks[-1][3].synchronize()
    out = {name: [0.0] * rounds for name in calls}
    for r, name, s, e in marks:
        out[name][r] = s.elapsed_time(e)
    return out


def run(build_dir: Path, rounds: int = 11, log=print) -> dict:
    import torch
    import kernels

    geglu = kernels.get_local_kernel(Path(build_dir).resolve())
    mlp = importlib.import_module(geglu.__name__ + "._mlp")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    scratch = torch.empty(2 * max(int(getattr(props, "L2_cache_size", 0)), 64 << 20), dtype=torch.uint8, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    with torch.no_grad():
        for model, D, H in MLP_SHAPES:
            wg, wu = (torch.randn(H, D, device=dev, generator=gen) * D ** -0.5).bfloat16(), None
            wu = (torch.randn(H, D, device=dev, generator=gen) * D ** -0.5).bfloat16()
            wd = (torch.randn(D, H, device=dev, generator=gen) * H ** -0.5).bfloat16()
            for M in ROWS:
                x = torch.randn(M, D, device=dev, generator=gen).bfloat16()
                t = interleaved(torch, {
                    "fused": lambda: mlp._fused_forward(x, wg, wu, wd, "tanh"),
                    "regular": lambda: mlp.regular(x, wg, wu, wd, "tanh")}, rounds, scratch.zero_)
                ratio = median([f / r for f, r in zip(t["fused"], t["regular"])])
                rows_out.append(dict(kind="mlp", model=model, M=M, D=D, H=H, fused_ms=median(t["fused"]),
                                     regular_ms=median(t["regular"]), ratio=ratio,
                                     rule=mlp.fused_rule(M, D, H, dev)))
                log(f"{model:18s} M={M:6d} D={D} H={H}: fused / regular {ratio:.3f} "
                    f"({'fused' if rows_out[-1]['rule'] else 'regular'} by the rule)")
            del wg, wu, wd
        rows_out += _moe_rows(torch, geglu, rounds, scratch.zero_, log)
    return dict(meta=meta(torch), rounds=rounds, rows=rows_out, rules=dict(
        mlp={str(k): v for k, v in mlp.FUSED_RULES.items()},
        moe={str(k): v for k, v in importlib.import_module(geglu.__name__ + "._experts").FUSED_MIN_ROWS.items()}))


def _moe_rows(torch, geglu, rounds, flush, log) -> list:
    from .moe import GEMMA4_26B_A4B, _experts, _routing

    experts = importlib.import_module(geglu.__name__ + "._experts")
    mod = _experts(torch, GEMMA4_26B_A4B, "cuda", torch.bfloat16, "grouped_mm")
    gen = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for tokens in MOE_TOKENS:
        x, idx, w = _routing(torch, GEMMA4_26B_A4B, tokens, "cuda", torch.bfloat16, gen)
        t = interleaved(torch, {
            "fused": lambda: experts._fused_block(mod, x, idx, w, True),
            "regular": lambda: type(mod).forward(mod, x, idx, w)}, rounds, flush)
        ratio = median([f / r for f, r in zip(t["fused"], t["regular"])])
        rows = idx.numel()
        rule = rows >= experts.FUSED_MIN_ROWS.get(torch.cuda.get_device_capability()[0], 1 << 62)
        out.append(dict(kind="moe", model="Gemma 4 26B-A4B experts", M=rows, D=GEMMA4_26B_A4B.hidden,
                        H=GEMMA4_26B_A4B.intermediate, fused_ms=median(t["fused"]), regular_ms=median(t["regular"]),
                        ratio=ratio, rule=rule))
        log(f"MoE routed rows {rows}: fused / regular {ratio:.3f} ({'fused' if rule else 'regular'} by the rule)")
    return out


def to_markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# Fused gate/up GEMM against cuBLAS + pointwise, per shape, on {m['card']}", "",
             f"{m['date']}, commit {m['commit']}, torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}; bf16, "
             f"tanh, {result['rounds']} alternating rounds, L2 flushed before each call.", "",
             f"Shipped rules: dense MLP {result['rules']['mlp']} (fused from min_m rows where H >= min_h), MoE "
             f"experts {result['rules']['moe']} (fused from that many routed rows). A row marked 'no' is a shape "
             "where the rule takes the slower path.", "",
             "| model | rows | D | H | fused ms | regular ms | fused / regular | rule | rule's choice is the faster |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        good = (r["ratio"] < 1.0) == r["rule"] or abs(r["ratio"] - 1.0) < 0.01
        lines.append(f"| {r['model']} | {r['M']} | {r['D']} | {r['H']} | {r['fused_ms']:.3f} | "
                     f"{r['regular_ms']:.3f} | {r['ratio']:.3f} | {'fused' if r['rule'] else 'regular'} | "
                     f"{'yes' if good else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", type=Path, default=Path("build"))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=11)
    args = p.parse_args(argv)
    result = run(args.build_dir, args.rounds)
    md = to_markdown(result)
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fused-rule.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "fused-rule.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
