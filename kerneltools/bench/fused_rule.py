"""Where the fused gate/up GEMM wins: the measurement behind the package's shipped rules (``mlp.inference.FUSED_RULES``,
``experts.ops.FUSED_RULES``), which decide from the shape alone so that nothing is timed on the user's machine.

For every MLP shape of the supported models (T5 v1.1, ModernBERT, Gemma 1-3 sizes) and a sweep of row counts, the
fused inference path (``mlp.inference.fused_forward``: the gate/up GEMM with the GeGLU in its epilogue, then cuBLAS's down
projection) is timed against the regular one (``mlp.inference.regular``: two cuBLAS GEMMs, the pointwise kernel, the down
GEMM) in alternating rounds, one call at a time with the L2 cache flushed before each (in a model the layers
between two MLPs evict its weights); the Gemma 4 MoE experts block is timed the same way with and without its
fused grouped GEMM over routed-row counts. Two times per call: GPU time (the call captured in a CUDA graph, its
replays timed with events: the work alone, which is what a GPU-bound prefill pays) and eager time (the call
launched from Python, all calls enqueued before one synchronisation: where the host is slower than the GPU, the
host's time). The report gives each shape's fused / regular ratios (medians of the per-round ratios) and whether
the shipped rule takes the fused path there; a shape where the rule's choice is slower by both measures is marked.

    python -m kerneltools.bench.fused_rule --build-dir build [--out benchmarks/results/h200] [--rounds 11]
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from .common import meta, median, print_and_write

# (model, D, H): the MLP widths of the supported families
MLP_SHAPES = [("T5 v1.1 base", 768, 2048), ("ModernBERT base", 768, 1152), ("T5 v1.1 large", 1024, 2816),
              ("ModernBERT large", 1024, 2624), ("Gemma 3 1B", 1152, 6912), ("Gemma 2B", 2048, 16384),
              ("Gemma 2 2B", 2304, 9216), ("Gemma 3 4B", 2560, 10240), ("Gemma 2 9B", 3584, 14336),
              ("Gemma 3 12B", 3840, 15360), ("Gemma 3 27B", 5376, 21504)]
ROWS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
MOE_TOKENS = [256, 512, 2048, 8192]  # x top-8 = routed rows 2048 .. 65536


def interleaved(torch, calls: dict, rounds: int, flush, graphs: bool) -> dict:
    """Per-implementation event times (ms) of ``rounds`` alternating rounds, two warm-up calls each first; with
    ``graphs`` each call is captured in a CUDA graph once and its replays are timed (GPU time only)."""
    for _ in range(2):
        for fn in calls.values():
            fn()
    torch.cuda.synchronize()
    run = dict(calls)
    if graphs:
        for name, fn in calls.items():
            g = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(g):
                fn()
            run[name] = g.replay
    marks = []
    for r in range(rounds):
        names = list(run) if r % 2 == 0 else list(reversed(run))
        for name in names:
            flush()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            run[name]()
            e.record()
            marks.append((r, name, s, e))
    marks[-1][3].synchronize()
    out = {name: [0.0] * rounds for name in run}
    for r, name, s, e in marks:
        out[name][r] = s.elapsed_time(e)
    return out


def measure(torch, calls: dict, rounds: int, flush) -> dict:
    """GPU and eager times of the two calls, and their fused / regular ratios."""
    row = {}
    for mode, graphs in (("gpu", True), ("eager", False)):
        try:
            t = interleaved(torch, calls, rounds, flush, graphs)
        except RuntimeError as e:  # a call that cannot be captured (a host synchronisation inside)
            row[f"{mode}_error"] = str(e).splitlines()[0][:120]
            continue
        row[f"{mode}_fused_ms"], row[f"{mode}_regular_ms"] = median(t["fused"]), median(t["regular"])
        row[f"{mode}_ratio"] = median([f / r for f, r in zip(t["fused"], t["regular"])])
    return row


def run(build_dir: Path, rounds: int = 11, log=print) -> dict:
    import torch
    import kernels

    geglu = kernels.get_local_kernel(Path(build_dir).resolve())
    mlp = importlib.import_module(geglu.__name__ + ".mlp.inference")
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
                row = measure(torch, {
                    "fused": lambda: mlp.fused_forward(x, wg, wu, wd, "tanh"),
                    "regular": lambda: mlp.regular(x, wg, wu, wd, "tanh")}, rounds, scratch.zero_)
                rows_out.append(dict(kind="mlp", model=model, M=M, D=D, H=H, rule=mlp.fused_rule(M, D, H, dev),
                                     **row))
                log(f"{model:18s} M={M:6d} D={D} H={H}: fused / regular GPU {row.get('gpu_ratio', 0):.3f} eager "
                    f"{row.get('eager_ratio', 0):.3f} ({'fused' if rows_out[-1]['rule'] else 'regular'} by the rule)")
            del wg, wu, wd
        rows_out += _moe_rows(torch, geglu, rounds, scratch.zero_, log)
    return dict(meta=meta(torch), rounds=rounds, rows=rows_out, rules=dict(
        mlp={str(k): v for k, v in mlp.FUSED_RULES.items()},
        moe={str(k): v for k, v in importlib.import_module(geglu.__name__ + ".experts.ops").FUSED_RULES.items()}))


def _moe_rows(torch, geglu, rounds, flush, log) -> list:
    from .moe import GEMMA4_26B_A4B, _experts, _routing

    experts = importlib.import_module(geglu.__name__ + ".experts.ops")
    mod = _experts(torch, GEMMA4_26B_A4B, "cuda", torch.bfloat16, "grouped_mm")
    gen = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for tokens in MOE_TOKENS:
        x, idx, w = _routing(torch, GEMMA4_26B_A4B, tokens, "cuda", torch.bfloat16, gen)
        row = measure(torch, {
            "fused": lambda: experts.fused_block(mod, x, idx, w, True),
            "regular": lambda: type(mod).forward(mod, x, idx, w)}, rounds, flush)
        rows = idx.numel()
        rule = experts.fused_rule(rows, x.device)
        out.append(dict(kind="moe", model="Gemma 4 26B-A4B experts", M=rows, D=GEMMA4_26B_A4B.hidden,
                        H=GEMMA4_26B_A4B.intermediate, rule=rule, **row))
        log(f"MoE routed rows {rows}: fused / regular GPU {row.get('gpu_ratio', 0):.3f} eager "
            f"{row.get('eager_ratio', 0):.3f} ({'fused' if rule else 'regular'} by the rule)")
    return out


def to_markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# Fused gate/up GEMM against cuBLAS + pointwise, per shape, on {m['card']}", "",
             f"{m['date']}, commit {m['commit']}, torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}; bf16, "
             f"tanh, {result['rounds']} alternating rounds, L2 flushed before each call. GPU: the call's CUDA-graph "
             "replay (its work alone); eager: launched from Python (the host's time where it is the slower).", "",
             f"Shipped rules: dense MLP {result['rules']['mlp']} (fused from min_m rows where M * D * H reaches min_work), MoE "
             f"experts {result['rules']['moe']} (fused from min_rows routed rows). 'no' in the last column: the "
             "rule takes the path that is slower by more than 1 % both on the GPU and launched from Python.", "",
             "| model | rows | D | H | GPU fused / regular ms | GPU ratio | eager fused / regular ms | eager ratio | "
             "rule | rule's choice the faster by one measure |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def pair(r, mode):
        if f"{mode}_ratio" not in r:
            return "—", r.get(f"{mode}_error", "—")
        return f"{r[f'{mode}_fused_ms']:.3f} / {r[f'{mode}_regular_ms']:.3f}", f"{r[f'{mode}_ratio']:.3f}"

    for r in result["rows"]:
        ratios = [r[k] for k in ("gpu_ratio", "eager_ratio") if k in r]
        good = any(x <= 1.01 for x in ratios) if r["rule"] else any(x >= 0.99 for x in ratios)
        lines.append(f"| {r['model']} | {r['M']} | {r['D']} | {r['H']} | {' | '.join(pair(r, 'gpu'))} | "
                     f"{' | '.join(pair(r, 'eager'))} | {'fused' if r['rule'] else 'regular'} | "
                     f"{'yes' if good else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", type=Path, default=Path("build"))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=11)
    args = p.parse_args(argv)
    result = run(args.build_dir, args.rounds)
    print_and_write(args.out, "fused-rule", result, to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
