"""Triton's GPU bit-exactness, checked without a GPU: the compiled pointwise kernels compute eager's GELU with
CUDA's own erff/tanhf/expf instruction sequences and no other approximation or FMA contraction.

tests/kernel/_triton_offline.py compiles the kernels with `triton.compile` for NVIDIA targets (in a subprocess with
TRITON_INTERPRET unset, so that runtime/gelu_math.py defines its PTX, not the interpreter's stand-ins), with the launcher's
options (enable_fp_fusion=False). Then:

* the PTX of every pointwise kernel (forward/backward, flat/row-strided, erf/tanh, each dtype) holds the inline
  erf/tanh/exp sequences of runtime/gelu_math.py once per element and nothing else transcendental: no libdevice call, no
  ex2/rcp/tanh approximation outside those sequences, every float add/sub/mul marked `.rn` (ptxas may not contract
  it into an FMA), FMAs only where _gelu/_gelu_grad write tl.fma, conversions to the storage dtype round to
  nearest even;
* (with nvcc) the SASS of _gelu(x) and dy * _gelu_grad(x) as Triton compiles them equals the SASS of eager's CUDA
  formulas (test_cuda_numerics_sass.py's transcription) as nvcc compiles them, compared as expression graphs
  (tests/kernel/_sass.py): the same instructions on the same values, so the same bits. This also proves the inline
  erf sequence (both polynomials, then a select) equal to nvcc's erff (coefficients selected, one polynomial);
* every kernel launch of the eager-exact Triton kernels passes enable_fp_fusion=False.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from . import _sass
from .test_cuda_numerics_sass import EAGER_AND_OURS, _tools

REPO = Path(__file__).resolve().parents[2]
OFFLINE = Path(__file__).with_name("_triton_offline.py")
ARCHS = [90, 80, 100]  # the first is the one the pointwise kernels are compiled for

# tl.fma calls per element in the kernels' formulas, where eager's SASS has an FFMA (the SASS test checks that):
# tanh GELU: kKappa * x^3 + x; its backward: that (shared with h), 1 - t*t, 1 + 3 kKappa x^2, and the final sum;
# erf backward: cdf + x * pdf.
FMA_PER_ELEMENT = {("fwd", False): 0, ("fwd", True): 1, ("bwd", False): 1, ("bwd", True): 4}

# Triton's own inline asm for loads and stores (masked loads move their "other" value in first)
_MEMORY = re.compile(r"^(@!?%p?\d* )?((ld|st)\.global(\.\w+)*|mov\.(u16|u32|b16|b32) %\w*, (0x0|%\w*);)")


def _has_nvidia_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    if not _has_nvidia_backend():
        pytest.skip("this Triton has no NVIDIA backend")
    out = tmp_path_factory.mktemp("triton-offline")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(out / "cache")
    proc = subprocess.run([sys.executable, str(OFFLINE), str(out), ",".join(map(str, ARCHS))], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        pytest.fail(f"offline compile failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return out, json.loads((out / "manifest.json").read_text())


def _ptx(text: str):
    """(inline asm blocks, instructions outside them), comments and .loc lines removed."""
    blocks, outside, cur = [], [], None
    for line in text.splitlines():
        if "begin inline asm" in line:
            cur = []
            continue
        if "end inline asm" in line:
            blocks.append(cur)
            cur = None
            continue
        line = re.sub(r"//.*", "", line).strip()
        if not line or line.startswith((".loc", ".file")):
            continue
        (cur if cur is not None else outside).append(" ".join(line.split()))
    return blocks, outside


def _norm(instrs) -> list[str]:
    """Instructions with the operands Triton substitutes ($0, $1 -> %r12, %r13) made anonymous."""
    return [re.sub(r"%[a-z]+\d+|\$\d+", "%", " ".join(i.split())) for i in instrs if i]


def _kernels(manifest):
    return [m for m in manifest["compiled"] if m["kind"] == "kernel"]


def test_offline_compile_covers_every_kernel(offline):
    _, manifest = offline
    seen = {(m["kernel"], m["dtype"], m["tanh"]) for m in _kernels(manifest)}
    assert len(seen) == 4 * 3 * 2, sorted(seen)
    assert {m["arch"] for m in manifest["compiled"] if m["kind"] == "probe"} == set(ARCHS)


def test_kernels_use_cudas_transcendental_sequences(offline):
    out, manifest = offline
    ours = {name: _norm(text.strip().splitlines()) for name, text in manifest["ptx"].items()}
    assert set(ours) == {"erf", "tanh", "exp"}
    for meta in _kernels(manifest):
        tag = meta["tag"]
        blocks, outside = _ptx((out / f"{tag}.ptx").read_text())
        found = Counter()
        for block in blocks:
            norm = _norm(block)
            name = next((k for k, v in ours.items() if v == norm), None)
            if name is not None:
                found[name] += 1
            else:
                bad = [i for i in norm if not _MEMORY.match(i)]
                assert not bad, f"{tag}: inline asm neither a load/store nor one of runtime/gelu_math.py's sequences: {bad}"
        n = meta["elements_per_thread"]
        bwd = meta["kernel"].startswith("bwd")
        want = {"tanh": n} if meta["tanh"] else {"erf": n, **({"exp": n} if bwd else {})}
        assert dict(found) == want, f"{tag}: transcendental sequences {dict(found)}, expected {want} (one per element)"

        fmas = 0
        for ins in outside:
            op = ins.split()[0]
            assert not re.match(r"(call|\.extern)\b", op) and "__nv_" not in ins, f"{tag}: a library call: {ins}"
            assert not re.match(r"(ex2|lg2|rcp|rsqrt|sqrt|sin|cos|tanh|div)\.", op), (
                f"{tag}: {ins!r} outside CUDA's erff/tanhf/expf sequences")
            m = re.match(r"(add|sub|mul|fma|mad)\.(\S+)", op)
            if m and re.search(r"\b(f32|f16|bf16|f16x2|bf16x2|f64)$", m.group(2)):
                mods = m.group(2).split(".")
                assert m.group(1) != "mad" and "rn" in mods and "ftz" not in mods and "sat" not in mods, (
                    f"{tag}: {ins!r}: float arithmetic that ptxas may contract or flush (expected .rn, no .ftz)")
                fmas += op == "fma.rn.f32"
            if re.match(r"cvt(\.\w+)*\.(bf16|f16|bf16x2|f16x2)\.f32$", op):
                assert ".rn." in op, f"{tag}: {ins!r}: rounding to the storage dtype is not to nearest even"
        want_fmas = FMA_PER_ELEMENT[("bwd" if bwd else "fwd", meta["tanh"])] * n
        assert fmas == want_fmas, f"{tag}: {fmas} FMAs outside the sequences, expected {want_fmas} (tl.fma only)"


@pytest.mark.parametrize("arch", ARCHS)
def test_gelu_sass_is_eagers(offline, tmp_path, arch):
    """_gelu / _gelu_grad as Triton compiles them against eager's CUDA formulas as nvcc compiles them."""
    nvcc, cuobjdump = _tools()
    if nvcc is None or cuobjdump is None:
        pytest.skip("needs nvcc and cuobjdump")
    out, _ = offline
    src = tmp_path / "eager.cu"
    src.write_text(EAGER_AND_OURS)
    cubin = tmp_path / "eager.cubin"
    subprocess.run([nvcc, "-O3", "-std=c++17", f"-arch=sm_{arch}", "-cubin", f"-I{REPO / 'geglu'}", str(src), "-o",
                    str(cubin)], check=True, capture_output=True)
    eager = _sass.functions(cuobjdump, cubin)
    for pair in ("fwd_erf", "fwd_tanh", "bwd_erf", "bwd_tanh"):
        (eager_code,) = [v for k, v in eager.items() if re.fullmatch(rf"_Z\d+eager_{pair}PfPKf", k)]
        (triton_code,) = _sass.functions(cuobjdump, out / f"probe-{pair.replace('_', '-')}-sm{arch}.cubin").values()
        assert any(i.startswith(("FFMA", "FMUL")) for i in triton_code), f"{pair}: no float math found"
        g = _sass.Graph()
        e, t = _sass.stored_value(g, eager_code), _sass.stored_value(g, triton_code)
        assert t == e, (f"sm_{arch} {pair}: Triton's computation differs from eager's (eager vs Triton, where they "
                        f"first differ):\n  {_sass.first_difference(g, e[1], t[1])}")


def test_launches_turn_off_fp_fusion():
    """Every ``kernel[grid](...)`` call of the package (``runtime.launch.launch`` is the one) passes
    enable_fp_fusion=False: with fusion on, LLVM forms FMAs from the formulas' separate products and sums, which
    eager's SASS does not have (the fused epilogues state their own rounding sequence)."""
    package = REPO / "torch-ext" / "geglu"
    found = []
    for path in sorted(package.rglob("*.py")):
        name = str(path.relative_to(package))
        tree = ast.parse(path.read_text())
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript)):
                continue
            grid = call.func.slice
            named_grid = isinstance(grid, ast.Name) and "grid" in grid.id
            if not (named_grid or any(k.arg == "num_warps" for k in call.keywords)):
                continue  # indexing a container and calling the item, not ``kernel[grid](...)``
            found.append(name)
            flags = [k.value for k in call.keywords if k.arg == "enable_fp_fusion"]
            assert len(flags) == 1 and isinstance(flags[0], ast.Constant) and flags[0].value is False, (
                f"{name}:{call.lineno}: a launch without enable_fp_fusion=False")
    assert found == ["runtime/launch.py"], f"kernel launches outside runtime.launch.launch: {found}"
