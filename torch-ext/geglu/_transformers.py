"""transformers integration: :func:`register_transformers` maps the supported classes (``_transformer_classes``) to
this kernel's layers for ``kernels.kernelize`` under keys ``"geglu.<Layer>"``, skipping modules with a non-GELU
activation or a forward replaced by something else; :func:`transformers_kernel_config` builds a ``KernelConfig``.
``kernels`` (0.17.2-0.19.x) and ``transformers`` (5.22.2-5.25.x) are imported only when a function runs."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from . import _activations as _ACTIVATIONS
from ._transformer_classes import (GEGLU_CLASSES, KEY_PREFIX, NORM_CLASSES, NOT_SUPPORTED,  # noqa: F401
                                  ROPE_CLASSES, SUPPORTED, SUPPORTED_APPROX, HostClass)

# rope types whose inv_freq the host's forward updates
_DYNAMIC_ROPE = frozenset({"dynamic", "longrope"})


def _rope_condition(module) -> bool:
    """Static rope types only (no dynamic or longrope) and a forward nobody else has replaced."""
    rope_type = getattr(module, "rope_type", None)
    types_ = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return all(isinstance(t, str) and t not in _DYNAMIC_ROPE for t in types_) and not _forward_taken(module)


# a forward from one of these layers is kernelize's, and may be replaced again
_OUR_LAYERS = frozenset({h.layer for h in GEGLU_CLASSES + NORM_CLASSES + ROPE_CLASSES if h.layer}
                        | {h.gate_layer for h in GEGLU_CLASSES if h.gate_layer})


def _forward_taken(module) -> bool:
    """Whether something other than our layers replaced ``module.forward`` (e.g. tensor parallelism, accelerate)."""
    fwd = module.__dict__.get("forward")
    if fwd is None:
        return False
    qualname = getattr(getattr(fwd, "__func__", None), "__qualname__", "")
    return qualname.rpartition(".")[0] not in _OUR_LAYERS


def _norm_eps(module):
    """``eps``, else ``variance_epsilon``."""
    eps = getattr(module, "eps", None)
    return getattr(module, "variance_epsilon", None) if eps is None else eps


def _norm_condition(module) -> bool:
    """A 1-D weight, a float eps, no ``group_size`` and a forward nobody else has replaced."""
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 1 and isinstance(_norm_eps(module), float)
            and getattr(module, "group_size", None) is None and not _forward_taken(module))


def _scaled_norm_condition(module) -> bool:
    """A float eps; a 1-D weight if ``with_scale``, else ``with_scale is False``; a forward nobody else replaced."""
    with_scale = getattr(module, "with_scale", None)
    weight = getattr(module, "weight", None)
    scale_ok = (isinstance(weight, torch.Tensor) and weight.dim() == 1) if with_scale else with_scale is False
    return scale_ok and isinstance(_norm_eps(module), float) and not _forward_taken(module)


def is_kernel_gelu(act: Any) -> bool:
    """Whether ``act`` (a host's activation) is a GELU the kernel computes (erf or tanh form)."""
    return _ACTIVATIONS.gelu_approximation(act) is not None


def _gelu_condition(act_attr: str):
    def condition(module) -> bool:
        return is_kernel_gelu(getattr(module, act_attr, None)) and not _forward_taken(module)

    condition.__qualname__ = f"geglu_condition[{act_attr}]"
    return condition


def experts_gate(act_fn, gate_up):
    """transformers' default experts ``_apply_gate``: ``act_fn(gate) * up`` of ``gate, up = gate_up.chunk(2, -1)``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act_fn(gate) * up


class ExpertsGate(torch.nn.Module):
    """:func:`experts_gate` as a picklable layer, one per experts module; kernelize swaps in ``GeGLUExpertsGate``."""

    def forward(self, act_fn, gate_up):
        return experts_gate(act_fn, gate_up)


def _apply_gate_through(key: str):
    def _apply_gate(self, gate_up):  # a module built before register_transformers has no gate layer
        return (getattr(self, "_kernel_funcs", None) or {}).get(key, experts_gate)(self.act_fn, gate_up)

    _apply_gate.__qualname__ = f"geglu_apply_gate[{key}]"
    return _apply_gate


def _attach_experts_gate(cls: type, key: str) -> None:
    """Route ``cls._apply_gate`` through an :class:`ExpertsGate` under ``key``, created per module at construction
    in ``_kernel_funcs`` (so kernelize swaps only the given model's gates). Modules built earlier keep transformers'
    gate. Idempotent; raises TypeError if ``cls._apply_gate`` is not transformers' default."""
    import functools

    from kernels import replace_kernel_forward_from_hub
    replace_kernel_forward_from_hub(ExpertsGate, key)
    if getattr(cls.__init__, "_geglu_gate", None) == key:
        return
    moe = importlib.import_module("transformers.integrations.moe")
    if getattr(cls, "_apply_gate", None) is not getattr(moe, "_default_apply_gate", None):
        raise TypeError(f"register_transformers: {cls.__module__}.{cls.__name__}._apply_gate is not transformers' "
                        "default gate (chunk, act_fn(gate) * up), so the GeGLU gate layer cannot stand in for it. "
                        "Remove the class from GEGLU_CLASSES or give it a layer that computes its gate.")
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.__dict__.setdefault("_kernel_funcs", {})[key] = ExpertsGate()

    __init__._geglu_gate = key
    cls.__init__ = __init__
    cls._apply_gate = _apply_gate_through(key)


# The layers mapped under TORCH_COMPILE, by kind of step: those whose compiled graph is not the host's. GeGLUMLP
# (and the self-conditioning block built on it) calls the fused MLP op in inference from its traced rule's size on;
# the rotary layers call the cos/sin op from ROPE_OP_MIN_ROWS positions. Every other layer traces the host's math
# there (and GeGLUMLP does in compiled training), so its host module keeps its own forward.
COMPILE_LAYERS = {
    "inference": frozenset({"GeGLUMLP", "GeGLUSelfConditioning", "RotaryEmbedding", "LayerTypeRotaryEmbedding"}),
    "training": frozenset({"RotaryEmbedding", "LayerTypeRotaryEmbedding"}),
}


@dataclass
class GeGLURegistration:
    """What :func:`register_transformers` did."""

    mapping: dict  # {key: {device: {Mode: repository}}}
    classes: dict[str, type] = field(default_factory=dict)  # "module.Class" -> class now carrying a key
    skipped: list[str] = field(default_factory=list)  # supported classes the installed transformers lacks


def _own_dir() -> Path:
    """This loaded variant's folder, unresolved (Hub cache files are symlinks)."""
    return Path(os.path.abspath(os.path.dirname(__file__)))


def _repository_factory(repo_id, *, version, revision, lockfile, trust_remote_code):
    from kernels import LayerRepository, LocalLayerRepository, LockedLayerRepository
    if repo_id is None:
        if version is not None or revision is not None or lockfile is not None:
            raise ValueError("register_transformers: version=, revision= and lockfile= name a Hub repository: pass "
                             "repo_id= with them, or none of them to map this loaded kernel.")
        own = _own_dir()
        return lambda layer: LocalLayerRepository(own, layer_name=layer)
    given = [name for name, v in (("version", version), ("revision", revision), ("lockfile", lockfile)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"register_transformers: {' and '.join(given)} each pin repo_id's code; pass one of them.")
    if lockfile is not None:
        return lambda layer: LockedLayerRepository(repo_id, lockfile=Path(lockfile), layer_name=layer,
                                                   trust_remote_code=trust_remote_code)
    if not given:
        raise ValueError(f"register_transformers: repo_id={repo_id!r} needs version=N, revision=... or lockfile=....")
    pin = dict(revision=revision) if revision is not None else dict(version=version)
    return lambda layer: LayerRepository(repo_id, layer_name=layer, trust_remote_code=trust_remote_code, **pin)


def register_transformers(*, devices: Sequence[str] = ("cuda", "cpu"), register: bool = True, norms: bool = True,
                          rope: bool = True, repo_id: str | None = None, version: int | None = None,
                          revision: str | None = None, lockfile: str | Path | None = None,
                          trust_remote_code: bool | list[str] = False) -> GeGLURegistration:
    """Make ``kernels.kernelize`` replace the forward of every supported class with this kernel's layers for
    ``Mode.INFERENCE`` and ``Mode.TRAINING``; calling again replaces each key's entries. With ``TORCH_COMPILE`` only
    the layers whose compiled graph differs from the host's are mapped (:data:`COMPILE_LAYERS`): every other module
    keeps its own forward, which traces to the same graph, so kernelize binds nothing Dynamo must guard (and
    ``kernelize(..., use_fallback=False)`` raises for those keys in a compile mode).

    ``devices``: device types to map. ``register``: merge into kernels' global mapping (False: only return it).
    ``norms`` / ``rope``: also map :data:`NORM_CLASSES` / :data:`ROPE_CLASSES`. ``repo_id``: map a Hub repository's
    layers at ``lockfile=``'s commit, ``revision=`` or ``version=N`` (one is required) instead of this loaded
    kernel's (then none may be given: ValueError); ``trust_remote_code`` is passed on.
    """
    from kernels import Mode, register_kernel_mapping, replace_kernel_forward_from_hub
    _own_origin()  # record it before kernelize reloads this folder as a local kernel
    repository = _repository_factory(repo_id, version=version, revision=revision, lockfile=lockfile,
                                     trust_remote_code=trust_remote_code)
    compiled = {Mode.INFERENCE | Mode.TORCH_COMPILE: "inference", Mode.TRAINING | Mode.TORCH_COMPILE: "training"}
    reg = GeGLURegistration(mapping={})
    repos: dict[str, Any] = {}  # one repository per layer

    def map_key(key: str, layer: str) -> None:
        if layer not in repos:
            repos[layer] = repository(layer)
        modes = [Mode.INFERENCE, Mode.TRAINING] + [m for m, part in compiled.items() if layer in COMPILE_LAYERS[part]]
        reg.mapping[key] = {device: {mode: repos[layer] for mode in modes} for device in devices}

    hosts = [(h, _gelu_condition(h.act_attr) if h.act_attr else None) for h in GEGLU_CLASSES]
    hosts += [(h, _scaled_norm_condition if h.layer == "Gemma3nRMSNorm" else _norm_condition)
              for h in NORM_CLASSES] if norms else []
    hosts += [(h, _rope_condition) for h in ROPE_CLASSES] if rope else []
    for host, condition in hosts:
        if host.layer is None:
            continue
        cls = host.load()
        if cls is None:
            reg.skipped.append(f"{host.module}.{host.name}")
            continue
        replace_kernel_forward_from_hub(cls, host.key, condition)
        reg.classes[f"{host.module}.{host.name}"] = cls
        map_key(host.key, host.layer)
        if host.gate_layer is not None:  # MoE experts
            _attach_experts_gate(cls, host.gate_key)
            map_key(host.gate_key, host.gate_layer)
    if register:
        register_kernel_mapping(reg.mapping)
        # empty entries silence "No kernel mapping found" for transformers' layer names; existing entries stay
        register_kernel_mapping({name: {} for name in _transformers_layer_names()})
    return reg


def _transformers_layer_names() -> list[str]:
    """The hub layer names of transformers' default kernel mapping (none when transformers lacks it)."""
    try:
        from transformers.integrations.hub_kernels import get_kernel_mapping_transformers
    except ImportError:
        return []
    return sorted(get_kernel_mapping_transformers())


_ORIGIN: list = []  # (repo_id, commit), cached: a later local load of this folder records none


def _own_origin():
    """(repo_id, commit) this kernel was loaded from (``kernels.get_loaded_kernels``), or None (a folder)."""
    if not _ORIGIN:
        import kernels
        here = __name__.rpartition(".")[0]
        for loaded in kernels.get_loaded_kernels():
            if loaded.module.__name__ == here and loaded.repo_info is not None:
                _ORIGIN.append((loaded.repo_info.repo_id, str(loaded.repo_info.revision)))
                break
    return _ORIGIN[0] if _ORIGIN else None


def transformers_kernel_config(model: Any, *, repo_id: str | None = None, version: int | None = None,
                               revision: str | None = None, trust_remote_code: bool = False,
                               inherit_mapping: bool = False):
    """A ``KernelConfig`` (accelerators only) mapping the GeGLU classes and MoE gates of ``model`` (an instance, or
    a model class: its module's classes) to the repository and commit this kernel was loaded from (a folder:
    ``use_local_kernel=True``), or to ``repo_id`` at ``revision``, else ``version`` (default 1). Calls
    :func:`register_transformers` with ``register=False``. Raises ValueError when no class is found or
    ``version``/``revision`` come without ``repo_id``."""
    from transformers import KernelConfig
    register_transformers(register=False)
    layer_of = {h.key: h.layer for h in GEGLU_CLASSES if h.layer}
    layer_of.update({h.gate_key: h.gate_layer for h in GEGLU_CLASSES if h.gate_layer})  # MoE experts' gate
    if isinstance(model, type):
        keys = {k for h in GEGLU_CLASSES if h.layer and h.module == model.__module__ for k in (h.key, h.gate_key) if k}
    else:
        keys = {getattr(type(m), "kernel_layer_name", None) for m in model.modules()}
        keys |= {k for m in model.modules() for k in (getattr(m, "_kernel_funcs", None) or {})}  # function layers
        keys &= set(layer_of)
    if not keys:
        where = model.__module__ if isinstance(model, type) else type(model).__name__
        raise ValueError(f"transformers_kernel_config: no supported GeGLU class in {where}. For a composite model "
                         "(e.g. PaliGemma) pass the loaded model instead of its class; GEGLU_CLASSES lists them.")
    if repo_id is None and (version is not None or revision is not None):
        raise ValueError("transformers_kernel_config: version= and revision= need repo_id=.")
    if version is not None and revision is not None:
        raise ValueError("transformers_kernel_config: version= and revision= each pin repo_id's code; pass one.")
    if repo_id is None:
        origin = _own_origin()
        if origin is None:
            return KernelConfig({key: f"{_own_dir()}:{layer_of[key]}" for key in sorted(keys)},
                                use_local_kernel=True, inherit_mapping=inherit_mapping)
        repo_id, revision = origin
    meta = {"version": version if version is not None else 1} if revision is None else {"revision": revision}
    meta["trust_remote_code"] = trust_remote_code
    return KernelConfig({key: (f"{repo_id}:{layer_of[key]}", dict(meta)) for key in sorted(keys)},
                        inherit_mapping=inherit_mapping)
