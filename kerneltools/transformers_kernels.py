"""The kernel's transformers integration (``torch-ext/geglu/_transformers.py``) for the tooling, the benchmarks and
the tests, with Hub repositories as the layers' source.

Users do not need this module: the kernel ships the integration, so after
``geglu = kernels.get_kernel("geglu-kernels/geglu", version=1)`` the call ``geglu.register_transformers()`` maps
every supported class (docs/transformers.md). Here the same code is loaded from this checkout's sources, without
building or loading the kernel, and :func:`register_geglu_kernels` maps the classes to
``LayerRepository(repo_id, version=N)`` (or ``revision=``, or ``LockedLayerRepository(lockfile=)``): kernelize
then downloads the kernel when it first needs a layer, as the tests of the published repository want::

    from kernels import Mode, kernelize
    from kerneltools.transformers_kernels import register_geglu_kernels

    register_geglu_kernels()                    # geglu-kernels/geglu, version 1, cuda and cpu, every mode
    kernelize(model, mode=Mode.INFERENCE)

Everything the kernel's module defines (:data:`GEGLU_CLASSES`, :data:`NORM_CLASSES`, :data:`ROPE_CLASSES`,
:func:`classes_markdown`, :class:`ExpertsGate`, ...) is re-exported.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any, Sequence

from .build.config import hub_repo_id

DEFAULT_REPO_ID = hub_repo_id()  # build.toml's [general.hub] repo-id
_PACKAGE = "kerneltools._geglu_sources"


def _load_kernel_module(name: str):
    """``torch-ext/geglu/<name>.py`` as ``kerneltools._geglu_sources.<name>``: a package object whose path is the
    kernel's source folder, so that the module's relative imports (``_activations``) resolve there, without running
    the kernel package's ``__init__`` (which needs a build's generated ``_ops.py``)."""
    src = Path(__file__).resolve().parents[1] / "torch-ext" / "geglu"
    if not (src / f"{name}.py").is_file():
        raise ImportError(f"kerneltools.transformers_kernels needs the kernel's sources beside it ({src / name}.py "
                          "is missing): install kerneltools from a checkout of the repository (pip install -e .). "
                          "Without a checkout use the kernel's own geglu.register_transformers().")
    if _PACKAGE not in sys.modules:
        pkg = types.ModuleType(_PACKAGE)
        pkg.__path__ = [str(src)]
        sys.modules[_PACKAGE] = pkg
    full = f"{_PACKAGE}.{name}"
    if full not in sys.modules:
        spec = importlib.util.spec_from_file_location(full, src / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
    return sys.modules[full]


_src = _load_kernel_module("_transformers")

KEY_PREFIX = _src.KEY_PREFIX
SUPPORTED, SUPPORTED_APPROX, NOT_SUPPORTED = _src.SUPPORTED, _src.SUPPORTED_APPROX, _src.NOT_SUPPORTED
HostClass = _src.HostClass
GeGLURegistration = _src.GeGLURegistration
GEGLU_CLASSES, NORM_CLASSES, ROPE_CLASSES = _src.GEGLU_CLASSES, _src.NORM_CLASSES, _src.ROPE_CLASSES
COMPILE_LAYERS = _src.COMPILE_LAYERS
ExpertsGate, experts_gate = _src.ExpertsGate, _src.experts_gate
ExpertsGate.__module__ = __name__  # models pickle it as kerneltools.transformers_kernels.ExpertsGate
is_kernel_gelu, classes_markdown = _src.is_kernel_gelu, _src.classes_markdown
_forward_taken, _attach_experts_gate = _src._forward_taken, _src._attach_experts_gate


def register_geglu_kernels(repo_id: str = DEFAULT_REPO_ID, *, version: int | None = 1, revision: str | None = None,
                           lockfile: str | Path | None = None, trust_remote_code: bool = False,
                           devices: Sequence[str] = ("cuda", "cpu"), register: bool = True,
                           norms: bool = True, rope: bool = True) -> GeGLURegistration:
    """The kernel's ``register_transformers`` with the layers of the Hub repository ``repo_id`` at ``version``
    (the default, 1), ``revision`` or the commit ``lockfile`` pins: kernelize downloads the kernel when it first
    needs a layer. See ``register_transformers`` for ``devices``, ``register``, ``norms`` and ``rope``."""
    if lockfile is None and revision is None and version is None:
        raise ValueError("register_geglu_kernels: pass version=N, revision=... or lockfile=... .")
    if lockfile is not None or revision is not None:
        version = None
    return _src.register_transformers(devices=devices, register=register, norms=norms, rope=rope, repo_id=repo_id,
                                      version=version, revision=revision, lockfile=lockfile,
                                      trust_remote_code=trust_remote_code)


def geglu_kernel_config(model: Any, repo_id: str = DEFAULT_REPO_ID, *, version: int | None = 1,
                        revision: str | None = None, trust_remote_code: bool = False, inherit_mapping: bool = False):
    """The kernel's ``transformers_kernel_config`` for the Hub repository ``repo_id`` at ``version`` or
    ``revision``: a transformers ``KernelConfig`` with the keys of the supported classes in ``model`` (an instance or
    a model class). GPU models only: transformers refuses KernelConfig on CPU."""
    return _src.transformers_kernel_config(model, repo_id=repo_id, version=None if revision else version,
                                           revision=revision, trust_remote_code=trust_remote_code,
                                           inherit_mapping=inherit_mapping)


__all__ = ["register_geglu_kernels", "geglu_kernel_config", "GEGLU_CLASSES", "NORM_CLASSES", "ROPE_CLASSES",
           "HostClass", "GeGLURegistration", "is_kernel_gelu", "classes_markdown", "experts_gate", "ExpertsGate",
           "DEFAULT_REPO_ID", "KEY_PREFIX", "COMPILE_LAYERS"]
