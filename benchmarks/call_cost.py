"""What one call of each op costs the host, for two or more builds of the kernel, in one run.

A change that moves code around (a regrouping, a new dispatch layer) must not make a call dearer: at decode sizes
the host's time is the call's time. Each build is loaded by ``kernels.get_local_kernel`` in a worker process of its
own (two builds of one kernel cannot share a process); the workers take turns, one at a time, in interleaved rounds
(the order alternates), and each round times ``--calls`` back-to-back calls of every case on tiny tensors, so a
call's time is its host cost (on CUDA the launches queue while the host runs ahead; the last call is synchronised).
A round's time is the fastest of ``--blocks`` equal blocks of those calls (an interrupt or a migration of the
process lands in one block, not in the round), and each worker is pinned to a core of its own where the host has
enough.

Cases: the pointwise op (plain, with a gradient recorded: forward + backward, packed), RMSNorm, the MLP layer's
forward (``layers.GeGLUMLP`` on a module with nn.Linear projections), and the pointwise op inside a compiled
function (``torch.compile``, fullgraph: the op as an Inductor graph calls it).

    python benchmarks/call_cost.py --build before=/tmp/a/build --build after=build [--device cuda] [--out DIR]

Prints and writes (``--out``) µs per call of each case and build (the median over rounds) and each build's median
per-round ratio to the first build's, with the range.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

CASES = ("geglu", "geglu autograd", "geglu_packed", "rms_norm", "GeGLUMLP layer", "geglu compiled")


def _cases(path: str, device: str) -> dict:
    """name -> a function running one call (in the worker that loaded the build at ``path``)."""
    import kernels
    import torch
    from torch import nn

    geglu = kernels.get_local_kernel(Path(path))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g, u = (torch.randn(1, 256, device=device, dtype=dtype) for _ in range(2))
    x = torch.randn(1, 512, device=device, dtype=dtype)
    gr = g.clone().requires_grad_()
    dy = torch.randn(1, 256, device=device, dtype=dtype)
    w = torch.zeros(256, device=device, dtype=dtype)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(64, 128, bias=False), nn.Linear(64, 128, bias=False)
            self.down_proj, self.act_fn = nn.Linear(128, 64, bias=False), nn.GELU(approximate="tanh")

    mlp = MLP().to(device=device, dtype=dtype)
    mlp_forward = geglu.layers.GeGLUMLP.forward
    h = torch.randn(1, 64, device=device, dtype=dtype)

    @torch.compile(fullgraph=True, dynamic=False)
    def compiled(a, b):
        return geglu.geglu(a, b, "tanh")

    def autograd():
        geglu.geglu(gr, u, "tanh").backward(dy)

    cases = {
        "geglu": lambda: geglu.geglu(g, u, "tanh"),
        "geglu autograd": autograd,
        "geglu_packed": lambda: geglu.geglu_packed(x, "tanh"),
        "rms_norm": lambda: geglu.rms_norm(g, w, 1e-6),
        "GeGLUMLP layer": lambda: mlp_forward(mlp, h),
        "geglu compiled": lambda: compiled(g, u),
    }
    with torch.no_grad():
        for name, fn in cases.items():
            if name == "geglu autograd":
                with torch.enable_grad():
                    fn()
            else:
                fn()
    return cases


def _worker(path: str, device: str, conn, core: int | None) -> None:
    import torch

    if core is not None:
        os.sched_setaffinity(0, {core})
    cases = _cases(path, device)
    conn.send(sorted(cases))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        name, calls, blocks = msg
        fn = cases[name]
        per_block = max(1, calls // blocks)
        best = float("inf")
        with torch.set_grad_enabled(name == "geglu autograd"):
            for _ in range(10):
                fn()
            for _ in range(blocks):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(per_block):
                    fn()
                if device == "cuda":
                    torch.cuda.synchronize()
                best = min(best, (time.perf_counter() - t0) / per_block * 1e6)
        conn.send(best)


def _cores(n: int) -> list:
    """A core of its own for each of ``n`` workers (leaving core 0 to this process), or None each where too few."""
    try:
        free = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return [None] * n
    return free[1:n + 1] if len(free) > n else [None] * n


def run(builds: dict, device: str, rounds: int, calls: int, blocks: int = 5, log=print) -> dict:
    ctx = mp.get_context("spawn")
    workers = {}
    for (label, path), core in zip(builds.items(), _cores(len(builds))):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(str(path), device, child, core), daemon=True)
        proc.start()
        workers[label] = (proc, parent)
        parent.recv()  # loaded and warmed up
    labels = list(builds)
    times = {label: {c: [] for c in CASES} for label in labels}
    try:
        for r in range(rounds):
            order = labels if r % 2 == 0 else labels[::-1]
            for case in CASES:
                for label in order:
                    conn = workers[label][1]
                    conn.send((case, calls, blocks))
                    times[label][case].append(conn.recv())
            log(f"round {r + 1}/{rounds}")
    finally:
        for proc, conn in workers.values():
            conn.send(None)
            proc.join(10)
    first = labels[0]
    rows = []
    for case in CASES:
        row = {"case": case}
        for label in labels:
            row[f"{label} us"] = round(statistics.median(times[label][case]), 2)
            if label != first:
                ratios = [b / a for a, b in zip(times[first][case], times[label][case])]
                row[f"{label} / {first}"] = [round(statistics.median(ratios), 3), round(min(ratios), 3),
                                             round(max(ratios), 3)]
        rows.append(row)
    return {"device": device, "rounds": rounds, "calls": calls, "blocks": blocks,
            "builds": {k: str(v) for k, v in builds.items()}, "rows": rows}


def to_markdown(result: dict) -> str:
    labels = list(result["builds"])
    first = labels[0]
    head = ["case"] + [f"{label} µs" for label in labels] + [f"{label} / {first} [range]" for label in labels[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        cells = [row["case"]] + [f"{row[f'{label} us']:.2f}" for label in labels]
        cells += [f"{r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]" for r in (row[f"{label} / {first}"] for label in labels[1:])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", action="append", required=True, metavar="LABEL=PATH",
                   help="a build variant folder to load (e.g. build/torch-cpu), twice or more; the first is the "
                        "reference of the ratios")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--blocks", type=int, default=5, help="a round's time is the fastest of this many blocks")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    builds = {}
    for item in args.build:
        label, sep, path = item.partition("=")
        if not sep or not Path(path).is_dir():
            p.error(f"--build {item!r}: expected LABEL=PATH with PATH a build variant folder")
        builds[label] = Path(path).resolve()
    if len(builds) < 2:
        p.error("give at least two --build LABEL=PATH")
    if args.calls < 1 or args.blocks < 1:
        p.error(f"--calls {args.calls} --blocks {args.blocks}: expected both at least 1")
    result = run(builds, args.device, args.rounds, args.calls, min(args.blocks, args.calls),
                 log=lambda m: print(m, file=sys.stderr))
    md = to_markdown(result)
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "call-cost.json").write_text(json.dumps(result, indent=1))
        (args.out / "call-cost.md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
