"""Prebuilt Triton kernels for the CUDA variants (the compiled ones and the noarch ``torch-cuda``): every launch the
package's plans can make, compiled at build time for each architecture asked for (``triton.compile`` for
``GPUTarget("cuda", XY, 32)``, no GPU needed; every cubin assembled by one ``ptxas``, CUDA 12.9's by default, so
that CUDA 12 and 13 drivers both load them), and written into the variant folder as ``_prebuilt_smXY.json`` (the
index) and ``_prebuilt_smXY.cubin`` (the zlib-compressed cubins, concatenated). The package's ``runtime.aot`` module
launches them through the CUDA driver (see its docstring).

What is compiled (:func:`launches`): what each kernel module's ``prebuild_launches()`` lists, next to the plan
functions it follows (``pointwise.kernels``, ``rmsnorm.kernels``, the fused GEMM's ``mlp.kernels`` and the MoE
kernel's ``experts.kernels``): the constexpr combinations the plans choose, each dtype, and the argument hints
Triton's JIT would give an aligned launch (16-byte aligned pointers, integers divisible by 16). Integers that only bound rows or loops (``M``, the TMA kernels' sizes) are never
hinted, so one binary serves every value; the few whose hint changes the code (a flat kernel's length, a row width)
are compiled both ways. A launch outside this set (an unaligned view, an unusual plan) runs Triton's JIT.

Compiling runs in worker processes that import the package's kernel modules from ``torch-ext/<name>/`` without
its ``__init__`` (no ``_ops``, no torch extension) and without ``TRITON_INTERPRET``. Each kernel is cached by content
in ``<root>/.cache/kerneltools-aot/`` (``KERNELTOOLS_AOT_CACHE``): the key covers the kernel sources, the launch and
Triton's version, so a rebuild recompiles only what changed.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib
import json
import multiprocessing
import os
import inspect
import re
import subprocess
import struct
import sys
import time
import types
import zlib
from pathlib import Path

from .config import BuildError, KernelConfig

# The architectures prebuilt when the build is not told otherwise (--aot-capability): A100 / A30 (8.0), A10 / A40 /
# RTX 30 (8.6), L4 / L40S / RTX 40 (8.9), H100 / H200 / GH200 (9.0), B200 / GB200 (10.0), RTX 50 / RTX PRO (12.0).
DEFAULT_ARCHS = (80, 86, 89, 90, 100, 120)
# The modules whose kernels are prebuilt (each declares prebuild_launches() and PREBUILD_MIN_ARCH), and every file
# their kernels' code comes from (the compile cache's key)
KERNEL_MODULES = ("pointwise.kernels", "rmsnorm.kernels", "mlp.kernels", "experts.kernels")
KERNEL_SOURCES = ("runtime/gelu_math.py",) + tuple(m.replace(".", "/") + ".py" for m in KERNEL_MODULES)
MAX_SHARED = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024}
CACHE_ENV = "KERNELTOOLS_AOT_CACHE"
PREFIX = "_prebuilt_sm"  # the package's runtime.aot.PREFIX: <PREFIX><XY>.json and .cubin in the variant folder
PTXAS_ENV = "KERNELTOOLS_AOT_PTXAS"  # the ptxas that assembles every architecture's cubins (default: Triton's CUDA 12)
# The newest toolkit whose cubins every driver the kernels library serves loads: a CUDA 12.x cubin loads on any
# CUDA 12 driver (>= 525, minor-version compatibility) and on CUDA 13 drivers; CUDA 13's need a driver >= 580.
MAX_TOOLKIT = (12, 9)
MIN_TOOLKIT = (12, 8)  # the first ptxas that knows sm_100a and sm_120a


def parse_archs(text: str | None) -> list[int]:
    """``"9.0"`` / ``"8.0,9.0"`` / ``"none"`` -> [90] / [80, 90] / []; None -> the default."""
    if text is None:
        return list(DEFAULT_ARCHS)
    text = text.strip().lower()
    if text in ("", "none", "0"):
        return []
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\.(\d)\s*", part)
        if not m:
            raise BuildError(f"--aot-capability {text!r}: expected capabilities such as 9.0 or 8.0,9.0, or none.")
        out.append(int(m.group(1)) * 10 + int(m.group(2)))
    return sorted(set(out))


def sm_target(arch: int) -> str:
    """The ``--gpu-name`` Triton assembles for: the arch-specific ``sm_XYa`` from sm_90 up (wgmma, TMA and
    tcgen05 need it; such a cubin runs on that exact architecture only), the portable ``sm_XY`` below."""
    return f"sm_{arch}{'a' if arch >= 90 else ''}"


# --- what is compiled ----------------------------------------------------------------------------------------------


def _pkg(package_dir: Path) -> dict:
    """The package's kernel modules by name, imported as submodules of a stand-in package (its __init__ is not run)."""
    name = "_kerneltools_aot_pkg"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(package_dir)]
        sys.modules[name] = pkg
    return {m: importlib.import_module(f"{name}.{m}") for m in KERNEL_MODULES}


def launches(package_dir: Path) -> list[dict]:
    """Every launch to prebuild: each kernel module's ``prebuild_launches()`` entries ({fn, args: [(name, type,
    hinted)], consts, num_warps, num_stages}) with the module's name and its ``PREBUILD_MIN_ARCH``. In a process
    without TRITON_INTERPRET (the build runs it in a worker)."""
    mods = _pkg(package_dir)
    if mods["pointwise.kernels"].INTERPRET:
        raise BuildError("the kernels to prebuild are listed from the package imported without TRITON_INTERPRET "
                         "(under it the package defines the interpreter's tiles); unset it.")
    out = []
    for name, mod in mods.items():
        for launch in mod.prebuild_launches():
            out.append(dict(launch, module=name, min_arch=mod.PREBUILD_MIN_ARCH))
    return out


# --- compiling ------------------------------------------------------------------------------------------------------

_WORKER = {}


def _init_worker(package_dir: str, ptxas: str) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    # Triton takes TRITON_PTXAS_PATH below sm_90 and TRITON_PTXAS_BLACKWELL_PATH from sm_90 up: both the one ptxas,
    # so that every architecture's cubins (and the PTX ISA version Triton emits) come from one toolkit.
    os.environ["TRITON_PTXAS_PATH"] = os.environ["TRITON_PTXAS_BLACKWELL_PATH"] = ptxas
    major, minor = ptxas_version(Path(ptxas))
    os.environ["KERNELTOOLS_AOT_TOOLKIT"] = f"{major}.{minor}"  # what _compile_one checks each cubin against
    _WORKER["pkg"] = _pkg(Path(package_dir))


def cuda_release(path: Path, fix: str) -> tuple[int, int, str]:
    """(major, minor, the whole text) of a CUDA tool's ``--version`` (nvcc, ptxas); ``fix`` ends the error when the
    tool does not run."""
    try:
        text = subprocess.run([str(path), "--version"], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise BuildError(f"{path} --version failed ({e}); {fix}") from None
    m = re.search(r"release (\d+)\.(\d+)", text)
    if not m:
        raise BuildError(f"Could not read the CUDA release from `{path} --version`:\n{text}")
    return int(m.group(1)), int(m.group(2)), text


def ptxas_version(path: Path) -> tuple[int, int]:
    """(major, minor) of a ptxas, from ``--version``."""
    return cuda_release(path, f"point {PTXAS_ENV} at a working ptxas.")[:2]


def find_ptxas() -> tuple[Path, tuple[int, int]]:
    """The ptxas for the prebuilt cubins and its version: ``$KERNELTOOLS_AOT_PTXAS``, else the CUDA 12 ptxas Triton
    bundles (``backends/nvidia/bin/ptxas``). A toolkit newer than :data:`MAX_TOOLKIT` is refused unless asked for
    by the variable (its cubins would not load on CUDA 12 drivers); one older than :data:`MIN_TOOLKIT` cannot
    assemble sm_100a / sm_120a."""
    env = os.environ.get(PTXAS_ENV)
    if env:
        path = Path(env)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BuildError(f"{PTXAS_ENV}={env!r} is not an executable ptxas. Point it at one or unset it.")
    else:
        import triton

        path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        if not path.is_file():
            raise BuildError(f"Triton {triton.__version__} bundles no ptxas at {path}: set {PTXAS_ENV} to a CUDA "
                             f"{MAX_TOOLKIT[0]}.{MAX_TOOLKIT[1]} ptxas, or build with --aot-capability none.")
    version = ptxas_version(path)
    if version < MIN_TOOLKIT:
        raise BuildError(f"{path} is CUDA {version[0]}.{version[1]}; the prebuilt cubins need ptxas "
                         f"{MIN_TOOLKIT[0]}.{MIN_TOOLKIT[1]} or newer (sm_100a, sm_120a).")
    if version > MAX_TOOLKIT and not env:
        raise BuildError(f"{path} is CUDA {version[0]}.{version[1]}: its cubins need a CUDA {version[0]} driver. Set "
                         f"{PTXAS_ENV} to a CUDA {MAX_TOOLKIT[0]}.{MAX_TOOLKIT[1]} ptxas (CUDA 12 and 13 drivers "
                         "both load its cubins).")
    return path, version


def _launches_in_worker() -> list[dict]:
    """:func:`launches` where the kernel modules were imported without TRITON_INTERPRET (under it they define the
    interpreter's stand-ins and tiles)."""
    return launches(Path(_WORKER["pkg"]["pointwise.kernels"].__file__).parents[1])


def _entry_params(ptx: str, name: str) -> list[str]:
    """The .param declarations of the PTX entry ``name``."""
    start = ptx.index(f".entry {name}(")
    body = ptx[start:ptx.index(")", start)]
    return re.findall(r"\.param (.+?) \w+_param_\d+", body)


def _compile_one(job: dict) -> dict:
    """Compile one launch for one arch; returns the index entry (without offset) and the compressed cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod = _WORKER["pkg"][job["module"]]
    fn = getattr(mod, job["fn"])
    names = fn.arg_names
    consts = dict(zip(names[len(job["args"]):], job["consts"]))
    signature = {n: t for n, t, _ in job["args"]}
    signature.update({n: "constexpr" for n in consts})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, _, h in job["args"] if h}
    stages = job["num_stages"]
    limit = MAX_SHARED.get(job["arch"], 99 * 1024)
    while True:
        k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", job["arch"], 32),
                           options=dict(num_warps=job["num_warps"], num_stages=stages, enable_fp_fusion=False))
        md = k.metadata
        if md.shared <= limit or stages <= 2:
            break
        stages -= 1  # what the launcher does on OutOfResources: one pipeline stage fewer
    if md.shared > limit:
        raise BuildError(f"{job['fn']} {job['consts']}: {md.shared} bytes of shared memory, more than sm_{job['arch']} "
                         f"has ({limit}).")
    for field, want in (("global_scratch_size", 0), ("profile_scratch_size", 0), ("num_ctas", 1),
                        ("launch_cooperative_grid", False), ("launch_pdl", False)):
        if getattr(md, field, want) != want:
            raise BuildError(f"{job['fn']}: {field} = {getattr(md, field)}; the prebuilt launcher supports {want}.")
    toolkit, gpu = cubin_toolkit(k.asm["cubin"])
    if gpu != sm_target(job["arch"]) or f"{toolkit[0]}.{toolkit[1]}" != os.environ.get("KERNELTOOLS_AOT_TOOLKIT"):
        raise BuildError(f"{job['fn']}: the cubin records ptxas {toolkit[0]}.{toolkit[1]} for {gpu}; the build asked "
                         f"for ptxas {os.environ.get('KERNELTOOLS_AOT_TOOLKIT')} for {sm_target(job['arch'])} "
                         "(Triton ignored TRITON_PTXAS_PATH / TRITON_PTXAS_BLACKWELL_PATH?).")
    params = _entry_params(k.asm["ptx"], md.name)
    expected = sum(1 + 2 * (t.count(",") + 1) if t.startswith("tensordesc") else 1 for _, t, _ in job["args"]) + 2
    if len(params) != expected:
        raise BuildError(f"{job['fn']}: the compiled entry has {len(params)} parameters, the prebuilt launcher "
                         f"passes {expected} ({job['args']}); Triton {triton.__version__} lays them out differently.")
    meta = [dict(swizzle=d["swizzle"], elem_size=d["elem_size"], elem_type=d["elem_type"],
                 block_size=list(d["block_size"])) for d in (md.tensordesc_meta or [])]
    entry = dict(fn=job["fn"], consts=job["consts"], num_warps=job["num_warps"], num_stages=job["num_stages"],
                 compiled_stages=stages, types=[t for _, t, _ in job["args"]], hints=[h for _, _, h in job["args"]],
                 name=md.name, shared=md.shared, tensordesc_meta=meta)
    return dict(entry=entry, cubin=zlib.compress(k.asm["cubin"], 9))


# The compiling code's text, read once with the module: inspect reads the file again at each call, and a file edited
# while a build runs gave the second variant's kernels other keys than the first's.
_COMPILE_ONE_SOURCE = inspect.getsource(_compile_one).encode()

# PTX ISA version -> the first CUDA release whose ptxas takes it (12.6 kept ISA 8.5)
_PTX_ISA_RELEASE = {(8, 0): (12, 0), (8, 1): (12, 1), (8, 2): (12, 2), (8, 3): (12, 3), (8, 4): (12, 4), (8, 5): (12, 5),
                    (8, 6): (12, 7), (8, 7): (12, 8), (8, 8): (12, 9)}


def _sections(cubin: bytes) -> dict[bytes, bytes]:
    """A 64-bit little-endian ELF's sections by name."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx][4]
    return {cubin[strtab + h[0]:cubin.index(b"\0", strtab + h[0])]: cubin[h[4]:h[4] + h[5]] for h in headers}


def cubin_toolkit(cubin: bytes) -> tuple[tuple[int, int], str]:
    """((major, minor), gpu name): the CUDA release of the ptxas that assembled a cubin and its target (``sm_86``,
    ``sm_90a``), as the cubin records them. CUDA 13's ptxas (and CUDA 12's for the ``a`` targets) writes ELF ABI
    version 8 with a ``.note.nv.tkinfo`` note naming its release and ``-arch``; CUDA 12's writes ABI version 7
    without it for the portable targets, and there the release is the one the embedded PTX's ``.version`` needs
    (Triton's ``-lineinfo`` keeps the PTX in ``.nv_debug_ptx_txt``): an ABI 7 cubin is from a CUDA 12 ptxas, which
    took that PTX ISA, so ISA 8.8 means 12.9."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise BuildError("not a 64-bit ELF cubin")
    sections = _sections(cubin)
    note = sections.get(b".note.nv.tkinfo")
    if note is not None:
        text = note.decode("latin-1")
        release = re.search(r"release (\d+)\.(\d+)", text)
        arch = re.search(r"-arch (sm_\w+)", text)
        if release and arch:
            return (int(release.group(1)), int(release.group(2))), arch.group(1)
        raise BuildError("the cubin's .note.nv.tkinfo names no ptxas release and -arch")
    ptx = sections.get(b".nv_debug_ptx_txt", b"").decode("latin-1")
    version = re.search(r"\.version (\d+)\.(\d+)", ptx)
    target = re.search(r"\.target (sm_\w+)", ptx)
    if cubin[8] != 7 or not version or not target:
        raise BuildError(f"the cubin (ELF ABI version {cubin[8]}) records no ptxas release: no .note.nv.tkinfo note, "
                         "no embedded PTX of a CUDA 12 layout")
    isa = (int(version.group(1)), int(version.group(2)))
    if isa not in _PTX_ISA_RELEASE:
        raise BuildError(f"the cubin is of CUDA 12's layout (ELF ABI 7) but holds PTX ISA {isa[0]}.{isa[1]}, which "
                         "no CUDA 12 ptxas takes")
    return _PTX_ISA_RELEASE[isa], target.group(1)


def _job_key(job: dict, sources: bytes, triton_version: str, ptxas: tuple[int, int]) -> str:
    """The cache key of one compiled kernel: the kernel sources, the launch, the Triton and ptxas versions and the
    code that compiles it (:func:`_compile_one`, the shared-memory limits)."""
    h = hashlib.sha256()
    h.update(sources)
    h.update(triton_version.encode())
    h.update(f"ptxas {ptxas[0]}.{ptxas[1]}".encode())
    h.update(json.dumps(job, sort_keys=True).encode())
    h.update(_COMPILE_ONE_SOURCE)
    h.update(json.dumps(MAX_SHARED, sort_keys=True).encode())
    return h.hexdigest()[:32]


def build_aot(cfg: KernelConfig, variant: Path, archs: list[int], log=print, jobs: int | None = None) -> dict:
    """Write ``variant/_prebuilt_smXY.{json,cubin}`` for each arch; returns {arch: number of kernels}."""
    if not archs:
        return {}
    try:
        import triton
    except ImportError as e:
        raise BuildError("prebuilding the Triton kernels needs triton installed (pip install triton), or build "
                         "with --aot-capability none.") from e
    t0 = time.monotonic()
    ptxas, ptxas_v = find_ptxas()
    toolkit = f"{ptxas_v[0]}.{ptxas_v[1]}"
    pkg_dir = cfg.package_dir
    sources = b"".join((pkg_dir / f).read_bytes() for f in KERNEL_SOURCES)
    cache = Path(os.environ.get(CACHE_ENV) or cfg.root / ".cache" / "kerneltools-aot")
    cache.mkdir(parents=True, exist_ok=True)
    todo, done, all_jobs = [], {}, []
    ctx = multiprocessing.get_context("spawn")
    workers = jobs or max(1, os.cpu_count() or 1)
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                                initargs=(str(pkg_dir), str(ptxas))) as pool:
        planned = pool.submit(_launches_in_worker).result()
        for arch in archs:
            for launch in planned:
                if arch < launch["min_arch"]:
                    continue  # e.g. kernels that take TMA tensor descriptors: sm_90 and newer
                job = dict(launch, arch=arch)
                k = _job_key(job, sources, triton.__version__, ptxas_v)
                all_jobs.append((job, k))
                hit = cache / f"{k}.json"
                if hit.is_file() and (cache / f"{k}.cubin").is_file():
                    done[k] = dict(entry=json.loads(hit.read_text()), cubin=(cache / f"{k}.cubin").read_bytes())
                else:
                    todo.append((job, k))
        log(f"  prebuilt Triton kernels: {len(all_jobs)} for sm_{', sm_'.join(map(str, archs))} "
            f"(Triton {triton.__version__}, ptxas {toolkit}), {len(all_jobs) - len(todo)} cached, compiling {len(todo)}")
        futures = {pool.submit(_compile_one, job): (job, k) for job, k in todo}
        step = max(1, len(todo) // 10)
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            job, k = futures[fut]
            res = fut.result()
            (cache / f"{k}.cubin").write_bytes(res["cubin"])
            (cache / f"{k}.json").write_text(json.dumps(res["entry"]))
            done[k] = res
            if i % step == 0 or i == len(todo):
                log(f"    compiled {i}/{len(todo)} ({time.monotonic() - t0:.0f}s)")
    counts = {}
    for arch in archs:
        entries, blob = [], bytearray()
        for job, k in all_jobs:
            if job["arch"] != arch:
                continue
            res = done[k]
            entries.append(dict(res["entry"], offset=len(blob), size=len(res["cubin"])))
            blob += res["cubin"]
        (variant / f"{PREFIX}{arch}.cubin").write_bytes(bytes(blob))
        manifest = dict(arch=arch, target=sm_target(arch), triton=triton.__version__, ptxas=toolkit, compression="zlib",
                        kernels=entries)
        (variant / f"{PREFIX}{arch}.json").write_text(json.dumps(manifest, separators=(",", ":")) + "\n")
        counts[arch] = len(entries)
    log(f"  prebuilt Triton kernels written: {', '.join(f'{PREFIX}{a}.*' for a in archs)} "
        f"({sum(counts.values())} kernels, "
        f"{sum((variant / f'{PREFIX}{a}.cubin').stat().st_size for a in archs) / 2**20:.1f} MiB) "
        f"in {time.monotonic() - t0:.1f}s")
    return counts


__all__ = ["build_aot", "launches", "parse_archs", "DEFAULT_ARCHS"]
