"""Prebuilt Triton kernels (``runtime.aot``, ``kerneltools.build.aot``): what the build compiles covers every plan the
launchers choose, the run-time lookup takes the most specialised binary the launch allows and otherwise says no
(then Triton's JIT runs), and on a GPU the prebuilt kernels compute the JIT's bits and a fresh process runs a
kernelized model without compiling anything.

The build's own output (the files in the variant, their index, the metadata's file list) is checked in
tests/tools/test_cuda_build.py, where the compiled variant is built.
"""

import importlib
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "torch-ext" / "geglu"
HAS_CUDA = torch.cuda.is_available()
H200_SMS = 132


def _source_modules():
    """The package's modules from the source tree (a stand-in package: its __init__ needs a build's _ops)."""
    from kerneltools.build import aot

    aot._pkg(PACKAGE)
    name = "_kerneltools_aot_pkg"
    mods = {"aot": "runtime.aot", "config": "runtime.config", "launch": "runtime.launch", "tri": "pointwise.kernels",
            "nrm": "rmsnorm.kernels", "fmt": "mlp.kernels", "ext": "experts.kernels"}
    return types.SimpleNamespace(**{k: importlib.import_module(f"{name}.{m}") for k, m in mods.items()})


@pytest.fixture(scope="module")
def src():
    return _source_modules()


def _prebuilt(built_launches):
    """(kernel name, constexprs, warps, stages) of every prebuilt launch (booleans as 0 / 1, as the index keys)."""
    return {(l["fn"], tuple(int(c) if isinstance(c, bool) else c for c in l["consts"]), l["num_warps"],
             l["num_stages"]) for l in built_launches}


def _k(fn, consts, warps, stages=3):
    return fn.__name__, tuple(int(c) if isinstance(c, bool) else c for c in consts), warps, stages


def test_every_plan_the_launchers_choose_is_prebuilt():
    """With an H200's 132 SMs, every tile the pointwise, RMSNorm, fused-GEMM and MoE plans choose over a sweep of
    the supported models' shapes (decode to prefill sizes) is among the prebuilt launches, for every dtype (in a
    process without TRITON_INTERPRET, as the build lists them)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", "import json, tests.kernel.test_prebuilt as t; "
                           "print(json.dumps(t.plans_not_prebuilt()))"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    missing = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not missing, missing[:10]


def plans_not_prebuilt() -> list:
    """The plans of the sweep (see the test above) that no prebuilt launch covers."""
    from kerneltools.build import aot

    have = _prebuilt(aot.launches(PACKAGE))
    m = _source_modules()
    tri, nrm, fmt, ext = m.tri, m.nrm, m.fmt, m.ext
    tri.sm_count = nrm.sm_count = lambda device: H200_SMS
    kf = (tri.K_BETA_TANH, tri.K_KAPPA, tri.K_ALPHA)
    kb = kf + (tri.K_BETA_ERF, tri.K_3KAPPA)
    missing = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        t = torch.empty(1, dtype=dtype)
        for M in (1, 2, 3, 7, 64, 300, 2048, 16384, 131072):
            for N in (128, 256, 704, 768, 1152, 2048, 2304, 2816, 9216, 10240, 14336, 21504):
                for tanh in (False, True):
                    if M * N < 2 ** 31 - 4096:
                        grid, block, warps, even, wide = tri._flat_plan(M * N, t.element_size(), t.device)
                        for fn, k in ((tri._geglu_fwd_flat_kernel, kf), (tri._geglu_bwd_flat_kernel, kb)):
                            key = _k(fn, (tanh, block, even, wide) + k, warps)
                            if key not in have:
                                missing.append(("flat", M, N, dtype, key[:2]))
                    grid, bm, bn, warps = tri._plan(M, N, t.element_size(), t.device, 3)
                    for fn, k in ((tri._geglu_fwd_kernel, kf), (tri._geglu_bwd_kernel, kb)):
                        if _k(fn, (tanh, bm, bn) + k, warps) not in have:
                            missing.append(("rows", M, N, dtype, bm, bn))
        for M in (1, 8, 64, 300, 2048, 16384, 131072):
            for D in (128, 256, 640, 1152, 2048, 2304, 2560, 3840, 5376, 16384, 20000):
                grid, bm, bd, warps, looped = nrm.fwd_plan(M, D, torch.device("cuda", 0))
                for save in (True, False):
                    key = (_k(nrm._fwd_looped_kernel, (bd, save), warps) if looped
                           else _k(nrm._fwd_kernel, (bm, bd, save), warps))
                    if key not in have:
                        missing.append(("norm fwd", M, D, key[:2]))
                grid, bm, bd, warps, looped = nrm.bwd_plan(M, D, torch.device("cuda", 0))
                for r in (True, False):
                    for w in (True, False):
                        key = (_k(nrm._bwd_looped_kernel, (bd, r, w), warps) if looped
                               else _k(nrm._bwd_kernel, (bm, bd, r, w), warps))
                        if key not in have:
                            missing.append(("norm bwd", M, D, key[:2]))
    for M in (65, 200, 256, 257, 300, 2048, 16384):
        for tanh in (False, True):
            cfg = fmt.choose_config(M, 2560, 10240, torch.bfloat16, torch.device("cuda", 0))
            keys = [_k(fmt._gate_up_geglu_kernel, fmt.gate_up_consts(tanh, True, cfg), cfg.num_warps,
                       cfg.num_stages)]
            if cfg.pair:
                keys += [_k(fmt._paired_gate_up_geglu_kernel, fmt.paired_consts(tanh, g, cfg), cfg.num_warps,
                            cfg.num_stages) for g in (True, False)]
            missing += [("gemm", M, k[:2]) for k in keys if k not in have]
    for S, E in ((4096, 128), (131072, 128), (512, 128)):
        cfg = ext.default_config(S, E)
        for tanh in (False, True):
            key = _k(ext._grouped_geglu_kernel, ext.grouped_consts(tanh, cfg), cfg.num_warps, cfg.num_stages)
            if key not in have:
                missing.append(("moe", S, key[:2]))
    return [[str(v) for v in row] for row in missing]


def _fake_index(src, monkeypatch, entries):
    """The lookup over a made-up index for arch 90 (no GPU: the driver calls are stubbed)."""
    aot = src.aot
    by_key = {}
    for e in entries:
        e["hint_mask"] = sum(1 << i for i, h in enumerate(e["hints"]) if h)
        by_key.setdefault(aot.key(e["fn"], e["consts"], e["num_warps"], e["num_stages"], e["types"]), []).append(e)
    for group in by_key.values():
        group.sort(key=lambda e: -sum(e["hints"]))
    monkeypatch.setitem(aot._indexes, 90, (by_key, b""))
    monkeypatch.setattr(aot, "_arch", lambda device_index: 90)
    monkeypatch.setattr(aot, "_function", lambda entry, device_index, blob: entry["name"])
    chosen = []
    monkeypatch.setattr(aot, "_launcher", lambda entry, function: chosen.append(function) or (lambda *a: None))
    return chosen


def test_lookup_takes_the_most_specialised_binary_the_launch_allows(src, monkeypatch):
    """Of two binaries of one launch, the one assuming every argument aligned runs where they are, the one assuming
    less where the length is not divisible by 16; a misaligned pointer, another dtype, another tile or the
    ``prebuilt`` setting off find nothing (the caller's JIT runs)."""
    aot = src.aot
    base = dict(fn="k", consts=[True, 1024], num_warps=4, num_stages=3, types=["*bf16", "*bf16", "i32"])
    chosen = _fake_index(src, monkeypatch, [dict(base, hints=[True, True, False], name="some"),
                                            dict(base, hints=[True, True, True], name="all")])
    buf = torch.empty(4096, dtype=torch.bfloat16)
    a, b = buf[:1024], buf[1024:2048]
    assert aot.find("k", [a, b, 4096], (1, 1024), 4, 3, 0) is not None and chosen[-1] == "all"
    assert aot.find("k", [a, b, 4095], (True, 1024), 4, 3, 0) is not None and chosen[-1] == "some"
    assert aot.find("k", [buf[1:1025], b, 4096], (True, 1024), 4, 3, 0) is None  # misaligned: no binary assumes less
    assert aot.find("k", [a.half(), b.half(), 4096], (True, 1024), 4, 3, 0) is None
    assert aot.find("k", [a, b, 4096], (True, 512), 4, 3, 0) is None
    assert aot.find("k", [a, b, 2 ** 31], (True, 1024), 4, 3, 0) is None  # an i64 length: another signature
    with src.config.configure(prebuilt=False):
        assert aot.find("k", [a, b, 4096], (True, 1024), 4, 3, 0) is None
    assert len(chosen) == 2


def test_launcher_packs_parameters_as_triton_passes_them(src, monkeypatch):
    """A launch's parameters: pointers, integers and fp32 bits in order, each TMA descriptor as its 128 bytes
    followed by its shape (i32) and strides (i64), then the global and profile scratch pointers (null); the grid,
    the block of 32 x warps threads and the compiled shared memory go to cuLaunchKernel."""
    import ctypes

    aot = src.aot
    seen = {}

    class Lib:
        def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            p = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
            n = 3 + 1 + 2 + 2 + 2  # x, -3, 0.5; the descriptor; its shape, its strides; two scratch pointers
            seen.update(fn=fn, grid=(gx, gy, gz), block=(bx, by, bz), shared=shared, stream=stream,
                        words=[ctypes.cast(p[i], ctypes.POINTER(ctypes.c_uint64))[0] for i in range(n)],
                        desc=bytes(ctypes.cast(p[3], ctypes.POINTER(ctypes.c_uint8 * 128))[0]))
            return 0

        def cuTensorMapEncodeTiled(self, out, dtype, rank, base, dims, strides, box, ones, interleave, swizzle, l2,
                                   fill):
            ctypes.memset(out, 7, 128)
            seen.update(tma=(dtype, rank, base, swizzle))
            return 0

    monkeypatch.setattr(aot, "_cuda", Lib())
    monkeypatch.setattr(aot, "_driver", lambda: aot._cuda)
    x = torch.empty(64, 32, dtype=torch.bfloat16)
    meta = dict(swizzle=3, elem_size=2, elem_type=10, block_size=[16, 32])
    entry = dict(types=["*bf16", "i32", "fp32", "tensordesc<bf16[16, 32]>"], tensordesc_meta=[meta], num_warps=8,
                 shared=1024)
    run = aot._launcher(entry, 1234)
    run((5, 2), [x, -3, 0.5, aot.Desc(x, [64, 32], [32, 1], [16, 32])], 99)
    assert seen["fn"] == 1234 and seen["grid"] == (5, 2, 1) and seen["block"] == (256, 1, 1)
    assert seen["shared"] == 1024 and seen["stream"] == 99
    words = seen["words"]
    assert words[0] == x.data_ptr() and words[1] & 0xFFFFFFFF == (-3) & 0xFFFFFFFF
    assert words[2] == 0x3F000000 and seen["desc"] == bytes([7]) * 128
    assert words[4:6] == [64, 32] and words[6:8] == [32, 1] and words[8:] == [0, 0]
    assert seen["tma"] == (9, 2, x.data_ptr(), 3)  # bf16 is the host's type 9 (the compiler's 10)


def test_a_variant_without_prebuilt_kernels_finds_none(src, monkeypatch, tmp_path):
    """No index files beside the package (the noarch variants, the source tree): no architectures, no lookups."""
    aot = src.aot
    monkeypatch.setattr(aot, "HERE", str(tmp_path))
    monkeypatch.setattr(aot, "_indexes", {})
    assert aot.architectures() == [] and aot.info()["architectures"] == []
    assert aot._index(90) is None


def _ship(aot, monkeypatch, tmp_path, archs, kernels=()):
    """A variant folder holding index files for ``archs`` (``kernels``: the index entries, in one zlib blob)."""
    import zlib

    blob, entries = b"", []
    for e in kernels:
        data = zlib.compress(e.pop("image"))
        entries.append(dict(e, offset=len(blob), size=len(data)))
        blob += data
    for arch in archs:
        (tmp_path / f"{aot.PREFIX}{arch}.json").write_text(json.dumps(dict(
            arch=arch, target=f"sm_{arch}{'a' if arch >= 90 else ''}", ptxas="12.9", triton="3.9.0",
            compression="zlib", kernels=entries)))
        (tmp_path / f"{aot.PREFIX}{arch}.cubin").write_bytes(blob)
    for name, value in (("HERE", str(tmp_path)), ("_indexes", {}), ("_arch_of", {}), ("_loaded", {}),
                        ("_launchers", {}), ("_refused", {})):
        monkeypatch.setattr(aot, name, value)


def test_each_gpu_family_runs_the_binaries_nvidia_allows(src, monkeypatch, tmp_path):
    """With the six architectures shipped, a GPU runs its own architecture's binaries; sm_87 runs sm_86's (a
    portable sm_8x cubin runs on later minors of major 8); sm_75, sm_103, sm_110 and sm_121 run the JIT (sm_90a /
    sm_100a / sm_120a cubins run on that exact architecture only, never across majors). With sm_80 and sm_90 alone,
    sm_86 and sm_89 run sm_80's. ``prebuilt_kernels()`` says the same per family, and the device lookup follows it."""
    aot = src.aot
    _ship(aot, monkeypatch, tmp_path, [80, 86, 89, 90, 100, 120])
    want = {75: None, 80: 80, 86: 86, 87: 86, 89: 89, 90: 90, 100: 100, 103: None, 110: None, 120: 120, 121: None}
    shipped = aot.architectures()
    assert shipped == [80, 86, 89, 90, 100, 120]
    assert {cap: aot.serving_arch(cap, shipped) for cap in want} == want
    gpus = aot.info()["gpus"]
    assert {cap: g["runs"] for cap, g in gpus.items()} == {c: "jit" if a is None else f"sm_{a}" for c, a in want.items()}
    caps = list(want)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: divmod(caps[i], 10))
    assert [aot._arch(i) for i in range(len(caps))] == list(want.values())
    assert aot.serving_arch(86, [80, 90]) == 80 and aot.serving_arch(89, [80, 90]) == 80
    assert aot.serving_arch(100, [80, 90]) is None and aot.serving_arch(90, [80, 86, 89]) is None
    info = aot.info()
    assert info["ptxas"] == "12.9" and info["targets"] == {80: "sm_80", 86: "sm_86", 89: "sm_89", 90: "sm_90a",
                                                           100: "sm_100a", 120: "sm_120a"}


class _FakeDriver:
    """libcuda's calls that loading a prebuilt kernel makes; ``refuse``: call name -> the CUDA error it returns
    (209: CUDA_ERROR_NO_BINARY_FOR_GPU, 222: CUDA_ERROR_UNSUPPORTED_PTX_VERSION)."""

    def __init__(self, refuse):
        self.refuse, self.calls = refuse, []

    def _status(self, name):
        self.calls.append(name)
        return self.refuse.get(name, 0)

    def cuCtxGetCurrent(self, ctx):
        import ctypes

        ctypes.cast(ctx, ctypes.POINTER(ctypes.c_void_p))[0] = 1
        return 0

    def cuModuleLoadData(self, module, image):
        return self._status("cuModuleLoadData")

    def cuModuleGetFunction(self, fn, module, name):
        import ctypes

        ctypes.cast(fn, ctypes.POINTER(ctypes.c_void_p))[0] = 42
        return self._status("cuModuleGetFunction")

    def cuFuncSetAttribute(self, fn, attr, value):
        return self._status("cuFuncSetAttribute")

    def cuGetErrorString(self, status, out):
        import ctypes

        text = {209: b"no kernel image is available for execution on the device",
                222: b"the provided PTX was compiled with an unsupported toolchain."}[status]
        ctypes.cast(out, ctypes.POINTER(ctypes.c_char_p))[0] = text
        return 0


@pytest.mark.parametrize("call, status", [("cuModuleLoadData", 222), ("cuModuleGetFunction", 209),
                                          ("cuFuncSetAttribute", 209)])
def test_a_binary_the_driver_refuses_falls_back_to_the_jit_with_one_warning(src, monkeypatch, tmp_path, call,
                                                                           status):
    """The driver refuses a prebuilt kernel (an old driver and a newer toolkit's cubin, a missing function, more
    shared memory than the GPU has): the launch finds nothing (the caller's JIT runs), one RuntimeWarning names the
    device, the architecture and the CUDA error; later launches on that device find nothing without loading or
    warning again; ``prebuilt_kernels()['refused']`` lists the device. Another device keeps its prebuilt kernels."""
    import warnings

    aot = src.aot
    entry = dict(fn="k", consts=[1], num_warps=4, num_stages=3, types=["*bf16", "i32"], hints=[True, True],
                 name="k_entry", shared=64 * 1024, image=b"\x7fELF fake cubin")
    _ship(aot, monkeypatch, tmp_path, [90], [entry])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    refusing, working = _FakeDriver({call: status}), _FakeDriver({})
    driver = {"lib": refusing}
    monkeypatch.setattr(aot, "_driver", lambda: driver["lib"])
    monkeypatch.setattr(aot, "_cuda", refusing)
    monkeypatch.setattr(aot, "_launcher", lambda entry, function: ("run", function))
    x = torch.empty(64, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match=rf"refused the prebuilt sm_90 kernels on cuda:0 \({call} failed with "
                                            rf"CUDA error {status} .*Triton's JIT compiles the kernels there"):
        assert aot.find("k", [x, 64], (1,), 4, 3, 0) is None
    n_calls = len(refusing.calls)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert aot.find("k", [x, 64], (1,), 4, 3, 0) is None
    assert len(refusing.calls) == n_calls  # nothing loaded again
    assert list(aot.info()["refused"]) == [0] and call in aot.info()["refused"][0]
    driver["lib"] = working
    monkeypatch.setattr(aot, "_cuda", working)
    assert aot.find("k", [x, 64], (1,), 4, 3, 1) == ("run", 42)


# --- on the GPU ----------------------------------------------------------------------------------------------------

needs_prebuilt = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _aot_of(geglu):
    return importlib.import_module(geglu.__name__ + ".runtime.aot")


def _jit_against_prebuilt(geglu, aot, families):
    """The bits test's cases of ``families`` (pointwise, norm, gemm, moe), each run through Triton's JIT and through
    the prebuilt kernels; returns [(name, ran prebuilt, values that differ)] for those that did not run prebuilt or
    did not match (the norms: within one bf16 ulp in at most 0.1 % of the values)."""
    hits = []
    real_find = aot.find

    def find(*a, **k):
        run = real_find(*a, **k)
        if run is not None:
            hits.append(a[0])
        return run

    aot.find = find
    try:
        return _compare(geglu, families, hits)
    finally:
        aot.find = real_find


def _compare(geglu, families, hits):
    kt = importlib.import_module(geglu.__name__ + ".mlp.kernels")
    et = importlib.import_module(geglu.__name__ + ".experts.kernels")
    launch_mod = importlib.import_module(geglu.__name__ + ".runtime.launch")

    def both(fn):
        """fn's result through the JIT and through the prebuilt kernels (the Triton backend: at every size)."""
        with geglu.configure(backend="triton"):
            launch_mod.clear_caches()
            with geglu.configure(prebuilt=False):
                jit = fn()
            launch_mod.clear_caches()
            n = len(hits)
            pre = fn()
            torch.cuda.synchronize()
        return jit, pre, len(hits) > n

    cases = []
    if "pointwise" in families:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for shape in ((4096, 2 * 14336), (300, 2 * 2304 + 32)):
                x = torch.randn(*shape, device="cuda").to(dtype)
                g, u = x.chunk(2, -1)
                dy = torch.randn_like(g)
                gc, uc = g.contiguous(), u.contiguous()
                for approx in ("none", "tanh"):
                    cases.append((f"fwd rows {dtype} {shape} {approx}",
                                  lambda g=g, u=u, a=approx: geglu.geglu(g, u, a)))
                    cases.append((f"fwd flat {dtype} {shape} {approx}",
                                  lambda g=gc, u=uc, a=approx: geglu.geglu(g, u, a)))
                    cases.append((f"bwd {dtype} {shape} {approx}",
                                  lambda dy=dy, g=gc, u=uc, a=approx: torch.cat(geglu.geglu_backward(dy, g, u, a))))
    if "norm" in families:
        for M, D in ((1, 2560), (300, 2560), (4096, 256), (8, 20000)):
            x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(D, device="cuda", dtype=torch.bfloat16) * 0.1

            def norm(x=x, w=w):
                xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
                y = geglu.rms_norm(xl, wl)
                y.backward(torch.ones_like(y))
                return torch.cat([y.flatten(), xl.grad.flatten(), wl.grad.flatten()])

            cases.append((f"norm {M}x{D}", norm))
    if "gemm" in families:
        x = torch.randn(1024, 2560, device="cuda", dtype=torch.bfloat16)
        wg, wu = (torch.randn(10240, 2560, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2))
        for tanh in (False, True):
            for M in (200, 1024):
                cases.append((f"gemm {M} {tanh}", lambda M=M, t=tanh: kt.gate_up_geglu(x[:M], wg, wu, t)))
    if "moe" in families:
        xe = torch.randn(4096, 2816, device="cuda", dtype=torch.bfloat16)
        we = torch.randn(128, 2 * 704, 2816, device="cuda", dtype=torch.bfloat16) * 0.02
        counts = torch.multinomial(torch.ones(128), 4096, replacement=True).bincount(minlength=128)
        offsets = torch.cumsum(counts, 0).to(torch.int32).cuda()
        cases.append(("moe", lambda: et.grouped_gate_up_geglu(xe, we, offsets, True)))
    bad = []
    for name, fn in cases:
        jit, pre, was_prebuilt = both(fn)
        if name.startswith("norm"):
            # The norms' row sums are reduced in the order each Triton version's code generator picks (the JIT here
            # is the installed Triton, the prebuilt kernels the build's): a value may differ in its last bit.
            diff = (jit.float() - pre.float()).abs()
            same = bool((diff <= 2 ** -7 * jit.float().abs()).all()) and (jit != pre).float().mean() <= 1e-3
        else:
            same = torch.equal(jit, pre)
        if not was_prebuilt or not same:
            bad.append((name, was_prebuilt, (jit != pre).sum().item()))
    return bad


@pytest.mark.gpu
@needs_prebuilt
def test_gpu_prebuilt_kernels_compute_the_jit_kernels_bits(geglu):
    """Every family of kernels, prebuilt against Triton's JIT of the same source, on fresh random data: the
    pointwise forward and backward (flat and row-strided, with and without a tail, three dtypes), the fused gate/up
    GEMM (inference and training tiles) and the MoE grouped GEMM bit for bit; the RMSNorm forward and backward
    (rows in registers and looped) within one bf16 ulp in at most 0.1 % of the values (their sums' order is the
    Triton version's); and each launch really prebuilt."""
    aot = _aot_of(geglu)
    major, minor = torch.cuda.get_device_capability()
    if aot.serving_arch(major * 10 + minor, aot.architectures()) is None:
        pytest.skip("this build has no prebuilt kernels for this GPU")
    bad = _jit_against_prebuilt(geglu, aot, ("pointwise", "norm", "gemm", "moe"))
    assert not bad, bad


@pytest.mark.gpu
@needs_prebuilt
def test_gpu_another_architectures_code_through_the_driver_jit(geglu, monkeypatch):
    """Another architecture's shipped code on this GPU: the sm_80 kernels' PTX, which each shipped sm_80 cubin
    embeds (the code its SASS was assembled from), loaded through the driver's JIT with the sm_80 index's launch
    data (parameters, warps, shared memory), computes the pointwise kernels' JIT bits and the norms' bound here.
    (An sm_80 cubin itself cannot run on another major; its SASS is ptxas's.) Needs a build with sm_80 kernels."""
    import zlib

    from kerneltools.build import aot as build_aot

    aot = _aot_of(geglu)
    if 80 not in aot.architectures():
        pytest.skip("this build has no sm_80 kernels (build with --aot-capability 8.0,9.0)")
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        pytest.skip("sm_80 PTX needs an sm_80 or newer GPU")
    entries, blob = aot._index(80)
    ptx_entries, ptx_blob = {}, bytearray()
    for k, group in entries.items():
        for e in group:
            cubin = zlib.decompress(blob[e["offset"]:e["offset"] + e["size"]])
            ptx = build_aot._sections(cubin)[b".nv_debug_ptx_txt"].replace(b"\0", b"\n").strip(b"\n")
            assert b".target sm_80" in ptx, e["fn"]
            data = zlib.compress(ptx + b"\0")
            ptx_entries.setdefault(k, []).append(dict(e, offset=len(ptx_blob), size=len(data)))
            ptx_blob += data
    monkeypatch.setitem(aot._indexes, 80, (ptx_entries, bytes(ptx_blob)))
    monkeypatch.setattr(aot, "_arch", lambda device_index: 80)
    monkeypatch.setattr(aot, "_loaded", {})
    monkeypatch.setattr(aot, "_launchers", {})
    launch_mod = importlib.import_module(geglu.__name__ + ".runtime.launch")
    try:
        bad = _jit_against_prebuilt(geglu, aot, ("pointwise", "norm"))
    finally:  # the launch caches hold the PTX-backed kernels: later tests look their own up again
        launch_mod.clear_caches()
    assert not bad, bad
    assert aot.info()["refused"] == {}


_FRESH = r"""
import json, os, sys, time
from pathlib import Path
import torch, triton
from triton.runtime.jit import JITFunction

compiled = []  # every kernel launched through Triton's JIT (which compiles it on its first launch)
real_run = JITFunction.run
def counting(self, *a, **k):
    compiled.append(self.__name__)
    return real_run(self, *a, **k)
JITFunction.run = counting
events = []
real_event = torch.cuda.Event
class CountingEvent(real_event):
    def __init__(self, *a, **k):
        events.append(1)
        super().__init__(*a, **k)

import transformers
from kernels import Mode, kernelize
from kerneltools.transformers_kernels import DEFAULT_REPO_ID, register_geglu_kernels

build = sys.argv[1]
os.environ["LOCAL_KERNELS"] = f"{DEFAULT_REPO_ID}={build}"
register_geglu_kernels(DEFAULT_REPO_ID, revision="local", devices=("cuda",))
import kernels
import importlib
kernel = kernels.get_local_kernel(Path(build))
aot = importlib.import_module(kernel.__name__ + ".runtime.aot")
misses = []  # launches the index has no binary for: (kernel, constexprs, types, hints)
real_find = aot.find
def find(name, args, consts, warps, stages, dev):
    run = real_find(name, args, consts, warps, stages, dev)
    if run is None:
        misses.append([name, repr(consts), warps, stages, [aot.arg_type(a) for a in args],
                       [aot.arg_hint(a) for a in args]])
    return run
aot.find = find
torch.manual_seed(0)
out = {"prebuilt": aot.info(), "variant": Path(kernel.__file__).parent.name}
torch.cuda.Event = CountingEvent
for name, cfg in (
        ("gemma3", transformers.Gemma3TextConfig(hidden_size=2560, intermediate_size=10240, num_hidden_layers=2,
                                                 num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                                 vocab_size=2048, sliding_window=1024)),
        ("gemma4-moe", transformers.Gemma4TextConfig(hidden_size=2816, intermediate_size=2112, num_hidden_layers=2,
                                                     num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                                     vocab_size=2048, enable_moe_block=True, num_experts=128,
                                                     top_k_experts=8, moe_intermediate_size=704,
                                                     hidden_activation="gelu_pytorch_tanh",
                                                     hidden_size_per_layer_input=0, layer_types=["sliding_attention", "full_attention"]))):
    with torch.device("cuda"):
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    kernelize(m.eval(), mode=Mode.INFERENCE, device="cuda")
    with torch.no_grad():
        for b, s in ((1, 300), (4, 1024), (1, 1)):
            m(input_ids=torch.randint(0, 2048, (b, s), device="cuda"), use_cache=False)
        m.generate(torch.randint(0, 2048, (1, 16), device="cuda"), max_new_tokens=4, do_sample=False)
    if name == "gemma3":
        kernelize(m, mode=Mode.TRAINING, device="cuda")
        m.train()
        ids = torch.randint(0, 2048, (2, 1024), device="cuda")
        m(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    out[name] = dict(compiled=sorted(set(compiled)), events=len(events), misses=misses[:20])
cache = Path(os.environ["TRITON_CACHE_DIR"])
out["cache_files"] = [str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()]
print(json.dumps(out))
"""


@pytest.mark.gpu
@needs_prebuilt
def test_gpu_the_prebuilt_kernels_loaded_here_come_from_cuda_12_9(geglu):
    """The loaded variant's binaries for this GPU were assembled by CUDA 12.9's ptxas (so CUDA 12 drivers load them
    too), and this driver loaded them (no device refused)."""
    aot = _aot_of(geglu)
    major, minor = torch.cuda.get_device_capability()
    arch = aot.serving_arch(major * 10 + minor, aot.architectures())
    if arch is None:
        pytest.skip("this build has no prebuilt kernels for this GPU")
    x = torch.randn(4096, 2 * 2048, device="cuda", dtype=torch.bfloat16)
    with geglu.configure(backend="triton"):
        geglu.geglu(*x.chunk(2, -1))
    torch.cuda.synchronize()
    info = geglu.prebuilt_kernels()
    assert info["ptxas"] == "12.9" and info["refused"] == {}, info
    assert info["gpus"].get(major * 10 + minor, {"runs": f"sm_{arch}"})["runs"] == f"sm_{arch}", info["gpus"]


@pytest.mark.gpu
@needs_prebuilt
@pytest.mark.parametrize("variant", ["compiled", "noarch"])
def test_gpu_fresh_process_runs_a_kernelized_model_without_compiling(build_dir, tmp_path, variant):
    """A fresh process with an empty Triton cache runs kernelized Gemma 3 (prefill at 300 and 4 x 1024 tokens: the
    fused MLP and the norms; decode sizes; a generate; a training step) and a Gemma 4 MoE model (the fused grouped
    GEMM from 2048 routed rows, the gates) on the prebuilt kernels: Triton compiles nothing, the cache stays
    empty, and no CUDA event is made (nothing is timed to choose a path). Once on the compiled variant, once on the
    noarch ``torch-cuda`` one alone (what CUDA 12 torch builds, torch < 2.10 and aarch64 load)."""
    if variant == "compiled":
        if not any(p.name.startswith("torch-stable-abi") for p in build_dir.iterdir()):
            pytest.skip("needs a build with the compiled variant (GEGLU_BUILD_DIR)")
    else:
        if not list((build_dir / "torch-cuda").glob("_prebuilt_sm*.json")):
            pytest.skip("needs a build whose torch-cuda variant has prebuilt kernels (GEGLU_BUILD_DIR)")
        only = tmp_path / "noarch-build"
        shutil.copytree(build_dir / "torch-cuda", only / "torch-cuda")
        build_dir = only
    cache = tmp_path / "triton-cache"
    cache.mkdir()
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _FRESH, str(build_dir)], capture_output=True, text=True, env=env,
                          timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["prebuilt"]["architectures"], res["prebuilt"]
    assert res["variant"].startswith("torch-cuda" if variant == "noarch" else "torch-stable-abi"), res["variant"]
    assert res["gemma3"]["compiled"] == [] and res["gemma4-moe"]["compiled"] == [], res
    assert res["cache_files"] == [], res["cache_files"][:10]
    assert res["gemma4-moe"]["events"] == 0, res
