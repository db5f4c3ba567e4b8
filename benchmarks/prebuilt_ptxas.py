"""Two builds' prebuilt Triton kernels against each other on this GPU, in one process: the kernel benchmarks'
workloads (pointwise GeGLU forward and backward, RMSNorm forward + backward, the fused gate/up GEMM at inference and
training tiles, the MoE grouped GEMM), each launched through build A's cubins and through build B's, alternating
rounds, bf16. It says whether each workload's output is bit-identical between the two and B's median time over A's.

Made for the CUDA 12.9 ptxas (the shipped cubins) against CUDA 13.x's (Triton's default from sm_90 up):

    python -m kerneltools build --capability 9.0 --aot-capability 9.0                        # A: build/
    KERNELTOOLS_AOT_PTXAS=$(python -c 'import triton, os; print(os.path.dirname(triton.__file__))')/backends/nvidia/bin/ptxas-blackwell \\
        python -m kerneltools build --out /tmp/ptxas13 --variant cuda --aot-capability 9.0
    mkdir -p build-ptxas13 && cp /tmp/ptxas13/torch-cuda/_prebuilt_sm90.* build-ptxas13/              # B
    python benchmarks/prebuilt_ptxas.py --build-dir build --other build-ptxas13

The package is loaded once from ``--build-dir`` (kernels' loader); ``--other`` is a folder holding build B's
``_prebuilt_sm*.{json,cubin}``, which replace the loaded variant's for B's rounds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", type=Path, default=Path("build"))
    p.add_argument("--other", type=Path, required=True, help="a folder holding build B's _prebuilt_sm* files")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)

    import kernels
    import torch

    geglu = kernels.get_local_kernel(args.build_dir.resolve())
    aot = importlib.import_module(geglu.__name__ + ".runtime.aot")
    launch = importlib.import_module(geglu.__name__ + ".runtime.launch")
    kt = importlib.import_module(geglu.__name__ + ".mlp.kernels")
    et = importlib.import_module(geglu.__name__ + ".experts.kernels")
    builds = {"A": aot.HERE, "B": str(args.other.resolve())}
    infos = {}

    def use(name):
        aot.HERE = builds[name]
        aot.clear_caches()
        launch.clear_caches()

    hits = []
    real_find = aot.find

    def find(*a, **k):
        run = real_find(*a, **k)
        hits.append(run is not None)
        return run

    aot.find = find
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(8192, 2 * 14336, device=dev, dtype=torch.bfloat16)
    g, u = x.chunk(2, -1)
    gc, uc = g.contiguous(), u.contiguous()
    dy = torch.randn_like(gc)
    xn = torch.randn(16384, 2560, device=dev, dtype=torch.bfloat16)
    wn = torch.randn(2560, device=dev, dtype=torch.bfloat16) * 0.1
    dyn = torch.randn_like(xn)
    xm = torch.randn(2048, 2560, device=dev, dtype=torch.bfloat16)
    wg, wu = (torch.randn(10240, 2560, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(2))
    xe = torch.randn(8192, 2816, device=dev, dtype=torch.bfloat16)
    we = torch.randn(128, 2 * 704, 2816, device=dev, dtype=torch.bfloat16) * 0.02
    counts = torch.multinomial(torch.ones(128), 8192, replacement=True).bincount(minlength=128)
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(dev)

    def norm():
        xl, wl = xn.detach().requires_grad_(), wn.detach().requires_grad_()
        y = geglu.rms_norm(xl, wl)
        y.backward(dyn)
        return torch.cat([y.flatten(), xl.grad.flatten(), wl.grad.flatten()])

    workloads = {
        "pointwise fwd 8192x14336 (rows)": lambda: geglu.geglu(g, u),
        "pointwise fwd 8192x14336 (flat)": lambda: geglu.geglu(gc, uc),
        "pointwise bwd 8192x14336": lambda: torch.cat(geglu.geglu_backward(dy, gc, uc)),
        "rmsnorm fwd+bwd 16384x2560": norm,
        "fused MLP gate/up 2048x2560->10240": lambda: kt.gate_up_geglu(xm, wg, wu, False, kt.inference_config(2048)),
        "MoE grouped 8192x2816, 128 experts x 704": lambda: et.grouped_gate_up_geglu(xe, we, offsets, True),
    }
    times = {w: {"A": [], "B": []} for w in workloads}
    outputs = {w: {} for w in workloads}
    with geglu.configure(backend="triton"):
        for r in range(args.rounds):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                use(name)
                infos[name] = aot.info()
                for w, fn in workloads.items():
                    hits.clear()
                    out = fn()
                    torch.cuda.synchronize()
                    if not hits or not all(hits):
                        raise SystemExit(f"error: {w} did not run on build {name}'s prebuilt kernels ({hits})")
                    if r == 0:
                        outputs[w][name] = out.clone()
                    for _ in range(3):
                        fn()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize()
                    start.record()
                    for _ in range(args.reps):
                        fn()
                    end.record()
                    end.synchronize()
                    times[w][name].append(start.elapsed_time(end) / args.reps * 1e3)  # us per call
    rows = []
    for w in workloads:
        a, b = statistics.median(times[w]["A"]), statistics.median(times[w]["B"])
        rows.append(dict(workload=w, a_us=a, b_us=b, ratio=b / a,
                         identical=bool(torch.equal(outputs[w]["A"], outputs[w]["B"]))))
    props = torch.cuda.get_device_properties(0)
    result = dict(date=time.strftime("%Y-%m-%d"), gpu=props.name, torch=torch.__version__,
                  a=dict(dir=builds["A"], ptxas=infos["A"]["ptxas"]), b=dict(dir=builds["B"], ptxas=infos["B"]["ptxas"]),
                  rounds=args.rounds, reps=args.reps, rows=rows)
    lines = [f"# Prebuilt cubins: ptxas {infos['A']['ptxas']} (A) against ptxas {infos['B']['ptxas']} (B) on {props.name}",
             "", f"{result['date']}, torch {torch.__version__}, bf16; median of {args.rounds} alternating rounds of "
             f"{args.reps} calls each (µs per call, including the host's launch).", "",
             "| workload | A (µs) | B (µs) | B / A | same bits |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['workload']} | {row['a_us']:.1f} | {row['b_us']:.1f} | {row['ratio']:.3f} | "
                     f"{'yes' if row['identical'] else 'no'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prebuilt-ptxas.md").write_text(text)
    (args.out / "prebuilt-ptxas.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
