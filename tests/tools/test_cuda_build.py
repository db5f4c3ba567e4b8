"""The compiled CUDA variant's builder (kerneltools.build.cuda), on a machine without a GPU.

Builds once for ONE capability (9.0, ~20-30 s on 2 cores) into a temporary build/ next to the noarch variants,
then checks kernel-builder's output contract, the ABI, how the `kernels` loader treats the variants on a CPU
torch, the op schemas (by loading the library against a stub libtorch_cuda.so), the SASS (128-bit accesses,
no local memory), the no-op rebuild, and the error messages.

The prebuilt Triton kernels of both CUDA variants are built for AOT_ARCHS (sm_86, sm_90 and sm_120 by default:
a portable sm_8x target without the TMA GEMMs, sm_90a, and sm_120a with its 99 KiB of shared memory; about 8
minutes on 2 cores without a cache; GEGLU_TEST_AOT_CAPABILITY picks others, e.g. the full
8.0,8.6,8.9,9.0,10.0,12.0), with the full launch list each; every one of the six shipped architectures compiles a
sample of each kernel family in test_every_shipped_architecture_compiles_each_family.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from kerneltools.build import build, config as kbuild
from kerneltools.build import cuda as cuda_build

REPO = Path(__file__).resolve().parents[2]
CAP = "9.0"
AOT_CAPABILITY = os.environ.get("GEGLU_TEST_AOT_CAPABILITY", "8.6,9.0,12.0")
OPS_RE = re.compile(r"^_geglu_cuda_[0-9a-f]{7}(_dirty)?$")
SCHEMAS = {
    "geglu_fwd": "geglu_fwd(Tensor(a!) out, Tensor gate, Tensor up, bool tanh) -> ()",
    "geglu_bwd": "geglu_bwd(Tensor(a!) d_gate, Tensor(b!) d_up, Tensor grad, Tensor gate, Tensor up, bool tanh) -> ()",
}


def _nvcc_or_none():
    try:
        return cuda_build.find_nvcc()
    except kbuild.BuildError:
        return None


needs_nvcc = pytest.mark.skipif(_nvcc_or_none() is None, reason="nvcc (CUDA toolkit) not installed")


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    nvcc = _nvcc_or_none()
    if nvcc and (nvcc.parent / "cuobjdump").is_file():
        return str(nvcc.parent / "cuobjdump")
    try:  # Triton's wheel ships one
        import triton

        p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return str(p) if p.is_file() else None
    except ImportError:
        return None


class Built:
    def __init__(self, out: Path, variant: Path, log: list[str], seconds: float, cache: Path):
        self.out, self.variant, self.log, self.seconds, self.cache = out, variant, log, seconds, cache

    @property
    def ops(self) -> str:
        return json.loads((self.variant / "metadata.json").read_text())["id"]

    @property
    def so(self) -> Path:
        return self.variant / f"{self.ops}.abi3.so"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    if _nvcc_or_none() is None:
        pytest.skip("nvcc (CUDA toolkit) not installed")
    out = tmp_path_factory.mktemp("build")
    cache = tmp_path_factory.mktemp("objcache")
    log: list[str] = []
    old = os.environ.get("KERNELTOOLS_CUDA_CACHE")
    os.environ["KERNELTOOLS_CUDA_CACHE"] = str(cache)  # a cold object cache: this really compiles
    try:
        t0 = time.monotonic()
        paths = build(REPO, out, variants=["cpu", "cuda", "cuda-compiled"], capability=CAP,
                      aot_capability=AOT_CAPABILITY, log=log.append)
        seconds = time.monotonic() - t0
    finally:
        if old is None:
            os.environ.pop("KERNELTOOLS_CUDA_CACHE", None)
        else:
            os.environ["KERNELTOOLS_CUDA_CACHE"] = old
    return Built(out, paths[-1], log, seconds, cache)


# --- kernel-builder's output contract ------------------------------------------------------------------------


def _files(folder: Path) -> list:
    """Every file under ``folder``, as paths relative to it (no caches)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def test_variant_name_and_layout(built):
    nvcc = cuda_build.probe_nvcc(cuda_build.find_nvcc())
    assert built.variant.name == f"torch-stable-abi210-cu{nvcc.major}{nvcc.minor}-x86_64-linux"
    from kerneltools.kernels_api import parse_variant

    assert parse_variant(built.variant.name).name == built.variant.name  # kernels' own grammar
    assert built.variant.parent == built.out
    assert OPS_RE.match(built.ops), built.ops
    # the package as it is in torch-ext/geglu (its subpackages included), the generated files and the binaries;
    # every folder of the variant is one of the package's subpackages
    entries = _files(built.variant)
    src = REPO / "torch-ext" / "geglu"
    package = sorted(str(p.relative_to(src)) for p in src.rglob("*.py") if p.name != "_ops.py"
                     and "__pycache__" not in p.parts)
    prebuilt = [f"_prebuilt_sm{a}.{ext}" for a in _aot_archs() for ext in ("json", "cubin")]
    assert entries == sorted(package + ["_ops.py", "metadata.json", f"{built.ops}.abi3.so"] + prebuilt)
    assert _files(built.out / "torch-cuda") == sorted(package + ["_ops.py", "metadata.json"] + prebuilt)
    assert all((d / "__init__.py").is_file() for d in built.variant.rglob("*") if d.is_dir())
    assert "__init__.py" in entries and "runtime/launch.py" in entries
    assert any("compiling device code" in line for line in built.log), "progress lines missing"
    assert any("ABI check" in line for line in built.log)


def test_ops_py_contract(built):
    text = (built.variant / "_ops.py").read_text()
    assert text == kbuild.ops_py(built.ops, load_library=True)
    tree = ast.parse(text)
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.level == 1]
    assert [a.name for n in imports for a in n.names] == [built.ops]  # `from . import <OPS>` loads the .so
    assert f"ops = torch.ops.{built.ops}" in text
    assert "HAS_CUDA_LIB = True" in text
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    ns: dict = {}
    exec(compile(ast.Module(body=[funcs["add_op_namespace_prefix"]], type_ignores=[]), "_ops.py", "exec"), ns)
    assert ns["add_op_namespace_prefix"]("geglu_fwd") == f"{built.ops}::geglu_fwd"


def test_metadata(built):
    import kernels
    import kernels_data

    path = built.variant / "metadata.json"
    for parse in (kernels_data.Metadata.read_from_file, lambda p: kernels.Metadata.from_bytes(p.read_bytes())):
        meta = parse(path)
        assert str(meta.name) == "geglu"
        assert meta.id == built.ops
        assert meta.version == 1
        assert meta.license == "Apache-2.0"
        assert list(meta.python_depends) == []
        assert str(meta.backend.backend_type).lower().endswith("cuda")
        assert list(meta.backend.archs) == [f"{CAP}+PTX"]
    raw = json.loads(path.read_text())
    assert raw["backend"]["type"] == "cuda"
    # The digest is what kernels-data computes for the folder.
    digest = kernels_data.Digest.hash_variant(kernels_data.DigestAlgorithm.SHA256, built.variant)
    kernels_data.Metadata.read_from_file(path).digest.validate(digest)


def _aot_archs() -> list[int]:
    from kerneltools.build import aot

    return aot.parse_archs(AOT_CAPABILITY)


def _cubins(variant: Path, arch: int):
    """(index, [(entry, cubin bytes)]) of one architecture's prebuilt kernels in a variant."""
    index = json.loads((variant / f"_prebuilt_sm{arch}.json").read_text())
    blob = (variant / f"_prebuilt_sm{arch}.cubin").read_bytes()
    return index, [(e, zlib.decompress(blob[e["offset"]:e["offset"] + e["size"]])) for e in index["kernels"]]


@pytest.mark.parametrize("which", ["compiled", "torch-cuda"])
def test_prebuilt_kernels_in_the_variant(built, which):
    """Both CUDA variants carry the Triton kernels prebuilt for each architecture asked for: per architecture an
    index with one entry per launch the package's plans can make (the TMA GEMMs from sm_90 up), each a
    zlib-compressed cubin holding its entry point; every cubin's .note.nv.tkinfo names a ptxas release of at most
    CUDA 12.9 (CUDA 12 drivers load it) and the index's target (sm_86, sm_90a, sm_120a); shared memory fits the
    architecture, which on sm_120 takes one pipeline stage fewer for the GEMMs. The index records the Triton and
    ptxas that built it; the metadata's digest lists both files; the two variants ship the same bytes."""
    import triton

    from kerneltools.build import aot

    variant = built.variant if which == "compiled" else built.out / "torch-cuda"
    launches = _launches()
    files = json.loads((variant / "metadata.json").read_text())["digest"]["files"]
    for arch in _aot_archs():
        index, cubins = _cubins(variant, arch)
        assert index["arch"] == arch and index["triton"] == triton.__version__ and index["compression"] == "zlib"
        assert index["target"] == aot.sm_target(arch) and index["ptxas"] == "12.9"
        want = [(l["fn"], l["consts"], l["num_warps"], l["num_stages"]) for l in launches
                if arch >= l["min_arch"]]
        assert sorted(map(repr, ((e["fn"], e["consts"], e["num_warps"], e["num_stages"]) for e, _ in cubins))) \
            == sorted(map(repr, want)), arch
        for e, cubin in cubins:
            assert cubin[:4] == b"\x7fELF" and e["name"].encode() in cubin, e["fn"]
            toolkit, target = aot.cubin_toolkit(cubin)
            assert toolkit <= aot.MAX_TOOLKIT and target == aot.sm_target(arch), (e["fn"], toolkit, target)
            assert len(e["types"]) == len(e["hints"]) and e["shared"] <= aot.MAX_SHARED[arch]
        gemm_stages = {(e["num_stages"], e["compiled_stages"]) for e, _ in cubins
                       if e["fn"] in ("_paired_gate_up_geglu_kernel", "_grouped_geglu_kernel")}
        if arch == 120:
            assert any(c == n - 1 for n, c in gemm_stages), gemm_stages  # 99 KiB: one stage fewer
        elif arch == 90:
            assert all(c == n for n, c in gemm_stages), gemm_stages
        assert {f"_prebuilt_sm{arch}.json", f"_prebuilt_sm{arch}.cubin"} <= set(files)
        if which == "torch-cuda":
            for ext in ("json", "cubin"):
                name = f"_prebuilt_sm{arch}.{ext}"
                assert (variant / name).read_bytes() == (built.variant / name).read_bytes(), name
    assert any("prebuilt Triton kernels" in line and "ptxas 12.9" in line for line in built.log), built.log


def test_every_shipped_architecture_compiles_each_family(tmp_path):
    """Every architecture the build ships by default (sm_80, 86, 89, 90, 100, 120) compiles one launch of each
    kernel family (the TMA GEMMs from sm_90 up) with the build's ptxas: a cubin of CUDA 12.9 for that target whose
    shared memory fits the architecture (through the build's own workers, as the full build compiles)."""
    from kerneltools.build import aot

    assert aot.DEFAULT_ARCHS == (80, 86, 89, 90, 100, 120)
    code = r"""
import json, sys, zlib
from kerneltools.build import aot
ptxas, version = aot.find_ptxas()
aot._init_worker(sys.argv[1], str(ptxas))
planned = aot._launches_in_worker()
sample = {}
for l in planned:
    sample.setdefault(l["fn"], l)
out = []
for arch in aot.DEFAULT_ARCHS:
    for l in sample.values():
        if arch < l["min_arch"]:
            continue
        res = aot._compile_one(dict(l, arch=arch))
        toolkit, target = aot.cubin_toolkit(zlib.decompress(res["cubin"]))
        out.append([arch, l["fn"], list(toolkit), target, res["entry"]["shared"]])
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # really compiled here
    proc = subprocess.run([sys.executable, "-c", code, str(REPO / "torch-ext" / "geglu")], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    families = {fn for _, fn, *_ in rows}
    assert {"_geglu_fwd_flat_kernel", "_fwd_kernel", "_paired_gate_up_geglu_kernel", "_grouped_geglu_kernel"} \
        <= families
    for arch in aot.DEFAULT_ARCHS:
        got = {fn for a, fn, *_ in rows if a == arch}
        assert got == (families if arch >= 90 else {f for f in families if "gate_up" not in f and "grouped" not in f})
    for arch, fn, toolkit, target, shared in rows:
        assert tuple(toolkit) == (12, 9) and target == aot.sm_target(arch) and shared <= aot.MAX_SHARED[arch], \
            (arch, fn, toolkit, target, shared)


def test_ptxas_choice(tmp_path, monkeypatch):
    """The build's ptxas: Triton's bundled CUDA 12.9 one by default; KERNELTOOLS_AOT_PTXAS picks another, which
    must be CUDA 12.8 or newer (sm_100a, sm_120a); a CUDA 13 one only when asked for by that variable (its
    cubins need a CUDA 13 driver), a default newer than 12.9 is refused with what to do."""
    from kerneltools.build import aot

    monkeypatch.delenv(aot.PTXAS_ENV, raising=False)
    path, version = aot.find_ptxas()
    assert version == (12, 9) and path.name == "ptxas"

    def fake(release):
        p = tmp_path / f"ptxas-{release}"
        p.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
        p.chmod(0o755)
        return p

    monkeypatch.setenv(aot.PTXAS_ENV, str(fake("12.4")))
    with pytest.raises(kbuild.BuildError, match=r"CUDA 12.4; the prebuilt cubins need ptxas 12.8 or newer"):
        aot.find_ptxas()
    monkeypatch.setenv(aot.PTXAS_ENV, str(fake("13.4")))
    assert aot.find_ptxas()[1] == (13, 4)
    monkeypatch.setenv(aot.PTXAS_ENV, str(tmp_path / "missing"))
    with pytest.raises(kbuild.BuildError, match="is not an executable ptxas"):
        aot.find_ptxas()
    monkeypatch.delenv(aot.PTXAS_ENV)
    import triton

    bundled = tmp_path / "triton" / "backends" / "nvidia" / "bin"
    bundled.mkdir(parents=True)
    (bundled / "ptxas").write_bytes(fake("13.4").read_bytes())
    (bundled / "ptxas").chmod(0o755)
    monkeypatch.setattr(triton, "__file__", str(tmp_path / "triton" / "__init__.py"))
    with pytest.raises(kbuild.BuildError, match=r"is CUDA 13.4: its cubins need a CUDA 13 driver. Set "
                                                r"KERNELTOOLS_AOT_PTXAS to a CUDA 12.9 ptxas"):
        aot.find_ptxas()


def test_prebuilt_sass_uses_the_instructions_the_kernels_are_tuned_for(built):
    """The shipped machine code itself (Triton's bundled cuobjdump on cubins from the variant's file): the aligned
    pointwise and in-register norm kernels load 16 bytes per access, the fused and the MoE GEMMs issue wgmma
    (HGMMA) fed by TMA (UTMALDG), and none of them touches local memory."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.is_file():
        pytest.skip("this Triton has no bundled cuobjdump")
    if 90 not in _aot_archs():
        pytest.skip(f"GEGLU_TEST_AOT_CAPABILITY={AOT_CAPABILITY} builds no sm_90 kernels")
    index = json.loads((built.variant / "_prebuilt_sm90.json").read_text())["kernels"]
    blob = (built.variant / "_prebuilt_sm90.cubin").read_bytes()
    c = lambda e, i: e["consts"][i]  # noqa: E731
    # kernel -> (instruction, the elements a program's tile covers: 16-byte accesses need 8 bf16 per thread)
    wanted = {"_geglu_fwd_flat_kernel": ("LDG.E.128", lambda e: c(e, 1)),
              "_geglu_bwd_flat_kernel": ("LDG.E.128", lambda e: c(e, 1)),
              "_geglu_fwd_kernel": ("LDG.E.128", lambda e: c(e, 1) * c(e, 2)),
              "_fwd_kernel": ("LDG.E.128", lambda e: c(e, 0) * c(e, 1)),
              "_bwd_kernel": ("LDG.E.128", lambda e: c(e, 0) * c(e, 1)),
              "_paired_gate_up_geglu_kernel": ("HGMMA", None), "_gate_up_geglu_kernel": ("HGMMA", None),
              "_grouped_geglu_kernel": ("HGMMA", None)}
    checked = 0
    for e in index:
        want, elements = wanted.get(e["fn"], (None, None))
        aligned = all(e["hints"][:2]) and e["types"][0] == "*bf16" or e["types"][0].startswith("tensordesc<bf16")
        if want is None or not aligned or e["consts"][:1] == [True] or e["num_warps"] > 8:
            continue  # one of each: bf16, aligned, the erf flavour; no 16/32-warp norm rows (those spill a little)
        if elements is not None and elements(e) < 8 * 32 * e["num_warps"]:
            continue
        wanted.pop(e["fn"])
        path = built.out / f"{e['fn']}.cubin"
        path.write_bytes(zlib.decompress(blob[e["offset"]:e["offset"] + e["size"]]))
        sass = subprocess.run([str(cuobjdump), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
        assert want in sass, (e["fn"], e["consts"])
        if want == "HGMMA":
            assert "UTMALDG" in sass, e["fn"]
        assert "STL" not in sass and "LDL" not in sass, (e["fn"], e["consts"], "local memory")
        checked += 1
    assert not wanted and checked == 8, wanted


def _launches():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; from pathlib import Path; from kerneltools.build import aot; "
            "print(json.dumps(aot.launches(Path(sys.argv[1]))))")
    proc = subprocess.run([sys.executable, "-c", code, str(REPO / "torch-ext" / "geglu")], capture_output=True,
                          text=True, env=env, check=True)
    return json.loads(proc.stdout)


def test_no_prebuilt_kernels_when_asked_for_none(built, tmp_path, monkeypatch):
    """``--aot-capability none``: the compiled variant without prebuilt kernels (Triton's JIT on the user's
    machine); a bad capability list is a clear error."""
    from kerneltools.build import aot

    monkeypatch.setenv("KERNELTOOLS_CUDA_CACHE", str(built.cache))
    variant = cuda_build.build_compiled(kbuild.read_config(REPO), tmp_path, _sid(), capability=CAP,
                                        log=lambda *a: None, aot_archs=aot.parse_archs("none"))
    assert not list(variant.glob("_prebuilt_*"))
    assert aot.parse_archs(None) == list(aot.DEFAULT_ARCHS) and aot.parse_archs("8.0, 9.0") == [80, 90]
    with pytest.raises(kbuild.BuildError, match="expected capabilities such as 9.0"):
        aot.parse_archs("sm_90")


@pytest.mark.ecosystem
def test_the_cuda_12_variant_name_is_what_kernels_gives_cuda_12_torch_builds():
    """A compiled variant built with nvcc 12.4 is named cu124, and kernels' resolver gives it to torch >= 2.10 on
    CUDA 12.4-12.9 (cu126, cu128, cu129 builds), the cu130 one to CUDA 13 torch, and torch-cuda to the rest."""
    from kerneltools.kernels_api import resolve_for_system

    cfg = kbuild.read_config(REPO)
    names = [cuda_build.variant_name(cfg, cuda_build.Nvcc(Path("nvcc"), major, minor, "", ()))
             for major, minor in ((12, 4), (13, 0))]
    assert names == ["torch-stable-abi210-cu124-x86_64-linux", "torch-stable-abi210-cu130-x86_64-linux"]
    picks = {}
    for cuda, torch_version in (("12.4", "2.10.0"), ("12.6", "2.10.0"), ("12.8", "2.11.0"), ("12.9", "2.12.0"),
                                ("13.0", "2.11.0"), ("12.1", "2.10.0"), ("12.8", "2.9.0")):
        picks[(cuda, torch_version)] = resolve_for_system(names + ["torch-cuda", "torch-cpu"], cuda=cuda,
                                                          torch_version=torch_version)[0]
    assert picks == {("12.4", "2.10.0"): names[0], ("12.6", "2.10.0"): names[0], ("12.8", "2.11.0"): names[0],
                     ("12.9", "2.12.0"): names[0], ("13.0", "2.11.0"): names[1], ("12.1", "2.10.0"): "torch-cuda",
                     ("12.8", "2.9.0"): "torch-cuda"}


CUDA12_NVCC = Path(os.environ.get("GEGLU_CUDA12_NVCC", "/opt/cuda-12.4/bin/nvcc"))


@pytest.mark.skipif(not CUDA12_NVCC.is_file(), reason="no CUDA 12 nvcc (bash scripts/setup-cuda12.sh installs one)")
def test_cuda_12_build(tmp_path, monkeypatch):
    """With the CUDA 12 toolchain of scripts/setup-cuda12.sh: the compiled variant builds as cu124 for the
    capabilities nvcc 12.4 has (sm_100 and sm_120 dropped with a note, compute_90 PTX for them), passes the ABI
    check and needs CUDA 12's runtime."""
    monkeypatch.setenv("NVCC", str(CUDA12_NVCC))
    monkeypatch.setenv("KERNELTOOLS_CUDA_CACHE", str(tmp_path / "objects"))
    log: list[str] = []
    variant = cuda_build.build_compiled(kbuild.read_config(REPO), tmp_path, _sid(), log=log.append, aot_archs=[])
    assert variant.name == "torch-stable-abi210-cu124-x86_64-linux"
    assert any("does not support 10.0, 12.0" in line for line in log), log
    meta = json.loads((variant / "metadata.json").read_text())
    assert meta["backend"]["archs"] == ["8.0", "8.6", "8.9", "9.0+PTX"]
    so = next(variant.glob("*.abi3.so"))
    needed = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    assert "[libcudart.so.12]" in needed and "libcudart.so.13" not in needed
    assert any("ABI check" in line for line in log)


def test_metadata_archs_full_list():
    caps = ["8.0", "8.6", "8.9", "9.0", "10.0", "12.0"]
    assert cuda_build.metadata_archs(caps) == ["8.0", "8.6", "8.9", "9.0", "10.0", "12.0+PTX"]
    flags = cuda_build.gencode_flags(caps)
    assert flags[0] == "-gencode=arch=compute_80,code=sm_80"
    assert flags[-1] == "-gencode=arch=compute_120,code=[sm_120,compute_120]"


# --- ABI -----------------------------------------------------------------------------------------------------


def test_abi_check(built):
    from kernel_abi_check import ObjectFile

    obj = ObjectFile(str(built.so))
    assert obj.check_manylinux("manylinux_2_28") == []
    assert obj.check_python_abi("3.9") == []
    assert cuda_build.abi_violations(built.so) == []


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) not installed")
def test_linking_and_exports(built):
    dyn = subprocess.run(["readelf", "-d", "-W", str(built.so)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dyn)
    for lib in ("libtorch_cpu.so", "libc10.so", "libtorch_cuda.so"):
        assert lib in needed, f"{lib} must be DT_NEEDED so the torch shim symbols resolve: {needed}"
    assert any(n.startswith("libcudart.so.") for n in needed), "-cudart shared expected"
    assert f"Library soname: [{built.so.name}]" in dyn
    syms = subprocess.run(["readelf", "--dyn-syms", "-W", str(built.so)], capture_output=True, text=True, check=True).stdout
    exported = {
        line.split()[-1].split("@")[0]
        for line in syms.splitlines()
        if re.search(r"\b(FUNC|OBJECT)\b", line) and " UND " not in line and "GLOBAL" in line
    }
    # the Python module's init and the plain C entry points of the package's ctypes fast path (runtime/direct.py)
    assert exported == {f"PyInit_{built.ops}", "geglu_c_fwd", "geglu_c_bwd", "geglu_c_error_string", "geglu_c_set_plan"}


# --- the kernels loader on a CPU torch -----------------------------------------------------------------------


def test_kernels_resolution_on_cpu(built):
    from kerneltools.kernels_api import resolve_local

    trace = resolve_local(built.out)
    by_name = {d.name: d for d in trace}
    assert set(by_name) == {"torch-cpu", "torch-cuda", built.variant.name}
    assert trace[0].accepted and trace[0].name == "torch-cpu"
    compiled = by_name[built.variant.name]
    assert not compiled.accepted
    assert "backend" in compiled.reason and "cpu" in compiled.reason, compiled.reason
    assert not by_name["torch-cuda"].accepted


def test_get_local_kernel_chooses_cpu(built):
    import kernels

    module = kernels.get_local_kernel(built.out)
    # the CPU variant: this build's, or (kernels >= 0.18) the identical build of the same id another test loaded
    # first, which kernels reuses after checking that the two digests agree
    assert Path(module.__file__).parent.name == "torch-cpu"
    assert module.HAS_CUDA_LIB is False


def test_only_cuda_variants_are_rejected_with_reasons(built, tmp_path):
    import kernels

    # A repo-like root with build/<variant>: kernels 0.17.2 reports the reasons of the last folder it looked at
    # (<path>, then <path>/build), so variants placed directly in <path> would give an empty list.
    shutil.copytree(built.variant, tmp_path / "build" / built.variant.name)
    shutil.copytree(built.out / "torch-cuda", tmp_path / "build" / "torch-cuda")
    with pytest.raises(FileNotFoundError) as e:
        kernels.get_local_kernel(tmp_path)
    msg = str(e.value)
    assert f"{built.variant.name}: backend (cu" in msg and "does not match" in msg, msg
    assert "torch-cuda: backend (cuda)" in msg, msg


def test_local_kernels_env_route(built):
    code = (
        "from pathlib import Path\n"
        "from kernels import get_kernel\n"
        "k = get_kernel('org/geglu', version=1)\n"
        "print(Path(k.__file__).parent.name, k.HAS_CUDA_LIB)\n"
    )
    env = dict(os.environ, LOCAL_KERNELS=f"org/geglu={built.out}", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["torch-cpu", "False"]


# --- the library itself, loaded against a stub libtorch_cuda.so ---------------------------------------------


def _cudart_dir() -> Path | None:
    nvcc = _nvcc_or_none()
    if nvcc is None:
        return None
    roots = [nvcc.resolve().parent.parent, Path("/usr/local/cuda")]
    roots += [Path(os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    # nvcc may be a wrapper script: its -dryrun output names the toolkit's real location (TOP=...).
    dry = subprocess.run([str(nvcc), "-dryrun", "--version"], capture_output=True, text=True)
    roots += [Path(m) for m in re.findall(r"^#\$ TOP=(\S+)", dry.stdout + dry.stderr, re.M)]
    for root in roots:
        for d in (root / "lib64", root / "targets" / "x86_64-linux" / "lib"):
            if list(d.glob("libcudart.so.*")):
                return d
    return None


def test_library_loads_and_registers_schemas(built, tmp_path):
    """Every torch shim symbol resolves (LD_BIND_NOW) and the schemas are exactly docs/design.md's."""
    cudart = _cudart_dir()
    if cudart is None or shutil.which("gcc") is None:
        pytest.skip("needs the CUDA runtime library and gcc")
    (tmp_path / "stub.c").write_text(cuda_build.STUB_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libtorch_cuda.so", str(tmp_path / "stub.c"), "-o",
                    str(tmp_path / "libtorch_cuda.so")], check=True)
    code = (
        "import torch, sys\n"
        f"torch.ops.load_library({str(built.so)!r})\n"
        f"ns = getattr(torch.ops, {built.ops!r})\n"
        "print(str(ns.geglu_fwd.default._schema))\n"
        "print(str(ns.geglu_bwd.default._schema))\n"
        "x = torch.zeros(2, 4)\n"
        "try:\n    ns.geglu_fwd(x, x, x, False)\nexcept NotImplementedError as e:\n    print('no CPU kernel')\n"
        # the C entry points reject a bad dtype code before touching CUDA (cudaErrorInvalidValue = 1)
        "import ctypes\n"
        f"lib = ctypes.CDLL({str(built.so)!r})\n"
        "i64, p = ctypes.c_int64, ctypes.c_void_p\n"
        "lib.geglu_c_fwd.argtypes = [ctypes.c_int, p, i64, p, i64, p, i64, i64, i64, ctypes.c_int, ctypes.c_int, p]\n"
        "lib.geglu_c_error_string.restype = ctypes.c_char_p\n"
        "print(lib.geglu_c_fwd(7, None, 0, None, 0, None, 0, 1, 1, 0, 0, None), lib.geglu_c_error_string(1).decode())\n"
        # the plan setter validates without touching CUDA: 0 = accepted, 1 = cudaErrorInvalidValue
        "plans = [(256, 2, 0), (32, 4, 0), (128, 1, 4), (0, 0, 0), (256, 3, 0), (300, 1, 0), (16, 1, 0), (256, 2, 4),\n"
        "         (256, 1, 3), (-32, 1, 0)]\n"
        "print(' '.join(str(lib.geglu_c_set_plan(*plan)) for plan in plans))\n"
    )
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{cudart}", LD_BIND_NOW="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"{built.ops}::{SCHEMAS['geglu_fwd']}"
    assert lines[1] == f"{built.ops}::{SCHEMAS['geglu_bwd']}"
    assert lines[2] == "no CPU kernel"  # registered for the CUDA dispatch key only
    assert lines[3] == "1 invalid argument"
    assert lines[4] == "0 0 0 0 1 1 1 1 1 1"


def test_sass_uses_128bit_accesses_and_no_local_memory(built):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found")
    sass = subprocess.run([tool, "-sass", str(built.so)], capture_output=True, text=True, check=True).stdout
    kernels = re.split(r"\n\s*Function : ", sass)[1:]
    # {fwd, bwd} x 3 dtypes x {exact, tanh} x (vector: tile unroll 1, 2 + pipelined 2, 4 stages; scalar: 1, 2, 4)
    assert len(kernels) == 84, len(kernels)
    seen = set()
    for body in kernels:
        name = body.split("\n", 1)[0]
        m = re.search(r"geglu_(fwd|bwd)_kernelI(f|6__half|13__nv_bfloat16)Li(\d+)ELi(\d+)ELb([01])ELi(\d+)E", name)
        assert m, name
        vec, stages = int(m.group(3)), int(m.group(6))
        seen.add((m.group(1), m.group(2), vec, int(m.group(4)), m.group(5), stages))
        if vec > 1 and stages == 0:
            assert "LDG.E.128" in body and "STG.E.128" in body, name
        if stages > 0:  # cp.async 16-byte copies into shared memory, 16-byte reads back, 16-byte stores
            assert "LDGSTS.E.BYPASS.128" in body and "LDS.128" in body and "STG.E.128" in body, name
            assert f"DEPBAR.LE SB0, 0x{stages - 1:x}" in body, name  # cp.async.wait_group kStages - 1
        assert not re.search(r"\b(LDL|STL)\b", body), f"local memory (spills) in {name}"
    assert len(seen) == 84


# --- caching -------------------------------------------------------------------------------------------------


def _sid() -> kbuild.SourceId:
    return kbuild.source_id(REPO)


def test_rebuild_without_changes_does_not_recompile(built, monkeypatch):
    cfg = kbuild.read_config(REPO)
    before = built.so.read_bytes()
    log: list[str] = []

    def no_build(*args, **kwargs):
        raise AssertionError("the up-to-date variant was compiled or linked again")

    monkeypatch.setattr(cuda_build, "run_nvcc", no_build)
    monkeypatch.setattr(cuda_build, "_compile_and_link", no_build)
    variant = cuda_build.build_compiled(cfg, built.out, _sid(), capability=CAP, log=log.append,
                                        aot_archs=_aot_archs())
    assert variant == built.variant
    assert any("up to date" in line for line in log), log
    assert not any("geglu_kernels.cu" in line for line in log), log  # no nvcc, no cached-object relink
    assert built.so.read_bytes() == before
    assert cuda_build.embedded_key(built.so) is not None


def test_new_ops_id_relinks_without_nvcc(built, tmp_path, monkeypatch):
    """A commit that leaves the CUDA sources alone (new ops id) reuses the cached nvcc object."""
    monkeypatch.setenv("KERNELTOOLS_CUDA_CACHE", str(built.cache))
    cfg = kbuild.read_config(REPO)
    sid = kbuild.SourceId("abcdef1", None, True)
    log: list[str] = []
    variant = cuda_build.build_compiled(cfg, tmp_path, sid, capability=CAP, log=log.append, aot_archs=_aot_archs())
    assert any("reusing the cached object" in line for line in log), log
    assert (variant / "_geglu_cuda_abcdef1_dirty.abi3.so").is_file()
    meta = json.loads((variant / "metadata.json").read_text())
    assert meta["id"] == "_geglu_cuda_abcdef1_dirty"
    assert "kernel" not in meta["provenance"]  # no git commit to record


# --- errors --------------------------------------------------------------------------------------------------


def _no_nvcc_env(monkeypatch, tmp_path):
    for var in ("NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def test_missing_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    _no_nvcc_env(monkeypatch, tmp_path)
    cfg = kbuild.read_config(REPO)
    with pytest.raises(kbuild.BuildError, match=r"nvcc not found .*CUDA toolkit.*NVCC=/path/to/nvcc"):
        cuda_build.build_compiled(cfg, tmp_path / "out", kbuild.SourceId("abcdef1", None, True), capability=CAP)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_missing_nvcc_on_the_command_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("NVCC", "CUDA_HOME", "CUDA_PATH")}
    (tmp_path / "bin").mkdir()
    env["PATH"] = str(tmp_path / "bin")
    proc = subprocess.run(
        [sys.executable, "-m", "kerneltools", "build", "--variant", "cuda-compiled", "--capability", CAP,
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, cwd=REPO,
    )
    assert proc.returncode == 2
    assert "error: nvcc not found" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_nvcc_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("NVCC", str(tmp_path / "no-such-nvcc"))
    with pytest.raises(kbuild.BuildError, match="is not an executable nvcc"):
        cuda_build.find_nvcc()


@needs_nvcc
@pytest.mark.parametrize("cap, message", [("3.5", "does not support it"), ("9", "expected a compute capability"),
                                          ("sm_3", "expected a compute capability")])
def test_unsupported_capability(cap, message, tmp_path):
    cfg = kbuild.read_config(REPO)
    with pytest.raises(kbuild.BuildError, match=message):
        cuda_build.build_compiled(cfg, tmp_path, kbuild.SourceId("abcdef1", None, True), capability=cap)


@needs_nvcc
def test_capability_list_is_checked_against_nvcc():
    nvcc = cuda_build.probe_nvcc(cuda_build.find_nvcc())
    assert "9.0" in nvcc.capabilities
    cfg = kbuild.read_config(REPO)
    caps = cuda_build.select_capabilities(cfg, nvcc, None, log=lambda *_: None)
    assert caps == [c for c in cfg.cuda_capabilities if c in nvcc.capabilities]
    assert cuda_build.select_capabilities(cfg, nvcc, "sm_90") == ["9.0"]
