"""Mutation check: plants representative bugs, one at a time, in a temporary copy of the repository and runs the
part of the CPU test suite that should catch each; every mutant must turn it red (docs/development.md, "Mutation
check").

    scripts/mutation-check.sh              # all mutants
    scripts/mutation-check.sh -k rounding  # the mutants whose name contains "rounding"
    scripts/mutation-check.sh --list       # names, files and the tests that should fail

The copy holds the working tree as git sees it (tracked and untracked, not ignored files), so uncommitted edits are
checked too. Every mutation is an exact text replacement; when its text is no longer in the file (the code
changed), the check stops before running anything and says which mutation to update. Exit status: 0 when every
mutant was caught, 1 when one survived (or its tests errored, or the unmutated suite was not green), 2 when a
mutation no longer applies.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "torch-ext/geglu"


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the bug, in words
    path: str  # file, relative to the repository root
    old: str  # exact text, occurring `count` times in the file
    new: str
    tests: tuple  # pytest selectors (files or node ids) that must fail
    count: int = 1
    needs: tuple = ()  # programs the catching tests need (a mutant is reported as not checked without them)


NUMERICS = "tests/kernel/test_numerics.py"
EMULATION = "tests/kernel/test_rounding_emulation.py"
EPILOGUE = "tests/kernel/test_epilogue_math.py"
PTX = "tests/kernel/test_triton_ptx.py"

MUTANTS = [
    Mutant("gelu-formula", "the erf GELU without the 1/sqrt(2) scaling (Triton)", f"{PKG}/runtime/gelu_math.py",
           "        h = x * 0.5 * (1.0 + _erf(x * K_ALPHA))",
           "        h = x * 0.5 * (1.0 + _erf(x))",
           (NUMERICS,)),
    Mutant("cpu-approximation-ignored", "the CPU implementation computes the exact GELU for 'tanh'",
           f"{PKG}/pointwise/cpu.py",
           "    h = F.gelu(gate, approximate=approximate)\n    if out.is_contiguous():",
           "    h = F.gelu(gate)\n    if out.is_contiguous():",
           (NUMERICS,)),
    Mutant("fwd-rounding-missing", "the forward's GELU not rounded to the storage dtype before the product "
           "(flat Triton kernel)", f"{PKG}/pointwise/kernels.py",
           "    h = round_to(gelu(g.to(tl.float32), TANH, K_BETA_TANH, K_KAPPA, K_ALPHA), T).to(tl.float32)\n"
           "    out = round_to(h * u.to(tl.float32), T)",
           "    h = gelu(g.to(tl.float32), TANH, K_BETA_TANH, K_KAPPA, K_ALPHA)\n"
           "    out = round_to(h * u.to(tl.float32), T)",
           (EMULATION,)),
    Mutant("bwd-rounding-missing", "the backward's d_h = dy * up not rounded before gelu_backward (Triton)",
           f"{PKG}/pointwise/kernels.py",
           "    d_h = round_to(dy * u, T).to(tl.float32)",
           "    d_h = dy * u",
           (EMULATION,), count=2),
    Mutant("gate-up-swapped", "gate and up swapped in the flat forward's launch", f"{PKG}/pointwise/kernels.py",
           "launch(_geglu_fwd_flat_kernel, grid, (gate, up, out, M * N)",
           "launch(_geglu_fwd_flat_kernel, grid, (up, gate, out, M * N)",
           (NUMERICS,)),
    Mutant("tail-mask-off-by-one", "the flat forward's tail mask drops the last element", f"{PKG}/pointwise/kernels.py",
           "        mask = offs < n\n        g = tl.load(gate_ptr + offs, mask=mask, other=0.0)",
           "        mask = offs < n - 1\n        g = tl.load(gate_ptr + offs, mask=mask, other=0.0)",
           (NUMERICS, EMULATION)),
    Mutant("wrong-backward-term", "the erf GELU's derivative without the x factor of x * pdf", f"{PKG}/runtime/gelu_math.py",
           "        g = tl.fma(one_plus_erf, 0.5, x * pdf)",
           "        g = tl.fma(one_plus_erf, 0.5, pdf)",
           (NUMERICS,)),
    Mutant("cpu-backward-term", "the CPU backward's gelu_backward fed dy instead of d_h = dy * up", f"{PKG}/pointwise/cpu.py",
           "    dg = torch.ops.aten.gelu_backward(d_h, gate, approximate=approximate)",
           "    dg = torch.ops.aten.gelu_backward(grad, gate, approximate=approximate)",
           (NUMERICS,)),
    Mutant("act-first-ignored", "packed inputs always activate the first half", f"{PKG}/pointwise/ops.py",
           "    return (a, b) if act_first else (b, a)",
           "    return (a, b)",
           (NUMERICS,)),
    Mutant("kernel-never-called", "layers never recognise a GELU (the host's own code always runs)",
           f"{PKG}/_activations.py",
           "    if isinstance(act, torch.nn.GELU):\n",
           "    return None\n    if isinstance(act, torch.nn.GELU):\n",
           ("tests/kernel/test_layers.py",)),
    Mutant("prebuilt-hints-ignored", "a prebuilt binary runs for a launch that breaks its alignment assumptions",
           f"{PKG}/runtime/aot.py",
           '        if entry["hint_mask"] & ~have == 0:',
           "        if True:",
           ("tests/kernel/test_prebuilt.py::test_lookup_takes_the_most_specialised_binary_the_launch_allows",)),
    Mutant("fused-rule-ignored", "the MLP's inference path takes the fused kernel whatever the shipped rule says",
           f"{PKG}/mlp/inference.py",
           "    if not fused_kernel_applies(x2) or not fused_rule(x2.shape[0], D, H, x.device):",
           "    if not fused_kernel_applies(x2):",
           ("tests/kernel/test_fused_mlp.py::test_inference_follows_the_shipped_rule_without_timing",)),
    Mutant("training-node-order", "the training node's backward sums dx from d_g twice (d_u's GEMM dropped)",
           f"{PKG}/mlp/training.py",
           "            dx = dx.add_(torch.mm(d_u, w_up)).view(x.shape)",
           "            dx = dx.add_(torch.mm(d_g, w_up)).view(x.shape)",
           ("tests/kernel/test_mlp_train.py",)),
    Mutant("fast-epilogue-tanh-for-erf", "the fused inference epilogue computes the tanh GELU for erf",
           f"{PKG}/mlp/tiles.py",
           "            h = gelu(acc_g, TANH, K_BETA_TANH, K_KAPPA, K_ALPHA)",
           "            h = acc_g * _tanh_gelu_sigmoid(acc_g, K_BETA_TANH, K_KAPPA)",
           (EPILOGUE,)),
    Mutant("erf-ptx-coefficient", "a typo in a coefficient of the erf PTX (GPU only: the interpreter never runs it)",
           f"{PKG}/runtime/gelu_math.py",
           "    fma.rn.f32 rs, rs, s, 0fBEC093AC;",
           "    fma.rn.f32 rs, rs, s, 0fBEC093AD;",
           (PTX,), needs=("nvcc",)),
    Mutant("contraction-not-eagers", "1 - t*t as a separate product and difference, where eager's SASS has an FFMA",
           f"{PKG}/runtime/gelu_math.py",
           "        tanh_derivative = tl.fma(-t, t, 1.0)",
           "        tanh_derivative = 1.0 - t * t",
           (PTX,)),
    Mutant("libdevice-exp", "Triton's own exp (ex2.approx) in place of CUDA's expf sequence", f"{PKG}/runtime/gelu_math.py",
           "        pdf = _exp(-0.5 * x * x) * K_BETA_ERF",
           "        pdf = tl.exp(-0.5 * x * x) * K_BETA_ERF",
           (PTX,)),
    Mutant("fp-fusion-on", "the pointwise kernels launched with LLVM's FMA contraction on", f"{PKG}/runtime/launch.py",
           "    compiled = fn[grid](*args, *consts, num_warps=num_warps, enable_fp_fusion=False)",
           "    compiled = fn[grid](*args, *consts, num_warps=num_warps)",
           (f"{PTX}::test_launches_turn_off_fp_fusion",)),
    Mutant("cuda-gelu-reassociated", "the CUDA kernel's erf GELU multiplies in another order",
           "geglu/geglu_kernels.cuh",
           "  return x * float(0.5) * (float(1) + ::erff(x * kAlpha));",
           "  return x * (float(0.5) * (float(1) + ::erff(x * kAlpha)));",
           ("tests/kernel/test_cuda_numerics_sass.py",), needs=("nvcc",)),
    Mutant("out-written-before-checks", "geglu(out=) computes into out before validating the call",
           f"{PKG}/functional.py",
           "        check_split(gate, up, approximate, out)\n        _impl.forward_into(out, gate, up, approximate)\n",
           "        _impl.forward_into(out, gate, up, approximate)\n        check_split(gate, up, approximate, out)\n",
           ("tests/kernel/test_refused_out.py",)),
    Mutant("parent-commit-unchecked", "the Hub commit endpoint ignores parentCommit (a stale commit is merged)",
           "kerneltools/hub/server.py",
           'parent_commit=h.get("parentCommit"),',
           "parent_commit=None,",
           ("tests/tools/test_hub_server.py::test_parent_commit",)),
    Mutant("compiled-layer-opaque", "under torch.compile a pointwise layer calls the op (Inductor cannot fuse it)",
           f"{PKG}/functional.py",
           "        activated = act(gate)\n        return activated * up_proj(x)",
           "        return geglu(gate, up_proj(x), gelu_approximation(act))",
           ("tests/tools/test_bench_model.py::test_compiled_graph_is_the_hosts_but_for_the_rope_op",)),
    Mutant("compiled-layer-order", "under torch.compile a layer runs the up projection before the activation",
           f"{PKG}/functional.py",
           "        activated = act(gate)\n        return activated * up_proj(x)",
           "        up = up_proj(x)\n        return act(gate) * up",
           ("tests/tools/test_bench_model.py::test_compiled_graph_is_the_hosts_but_for_the_rope_op",)),
    Mutant("experts-tile-wrong-expert", "the fused experts GEMM reads every tile's weights from expert 0",
           f"{PKG}/experts/kernels.py",
           "w_desc.load([e, 0, off_n, k * BLOCK_K])",
           "w_desc.load([0, 0, off_n, k * BLOCK_K])",
           ("tests/kernel/test_experts_fused.py",)),
    Mutant("experts-rows-from-zero", "the fused experts GEMM starts every expert's row tiles at row 0",
           f"{PKG}/experts/kernels.py",
           "off_m = row_start + (local % m_tiles) * BLOCK_M",
           "off_m = (local % m_tiles) * BLOCK_M",
           ("tests/kernel/test_experts_fused.py",)),
    Mutant("experts-fused-in-training", "the fused experts block also runs when a gradient is recorded",
           f"{PKG}/experts/ops.py",
           "    if torch.is_grad_enabled() and any(",
           "    if False and any(",
           ("tests/kernel/test_experts_fused.py",)),
    Mutant("scaled-norm-offset-one", "Gemma 4's norm runs the kernels with Gemma's 1 + w scale",
           f"{PKG}/rmsnorm/ops.py",
           "            return _run(x, w, eps if type(eps) is float else _as_float(eps, \"eps\"), 0.0)",
           "            return _run(x, w, eps if type(eps) is float else _as_float(eps, \"eps\"), 1.0)",
           ("tests/kernel/test_rmsnorm.py::test_scaled_layer_inference_and_training",)),
    Mutant("scaled-norm-rsqrt-on-cpu", "Gemma 4's norm on CPU uses rsqrt where the host uses torch.pow(ms, -0.5)",
           f"{PKG}/rmsnorm/ops.py",
           "    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)",
           "    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)",
           ("tests/tools/test_transformers_rmsnorm.py",)),
]


def snapshot(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked files, not ignored ones) copied to dest."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file() or src.is_symlink():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel, follow_symlinks=False)


def stale(mutants: list[Mutant]) -> list[str]:
    problems = []
    for m in mutants:
        path = ROOT / m.path
        if not path.is_file():
            problems.append(f"{m.name}: {m.path} does not exist")
            continue
        n = path.read_text().count(m.old)
        if n != m.count:
            problems.append(f"{m.name}: the text to mutate occurs {n} times in {m.path}, expected {m.count}:\n"
                            + "\n".join(f"      | {line}" for line in m.old.splitlines()))
    return problems


def pytest(copy: Path, selectors, env) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *selectors]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def first_failure(output: str) -> str:
    m = re.search(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$", output, re.M)
    if not m:
        return ""
    reason = (m.group(3) or "").strip()
    return f"{m.group(2)}" + (f"\n{'':13}{reason[:150]}" if reason else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", dest="only", help="run only the mutants whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run of the unmutated tests")
    args = ap.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or args.only in m.name]
    if args.list:
        for m in mutants:
            print(f"{m.name:30} {m.path}\n{'':30} {m.what}\n{'':30} caught by: {' '.join(m.tests)}")
        return 0
    if not mutants:
        print(f"no mutant matches {args.only!r}", file=sys.stderr)
        return 2
    problems = stale(mutants)
    if problems:
        print("mutation-check: the code changed under these mutations; update them in scripts/mutation_check.py:",
              file=sys.stderr)
        for p in problems:
            print("  " + p, file=sys.stderr)
        return 2

    env = dict(os.environ)
    env.pop("GEGLU_BUILD_DIR", None)  # the tests must build the mutated copy, not load a prebuilt kernel
    env.setdefault("GEGLU_TEST_SEED", str(int.from_bytes(os.urandom(4), "little")))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["COLUMNS"] = "250"  # pytest's summary lines: room for the failure's message
    tmp = Path(tempfile.mkdtemp(prefix="geglu-mutants-"))
    copy = tmp / "repo"
    env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")
    try:
        snapshot(copy)
        print(f"mutation check: {len(mutants)} mutants, copy in {copy}, GEGLU_TEST_SEED={env['GEGLU_TEST_SEED']}")
        if not args.no_baseline:
            selectors = sorted({s for m in mutants for s in m.tests})
            rc, out, secs = pytest(copy, selectors, env)
            status = "green" if rc == 0 else f"NOT GREEN (pytest exit {rc})"
            print(f"unmutated: {status} in {secs:.0f} s ({out.strip().splitlines()[-1] if out.strip() else ''})")
            if rc != 0:
                print(out[-3000:])
                return 1
        results = []
        for m in mutants:
            missing = [p for p in m.needs if shutil.which(p) is None]
            if missing:
                results.append((m, "NOT CHECKED"))
                print(f"NOT CHECKED  {m.name}: needs {', '.join(missing)}")
                continue
            target = copy / m.path
            original = target.read_text()
            target.write_text(original.replace(m.old, m.new))
            try:
                rc, out, secs = pytest(copy, m.tests, env)
            finally:
                target.write_text(original)
            verdict = {0: "SURVIVED", 1: "caught"}.get(rc, f"ERROR (pytest exit {rc})")
            results.append((m, verdict))
            print(f"{verdict:12} {m.name} ({m.path}, {secs:.0f} s): {m.what}")
            if rc == 1:
                print(f"{'':13}by {first_failure(out)}")
            else:
                print("\n".join(f"{'':13}{line}" for line in out.strip().splitlines()[-15:]))
        caught = sum(v == "caught" for _, v in results)
        unchecked = sum(v == "NOT CHECKED" for _, v in results)
        bad = len(results) - caught - unchecked
        print(f"\n{caught} of {len(results)} mutants caught" + (f", {unchecked} not checked here" if unchecked else "")
              + (f", {bad} NOT caught" if bad else ""))
        return 1 if bad else 0
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
