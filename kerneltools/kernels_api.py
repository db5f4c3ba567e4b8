"""The one place kerneltools and the tests use parts of ``kernels`` that are not its public API.

kernels' public API (``kernels.__all__``: get_kernel, get_local_kernel, LayerRepository, kernelize, Metadata, ...)
is used directly everywhere else. What it does not offer, and what this repository needs, is here, for every kernels
release in :data:`SUPPORTED` (the README's range; CI runs both ends): kernels 0.17 keeps these in ``kernels.variants``,
``kernels.backends``, ``kernels.cli`` and ``kernels.layer``, kernels 0.18+ in ``kernels._internals.*``; the lock and
build.toml types live in ``kernels._rust`` in both.

- the build variant grammar and the loader's choice among variants (the Hub card says which variant serves what;
  kernels' public ``get_kernel_variants`` asks a Hub, these work on names and folders);
- lock files (``KernelLocks``; ``KernelLock.commit`` is a ``str`` in 0.17, an ``Oid`` from 0.18: :func:`read_locks`
  returns strings);
- build.toml validation (``Build``, ``Backend``);
- the ``kernels`` command's entry point, run in-process by the tests;
- the registered kernel mapping of one key and device (tests only; kernelize's own lookup).

When kernels moves one of these, :func:`check` (and ``tests/tools/test_kernels_api.py``) names the missing piece
and the installed version, instead of an ``AttributeError`` deep inside a test.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

SUPPORTED = ">=0.17.2,<0.20"  # the kernels releases this module (and the README) cover


class KernelsApiError(ImportError):
    """The installed kernels lacks something this module expects (a kernels release outside :data:`SUPPORTED`)."""


def _module(*names: str):
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or not name.startswith(e.name):
                raise
    import kernels

    raise KernelsApiError(
        f"kernels {kernels.__version__} has none of the modules {', '.join(names)}, which kerneltools.kernels_api "
        f"reads (it supports kernels {SUPPORTED}). Install a kernels release in that range "
        "(pip install -r requirements.txt), or update kerneltools/kernels_api.py for this one.")


def _attr(module, name: str):
    try:
        return getattr(module, name)
    except AttributeError:
        import kernels

        raise KernelsApiError(
            f"kernels {kernels.__version__}: {module.__name__} has no {name}, which kerneltools.kernels_api reads (it "
            f"supports kernels {SUPPORTED}). Update kerneltools/kernels_api.py for this kernels release.") from None


def _variants():
    return _module("kernels._internals.variants", "kernels.variants")


def _backends():
    return _module("kernels._internals.backends", "kernels.backends")


# --- build variants -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """A build variant name as the kernels loader parses it."""

    name: str
    arch: bool  # a compiled variant (torchXY / stable ABI / tvm-ffi); False: noarch (torch-cuda, torch-cpu, ...)
    framework: str | None  # "Torch", "TorchStableAbi" or "TvmFfi" (arch variants)
    framework_version: str | None  # e.g. "2.10"
    cxx11_abi: bool | None
    backend: str  # arch: the backend class ("CUDA", "CPU", "ROCm", ...); noarch: its name ("cuda", "cpu", ...)
    backend_version: tuple[int, ...] | None  # e.g. (13, 0)
    platform: str | None
    os: str | None


def parse_variant(name: str) -> Variant:
    """Parse a variant folder name with the loader's own grammar; ValueError when the loader would skip it."""
    v = _attr(_variants(), "parse_variant")(name)
    if v.variant_str != name:
        raise ValueError(f"{name!r} parses as {v.variant_str!r}")
    if type(v).__name__ == "ArchVariant":
        fw = v.framework
        # kernels 0.17: v.arch = (backend, platform, os); 0.18+: v.backend, v.system = (platform, os)
        backend = v.arch.backend if hasattr(v, "arch") else v.backend
        system = v.arch if hasattr(v, "arch") else v.system
        bv = getattr(backend, "version", None)
        return Variant(name, True, type(fw).__name__, str(fw.version) if getattr(fw, "version", None) else None,
                       getattr(fw, "cxx11_abi", None), type(backend).__name__,
                       tuple(bv.release) if bv is not None else None, system.platform, system.os)
    backend = v.arch if hasattr(v, "arch") else v.backend
    return Variant(name, False, None, None, None, backend.backend_name, None, None, None)


@dataclass(frozen=True)
class Decision:
    name: str
    accepted: bool
    reason: str | None  # why the loader rejects it


def resolve_local(path: Path, backend: str | None = None) -> list[Decision]:
    """The loader's decision for every variant folder directly under ``path`` on this machine, preferred first."""
    vm = _variants()
    _, trace = _attr(vm, "resolve_variants")(_attr(vm, "get_variants_local")(Path(path)), backend)
    return [Decision(d.variant.variant_str, type(d).__name__ == "VariantAccepted", getattr(d, "reason", None))
            for d in trace]


def resolve_for_system(names: list[str], *, cuda: str | None, torch_version: str, cpu: str = "x86_64",
                       os: str = "linux", cxx11_abi: bool = True) -> list[str]:
    """The variants among ``names`` the loader accepts on the described system (CUDA ``cuda`` or CPU), preferred
    first."""
    from packaging.version import Version

    vm, bm = _variants(), _backends()
    backend = _attr(bm, "CUDA")(version=Version(cuda)) if cuda else _attr(bm, "CPU")()
    accepted, _ = _attr(vm, "_resolve_variant_for_system")(
        variants=[vm.parse_variant(n) for n in names], selected_backend=backend, cpu=cpu, os=os,
        torch_version=Version(torch_version), torch_cxx11_abi=cxx11_abi, tvm_ffi_version=None)
    return [v.variant_str for v in accepted]


# --- lock files, build.toml -----------------------------------------------------------------------------------------


def read_locks(text: str) -> list[tuple[object, str]]:
    """``[(KernelDependency, commit)]`` of a kernels.lock's JSON, parsed by kernels (ValueError when it refuses it);
    the commit as a string."""
    locks = _attr(_module("kernels._rust"), "KernelLocks").from_json(text)
    return [(dep, str(lock.commit)) for dep, lock in locks.items()]


def dependency_version(dep) -> int | None:
    """A KernelDependency's major version, or None when it names a revision (:func:`dependency_revision`)."""
    kv = _attr(_module("kernels._rust"), "KernelVersion")
    return dep.version.version if isinstance(dep.version, kv.Version) else None


def dependency_revision(dep) -> str | None:
    kv = _attr(_module("kernels._rust"), "KernelVersion")
    return dep.version.revision if isinstance(dep.version, kv.Revision) else None


def write_locks(entries: list[tuple[str, int, str]]) -> str:
    """A kernels.lock's JSON for ``[(repo_id, version, commit)]``, written by kernels' own types."""
    rust = _module("kernels._rust")
    dep, lock, kv = (_attr(rust, n) for n in ("KernelDependency", "KernelLock", "KernelVersion"))
    return _attr(rust, "KernelLocks")({dep(r, kv.Version(v)): lock(c) for r, v, c in entries}).to_json()


def open_build_toml(kernel_dir: Path):
    """build.toml parsed and validated with kernel-builder's rules (``kernels._rust.Build``; ValueError)."""
    return _attr(_module("kernels._rust"), "Build").open(Path(kernel_dir))


def build_backend(name: str):
    """``kernels._rust.Backend`` by name ("cuda", "cpu", ...)."""
    return _attr(_attr(_module("kernels._rust"), "Backend"), "from_str")(name)


# --- the command line, the mapping --------------------------------------------------------------------------------


def cli_main():
    """The ``kernels`` command's ``main()`` (reads sys.argv)."""
    return _attr(_module("kernels._internals.cli", "kernels.cli"), "main")


BENCHMARK_MODULES = ("kernels._internals.cli.benchmark", "kernels.cli.benchmark")  # kernels 0.18+, 0.17


def cli_benchmark_module():
    """The module of ``kernels benchmark`` (its runner: ``_get_hf_api``, ``discover_benchmark_classes``)."""
    return _module(*BENCHMARK_MODULES)


def cli_benchmark_source() -> Path:
    """The source file of ``kernels benchmark`` (found without importing the CLI package, whose 0.17 ``__init__``
    imports sigstore)."""
    import importlib.util

    for name in BENCHMARK_MODULES:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            continue
        if spec is not None and spec.origin:
            return Path(spec.origin)
    raise KernelsApiError(f"none of {', '.join(BENCHMARK_MODULES)} exists in this kernels: update "
                          "kerneltools/kernels_api.py")


def mapped_repos(key: str, device: str, capability: int | None = None) -> dict:
    """``{Mode: repository}`` that the registered kernel mapping holds for ``key`` on ``device`` (for cuda the entry
    covering ``capability``, e.g. 90, as kernelize would pick on such a GPU). Empty when there is none."""
    g = _module("kernels._internals.layer.globals", "kernels.layer.globals")
    entry = _attr(g, "_KERNEL_MAPPING").get().get(key, {}).get(device)
    if entry is None:
        return {}
    if device in ("cuda", "rocm"):
        return entry.repos_by_capability.find_smallest_interval(capability) or {}
    if hasattr(entry, "repos_for_device"):
        return entry.repos_for_device() or {}
    return entry.repos or {}


def check() -> list[str]:
    """Touch everything above; returns the kernels version. Raises KernelsApiError naming what is missing."""
    import kernels

    parse_variant("torch-cpu")
    parse_variant("torch-stable-abi210-cu130-x86_64-linux")
    for name in ("resolve_variants", "get_variants_local", "_resolve_variant_for_system"):
        _attr(_variants(), name)
    _attr(_backends(), "CUDA"), _attr(_backends(), "CPU")
    rust = _module("kernels._rust")
    for name in ("KernelLocks", "KernelLock", "KernelDependency", "KernelVersion", "Build", "Backend"):
        _attr(rust, name)
    cli_main(), cli_benchmark_source()
    _attr(_module("kernels._internals.layer.globals", "kernels.layer.globals"), "_KERNEL_MAPPING")
    return kernels.__version__
