"""Prebuilt Triton kernels (compiled at build time per declared ``sm_XY``), launched through the CUDA driver.

Per architecture the package folder holds ``_prebuilt_smXY.json`` (the index: launch key, entry name, shared memory,
parameters, TMA layouts, offset and size per kernel) and ``_prebuilt_smXY.cubin`` (zlib-compressed cubins). A device
runs :func:`serving_arch`'s binaries. :func:`find` returns None where there is no entry or the ``prebuilt`` setting is
off (the caller uses Triton's JIT). A binary the driver refuses turns prebuilt kernels off on that device (one warning).
"""

import ctypes
import functools
import json
import os
import struct
import threading
import warnings
import zlib

import torch

from . import config as _config

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package's root folder
PREFIX = "_prebuilt_sm"
TYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
              torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8"}
# The compiler's TMA element type -> cuTensorMapEncodeTiled's CUtensorMapDataType (as Triton's launcher maps them)
_TMA_HOST_TYPE = {8: 10, 9: 8, 10: 9}
_I32_MIN, _I32_MAX = -(2 ** 31), 2 ** 31


class Desc:
    """A host-side TMA descriptor encoded at launch: ``base`` tensor, ``shape``, element ``strides`` (unit last
    stride) and the kernel's ``block`` shape."""

    __slots__ = ("base", "shape", "strides", "block")

    def __init__(self, base, shape, strides, block):
        self.base, self.shape, self.strides, self.block = base, list(shape), list(strides), list(block)


def arg_type(a) -> str:
    """The Triton signature type of a launch argument."""
    if isinstance(a, Desc):
        return f"tensordesc<{TYPE_NAMES[a.base.dtype]}[{', '.join(map(str, a.block))}]>"
    if isinstance(a, bool):
        return "i1"
    if isinstance(a, int):
        return "i32" if _I32_MIN <= a < _I32_MAX else "i64"
    if isinstance(a, float):
        return "fp32"
    return "*" + TYPE_NAMES[a.dtype]


def arg_hint(a) -> bool:
    """Whether Triton would mark the argument divisible by 16 (pointers: 16-byte aligned); never descriptors, bools,
    floats."""
    if isinstance(a, (Desc, bool, float)):
        return False
    if isinstance(a, int):
        return a % 16 == 0
    return a.data_ptr() % 16 == 0


def key(fn_name: str, consts, num_warps: int, num_stages: int, types) -> str:
    """The index key of a launch (``types``: the arguments' signature types in order; bool constexprs as 0 / 1)."""
    consts = [int(c) if isinstance(c, bool) else c for c in consts]
    return json.dumps([fn_name, consts, num_warps, num_stages, list(types)])


# --- the index ---------------------------------------------------------------------------------------------------
_lock = threading.Lock()
_indexes = {}  # arch -> (entries by key, cubin bytes) or None


def _index(arch: int):
    idx = _indexes.get(arch, False)
    if idx is not False:
        return idx
    with _lock:
        if arch in _indexes:
            return _indexes[arch]
        idx = None
        path = os.path.join(HERE, f"{PREFIX}{arch}.json")
        if os.path.exists(path):
            with open(path) as f:
                manifest = json.load(f)
            with open(os.path.join(HERE, f"{PREFIX}{arch}.cubin"), "rb") as f:
                blob = f.read()
            entries = {}
            for e in manifest["kernels"]:
                e["hint_mask"] = sum(1 << i for i, h in enumerate(e["hints"]) if h)
                entries.setdefault(key(e["fn"], e["consts"], e["num_warps"], e["num_stages"], e["types"]), []).append(e)
            for group in entries.values():  # the most specialised first
                group.sort(key=lambda e: -len([h for h in e["hints"] if h]))
            idx = (entries, blob)
        _indexes[arch] = idx
        return idx


def architectures():
    """The architectures (XY) this variant ships prebuilt kernels for, sorted."""
    return sorted(int(n[len(PREFIX):-5]) for n in os.listdir(HERE) if n.startswith(PREFIX) and n.endswith(".json"))


def serving_arch(capability: int, shipped) -> "int | None":
    """The shipped architecture whose binaries a device of ``capability`` (XY, e.g. 87) runs, or None (Triton's
    JIT): the exact one; else, below 90, the highest shipped one of the same major and a lower minor."""
    if capability in shipped:
        return capability
    if capability >= 90:
        return None
    same_major = [a for a in shipped if a // 10 == capability // 10 and a < capability]
    return max(same_major) if same_major else None


# The compute capabilities (XY) that info()'s ``gpus`` reports on
FAMILIES = (75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121)


def preload() -> None:
    """Read the index and cubins of every shipped architecture now."""
    for arch in architectures():
        _index(arch)


def info() -> dict:
    """What this variant ships prebuilt: ``architectures`` (XY list), per architecture the ``kernels`` count and ptxas
    ``targets``, the ``ptxas`` and ``triton`` versions that compiled them, ``gpus`` (each capability of ``FAMILIES``
    -> ``{'runs': 'sm_XY'}`` or ``{'runs': 'jit'}``) and ``refused`` (device index -> the driver's error)."""
    out = {"architectures": architectures(), "kernels": {}, "targets": {}, "ptxas": None, "triton": None}
    for arch in out["architectures"]:
        with open(os.path.join(HERE, f"{PREFIX}{arch}.json")) as f:
            manifest = json.load(f)
        out["kernels"][arch] = len(manifest["kernels"])
        out["targets"][arch] = manifest.get("target")
        out["ptxas"] = manifest.get("ptxas")
        out["triton"] = manifest.get("triton")
    archs = {cap: serving_arch(cap, out["architectures"]) for cap in FAMILIES}
    out["gpus"] = {cap: {"runs": "jit" if a is None else f"sm_{a}"} for cap, a in archs.items()}
    out["refused"] = dict(_refused)
    return out


# --- the driver ----------------------------------------------------------------------------------------------------
_cuda = None
_arch_of = {}  # device index -> sm number (None: no prebuilt kernels there)
_loaded = {}  # (entry id, device) -> CUfunction
_launchers = {}  # (entry id, device) -> run
_refused = {}  # device index -> the driver's error refusing a prebuilt binary


def clear_caches() -> None:
    """Forget the indexes read, the modules loaded, the devices' architectures and the drivers' refusals."""
    for cache in (_indexes, _arch_of, _loaded, _launchers, _refused):
        cache.clear()


class _Refused(Exception):
    """The driver refused a prebuilt binary (cuModuleLoadData / cuModuleGetFunction / cuFuncSetAttribute)."""


def _driver():
    global _cuda
    if _cuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp, u32 = ctypes.c_void_p, ctypes.c_uint
        lib.cuLaunchKernel.argtypes = [vp, u32, u32, u32, u32, u32, u32, u32, vp, vp, vp]
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
        lib.cuFuncSetAttribute.argtypes = [vp, ctypes.c_int, ctypes.c_int]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), ctypes.c_int]
        lib.cuCtxSetCurrent.argtypes = [vp]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuTensorMapEncodeTiled.argtypes = [vp, ctypes.c_int, u32, vp, vp, vp, vp, vp, ctypes.c_int, ctypes.c_int,
                                               ctypes.c_int, ctypes.c_int]
        _cuda = lib
    return _cuda


def _error_text(status: int) -> str:
    msg = ctypes.c_char_p()
    _cuda.cuGetErrorString(status, ctypes.byref(msg))
    return msg.value.decode() if msg.value else "unknown"


def _check(status: int, what: str, refused: bool = False) -> None:
    """Raise for a failed driver call: _Refused where the driver refused a binary (``refused``), else RuntimeError."""
    if status:
        text = f"{what} failed with CUDA error {status} ({_error_text(status)})"
        raise _Refused(text) if refused else RuntimeError(f"geglu: {text} for a prebuilt kernel.")


def _arch(device_index: int):
    arch = _arch_of.get(device_index, False)
    if arch is False:
        major, minor = torch.cuda.get_device_capability(device_index)
        arch = serving_arch(major * 10 + minor, architectures())
        arch = arch if arch is not None and _index(arch) is not None else None
        _arch_of[device_index] = arch
    return arch


def _function(entry: dict, device_index: int, blob: bytes):
    fid = (id(entry), device_index)
    fn = _loaded.get(fid)
    if fn is None:
        lib = _driver()
        ctx = ctypes.c_void_p()
        _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:  # no current context on this thread: use the primary one
            _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device_index), "cuDevicePrimaryCtxRetain")
            _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        module, fn_ptr = ctypes.c_void_p(), ctypes.c_void_p()
        image = zlib.decompress(blob[entry["offset"]:entry["offset"] + entry["size"]])
        _check(lib.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData", True)
        _check(lib.cuModuleGetFunction(ctypes.byref(fn_ptr), module, entry["name"].encode()), "cuModuleGetFunction",
               True)
        if entry["shared"] > 48 * 1024:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(lib.cuFuncSetAttribute(fn_ptr, 8, entry["shared"]), "cuFuncSetAttribute", True)
        fn = _loaded[fid] = fn_ptr.value
    return fn


@functools.lru_cache(maxsize=4096)
def _float_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


_descs = {}  # (base, shape, strides, box, swizzle, type) -> the encoded CUtensorMap


def _encode(d: Desc, meta: dict, words, at: int) -> None:
    """Write d's CUtensorMap (16 words) at words[at:], encoded tiled as Triton encodes it."""
    key = (d.base.data_ptr(), tuple(d.shape), tuple(d.strides), tuple(meta["block_size"]), meta["swizzle"],
           meta["elem_type"])
    desc = _descs.get(key)
    if desc is None:
        rank = len(d.shape)
        es = meta["elem_size"]
        u64x5, u32x5 = ctypes.c_uint64 * 5, ctypes.c_uint32 * 5
        scratch = (ctypes.c_uint8 * 192)()  # a CUtensorMap is 64-byte aligned
        aligned = ctypes.addressof(scratch) + (-ctypes.addressof(scratch)) % 64
        dims = u64x5(*reversed(d.shape))
        strides = u64x5(*[s * es for s in reversed(d.strides[:-1])])
        box = u32x5(*reversed(meta["block_size"]))
        ones = u32x5(1, 1, 1, 1, 1)
        status = _cuda.cuTensorMapEncodeTiled(aligned, _TMA_HOST_TYPE.get(meta["elem_type"], meta["elem_type"]), rank,
                                              key[0], dims, strides, box, ones, 0, meta["swizzle"], 2, 0)
        _check(status, "cuTensorMapEncodeTiled")
        desc = ctypes.string_at(aligned, 128)
        if len(_descs) >= 4096:
            _descs.clear()
        _descs[key] = desc
    ctypes.memmove(ctypes.addressof(words) + 8 * at, desc, 128)


def find(fn_name: str, args, consts, num_warps: int, num_stages: int, device_index: int):
    """The prebuilt kernel for this launch on ``device_index`` as ``run(grid, args, stream)``, or None."""
    if not _config.current.prebuilt:
        return None
    arch = _arch(device_index)
    if arch is None:
        return None
    entries, blob = _indexes[arch]
    group = entries.get(key(fn_name, consts, num_warps, num_stages, [arg_type(a) for a in args]))
    if not group:
        return None
    have = sum(1 << i for i, a in enumerate(args) if arg_hint(a))
    for entry in group:
        if entry["hint_mask"] & ~have == 0:
            lid = (id(entry), device_index)
            run = _launchers.get(lid)
            if run is None:
                try:
                    function = _function(entry, device_index, blob)
                except _Refused as e:
                    _refuse(device_index, arch, e)
                    return None
                run = _launchers[lid] = _launcher(entry, function)
            return run
    return None


def _refuse(device_index: int, arch: int, error: Exception) -> None:
    """Turn prebuilt kernels off on this device after the driver refused one; warns once per device."""
    with _lock:
        if device_index in _refused:
            return
        _refused[device_index] = str(error)
        _arch_of[device_index] = None
    warnings.warn(f"geglu: the CUDA driver refused the prebuilt sm_{arch} kernels on cuda:{device_index} ({error}); "
                  "Triton's JIT compiles the kernels there instead (a first call of each takes seconds). A driver "
                  "older than the toolkit that built them (see geglu.prebuilt_kernels()['ptxas']) refuses them: "
                  "update the driver, or set GEGLU_PREBUILT=0 to skip them.", RuntimeWarning, stacklevel=3)


def _launcher(entry: dict, function: int):
    """run(grid, args, stream): the parameters packed as 64-bit words (a TMA descriptor: 16 words, then its shape
    and strides; then two null scratch pointers), launched with the compiled block and shared memory; an empty
    grid launches nothing."""
    kinds = entry["types"]
    metas = entry.get("tensordesc_meta") or []
    threads, shared = 32 * entry["num_warps"], entry["shared"]
    layout, n, di = [], 0, 0  # per argument: (kind, first word, TMA meta, rank); n: words so far
    for t in kinds:
        if t.startswith("tensordesc"):
            rank = t.count(",") + 1
            layout.append(("desc", n, metas[di], rank))
            di += 1
            n += 16 + 2 * rank
        else:
            layout.append(("f32" if t == "fp32" else "ptr" if t.startswith("*") else "int", n, None, 0))
            n += 1
    offsets = [w for kind, w, _, rank in layout for w in
               ([w] + [w + 16 + i for i in range(2 * rank)] if kind == "desc" else [w])]
    offsets += [n, n + 1]  # the scratch pointers
    n += 2
    words_t, params_t = ctypes.c_uint64 * n, ctypes.c_void_p * len(offsets)
    launch = _driver().cuLaunchKernel

    def run(grid, args, stream):
        words = words_t()
        for (kind, w, meta, rank), a in zip(layout, args):
            if kind == "ptr":
                words[w] = a.data_ptr()
            elif kind == "int":
                words[w] = a & 0xFFFFFFFFFFFFFFFF
            elif kind == "f32":
                words[w] = _float_bits(a)
            else:
                _encode(a, meta, words, w)
                for i, s in enumerate(a.shape):
                    words[w + 16 + i] = s
                for i, s in enumerate(a.strides):
                    words[w + 16 + rank + i] = s
        base = ctypes.addressof(words)
        params = params_t(*[base + 8 * o for o in offsets])
        gx = grid[0]
        gy = grid[1] if len(grid) > 1 else 1
        gz = grid[2] if len(grid) > 2 else 1
        if gx * gy * gz:
            _check(launch(function, gx, gy, gz, threads, 1, 1, shared, stream, params, None), "cuLaunchKernel")
    return run
