"""The transformers integration, shipped with the kernel: :func:`register_transformers` maps every supported
transformers class (``_transformer_classes``) to this kernel's layers for ``kernels.kernelize``;
:func:`transformers_kernel_config` gives transformers' own ``KernelConfig`` route (GPU models)::

    geglu = kernels.get_kernel("geglu-kernels/geglu", version=1)
    geglu.register_transformers()                   # cuda and cpu; register before building a MoE model
    kernels.kernelize(model, mode=Mode.INFERENCE)   # or Mode.TRAINING, optionally | Mode.TORCH_COMPILE

Each class gets the key ``"geglu.<Layer>"`` (transformers' default mapping owns ``"GeGLUMLP"`` and would replace
ours under it) and a condition that leaves a module with a non-GELU activation, or a forward something else
replaced, alone; MoE experts keep transformers' experts dispatch, their ``_apply_gate`` routed through a gate
layer. Imports torch and ``_activations`` when loaded, ``kernels`` and ``transformers`` only when a function runs;
kernels 0.17.2-0.19.x, transformers 5.22.2-5.25.x. docs/transformers.md describes the mapping in full.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from . import _activations as _ACTIVATIONS
from ._transformer_classes import (GEGLU_CLASSES, KEY_PREFIX, NORM_CLASSES, NOT_SUPPORTED,  # noqa: F401
                                  ROPE_CLASSES, SUPPORTED, SUPPORTED_APPROX, HostClass, classes_markdown)

# rope types whose inv_freq the host's forward changes as it runs (transformers' dynamic_rope_update): those
# modules keep their own forward
_DYNAMIC_ROPE = frozenset({"dynamic", "longrope"})


def _rope_condition(module) -> bool:
    """A rotary embedding the layer computes: static rope types only (dynamic and longrope tables change with the
    positions, inside the host's forward), and a forward nobody else has replaced."""
    rope_type = getattr(module, "rope_type", None)
    types_ = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return all(isinstance(t, str) and t not in _DYNAMIC_ROPE for t in types_) and not _forward_taken(module)


# the hub layers' class names: a forward that kernelize put there (any mode) is ours to replace again
_OUR_LAYERS = frozenset({h.layer for h in GEGLU_CLASSES + NORM_CLASSES + ROPE_CLASSES if h.layer}
                        | {h.gate_layer for h in GEGLU_CLASSES if h.gate_layer})


def _forward_taken(module) -> bool:
    """Whether something other than kernelize replaced this module's forward (transformers' tensor parallelism and
    accelerate wrap ``module.forward`` to move activations or reduce gradients): kernelize must not overwrite it."""
    fwd = module.__dict__.get("forward")
    if fwd is None:
        return False
    qualname = getattr(getattr(fwd, "__func__", None), "__qualname__", "")
    return qualname.rpartition(".")[0] not in _OUR_LAYERS


def _norm_eps(module):
    """The norm's epsilon: ``eps``, or ``variance_epsilon`` (Gemma3nRMSNorm's family from transformers 5.25)."""
    eps = getattr(module, "eps", None)
    return getattr(module, "variance_epsilon", None) if eps is None else eps


def _norm_condition(module) -> bool:
    """A norm the layer computes: a 1-D weight, a float eps and no grouping (Qwen4ExpTextRMSNorm's group_size), whose
    forward nobody else has replaced."""
    import torch

    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 1 and isinstance(_norm_eps(module), float)
            and getattr(module, "group_size", None) is None and not _forward_taken(module))


def _scaled_norm_condition(module) -> bool:
    """A Gemma 3n-form norm the layer computes: a float eps and either a 1-D weight (with_scale) or none."""
    import torch

    with_scale = getattr(module, "with_scale", None)
    weight = getattr(module, "weight", None)
    scale_ok = (isinstance(weight, torch.Tensor) and weight.dim() == 1) if with_scale else with_scale is False
    return scale_ok and isinstance(_norm_eps(module), float) and not _forward_taken(module)


def is_kernel_gelu(act: Any) -> bool:
    """Whether ``act`` (a host's activation) computes a GELU the kernel computes (erf or tanh form)."""
    return _ACTIVATIONS.gelu_approximation(act) is not None


def _gelu_condition(act_attr: str):
    def condition(module) -> bool:
        return is_kernel_gelu(getattr(module, act_attr, None)) and not _forward_taken(module)

    condition.__qualname__ = f"geglu_condition[{act_attr}]"
    return condition


def experts_gate(act_fn, gate_up):
    """The gate of transformers' experts classes as transformers computes it (its default ``_apply_gate``):
    ``act_fn(gate) * up`` of ``gate, up = gate_up.chunk(2, -1)``. Registered experts classes call it through their
    :class:`ExpertsGate` layer, whose forward kernelize replaces with the hub layer ``GeGLUExpertsGate``;
    unkernelized, it runs these ops."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act_fn(gate) * up


class ExpertsGate(torch.nn.Module):
    """:func:`experts_gate` as a layer, one per experts module: what ``kernels.use_kernel_forward_from_hub`` makes
    of a function (an ``nn.Module`` whose forward calls it), as a named class so that models still pickle (kernels'
    own wrapper is a local class). :func:`register_transformers` gives it the key ``geglu.GeGLUExpertsGate``."""

    def forward(self, act_fn, gate_up):
        return experts_gate(act_fn, gate_up)


def _apply_gate_through(key: str):
    def _apply_gate(self, gate_up):
        funcs = getattr(self, "_kernel_funcs", None)
        gate = funcs.get(key) if funcs is not None else None
        if gate is None:  # a module built before register_transformers: it has no gate layer, and kernelize skips it
            return experts_gate(self.act_fn, gate_up)
        return gate(self.act_fn, gate_up)

    _apply_gate.__qualname__ = f"geglu_apply_gate[{key}]"
    return _apply_gate


def _attach_experts_gate(cls: type, key: str) -> None:
    """Route ``cls._apply_gate`` (transformers' grouped_mm / batched_mm experts call it between the two grouped
    GEMMs) through an :class:`ExpertsGate` layer under ``key``, one per experts module.

    kernels' ``use_kernelized_func`` would attach a single function-layer instance to every module of the class,
    so kernelize of one model would switch the gate of every model in the process (and a deep copy would get its
    own unswapped instance). Here each module gets its own gate layer at construction, in ``_kernel_funcs`` (where
    ``use_kernelized_func`` puts function layers and kernelize looks for them): kernelize swaps the gates of the
    model it is given, as it does for the class layers. Modules built before this call have none and keep
    transformers' gate. Idempotent."""
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


@dataclass
class GeGLURegistration:
    """What :func:`register_transformers` did."""

    mapping: dict  # {key: {device: {Mode: repository}}}, for kernels.use_kernel_mapping / register_kernel_mapping
    classes: dict[str, type] = field(default_factory=dict)  # "module.Class" -> class now carrying a key
    skipped: list[str] = field(default_factory=list)  # supported classes the installed transformers lacks


def _own_dir() -> Path:
    """This loaded variant's folder, as the loader saw it (not resolved: in the Hub cache its files are symlinks
    into the blob store)."""
    return Path(os.path.abspath(os.path.dirname(__file__)))


def _repository_factory(repo_id, *, version, revision, lockfile, trust_remote_code):
    from kernels import LayerRepository, LocalLayerRepository, LockedLayerRepository

    if repo_id is None:
        if version is not None or revision is not None or lockfile is not None:
            raise ValueError("register_transformers: version=, revision= and lockfile= name a Hub repository: pass "
                             "repo_id= with them, or none of them to map this loaded kernel.")
        own = _own_dir()
        return lambda layer: LocalLayerRepository(own, layer_name=layer)
    if lockfile is not None:
        return lambda layer: LockedLayerRepository(repo_id, lockfile=Path(lockfile), layer_name=layer,
                                                   trust_remote_code=trust_remote_code)
    if revision is not None:
        return lambda layer: LayerRepository(repo_id, layer_name=layer, revision=revision,
                                             trust_remote_code=trust_remote_code)
    if version is None:
        raise ValueError(f"register_transformers: repo_id={repo_id!r} needs version=N, revision=... or lockfile=....")
    return lambda layer: LayerRepository(repo_id, layer_name=layer, version=version,
                                         trust_remote_code=trust_remote_code)


def register_transformers(*, devices: Sequence[str] = ("cuda", "cpu"), register: bool = True, norms: bool = True,
                          rope: bool = True, repo_id: str | None = None, version: int | None = None,
                          revision: str | None = None, lockfile: str | Path | None = None,
                          trust_remote_code: bool | list[str] = False) -> GeGLURegistration:
    """Make ``kernels.kernelize`` replace the forward of every supported transformers class (GeGLU MLPs, MoE
    experts, Gemma RMSNorms, Gemma rotary embeddings) with this kernel's layers.

    Args:
        devices: device types to map; on ``"cpu"`` the kernel runs its CPU implementation (eager's numerics, no
            speed-up; useful for tests and CPU-only CI).
        register: register the mapping globally (``kernels.register_kernel_mapping``, merged into the current
            one). With False it is only returned, for ``with kernels.use_kernel_mapping(reg.mapping): ...``.
        norms: also map the Gemma RMSNorm classes of :data:`NORM_CLASSES` (the default). On CUDA the fused norm is
            within one ulp of eager's output, not bit-exact; ``norms=False`` keeps the hosts' own norms.
        rope: also map the Gemma rotary embeddings of :data:`ROPE_CLASSES` (the default): the host's forward in
            eager mode; under torch.compile one op computes the positions' cos and sin.
        repo_id: map a Hub repository's layers instead of this loaded kernel's, at ``version=N``, ``revision=``
            or the commit a ``lockfile=`` (``kernels lock``) pins; ``trust_remote_code`` is passed to them.

    Every mode is mapped: Mode.INFERENCE, Mode.TRAINING, Mode.INFERENCE | Mode.TORCH_COMPILE and
    Mode.TRAINING | Mode.TORCH_COMPILE. Calling this again re-registers: each key's entry for a device is replaced.

    Returns:
        A :class:`GeGLURegistration` with the mapping, the classes that now carry a key, and the supported classes
        the installed transformers does not have.
    """
    from kernels import Mode, register_kernel_mapping, replace_kernel_forward_from_hub

    _own_origin()  # before kernelize loads this folder again as a local kernel (which records no origin)
    repository = _repository_factory(repo_id, version=version, revision=revision, lockfile=lockfile,
                                     trust_remote_code=trust_remote_code)
    modes = (Mode.INFERENCE, Mode.TRAINING, Mode.INFERENCE | Mode.TORCH_COMPILE, Mode.TRAINING | Mode.TORCH_COMPILE)
    reg = GeGLURegistration(mapping={})
    repos: dict[str, Any] = {}  # one repository per layer: kernels loads and validates each once

    def map_key(key: str, layer: str) -> None:
        if layer not in repos:
            repos[layer] = repository(layer)
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
        if host.gate_layer is not None:  # MoE experts: the gate between their grouped GEMMs, a layer per module
            _attach_experts_gate(cls, host.gate_key)
            map_key(host.gate_key, host.gate_layer)
    if register:
        register_kernel_mapping(reg.mapping)
        # kernelize warns "No kernel mapping found for layer X" for every module of a hub layer name that has no
        # entry at all (transformers marks rotary_pos_emb, GeluTanh, RMSNorm, ...). An entry with no device keeps
        # their own forward silently; an entry already registered (transformers' own mapping) is left as it is.
        register_kernel_mapping({name: {} for name in _transformers_layer_names()})
    return reg


def _transformers_layer_names() -> list[str]:
    """The hub layer names of transformers' default kernel mapping (none when transformers lacks it)."""
    try:
        from transformers.integrations.hub_kernels import get_kernel_mapping_transformers
    except ImportError:
        return []
    return sorted(get_kernel_mapping_transformers())


_ORIGIN: list = []  # (repo_id, commit) once found: a later local load of the same folder records no origin


def _own_origin():
    """(repo_id, commit) of the Hub repository this kernel was loaded from (``kernels.get_loaded_kernels``), or None
    (loaded from a folder)."""
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
    """A transformers ``KernelConfig`` that maps the supported classes found in ``model`` to this kernel, for
    transformers' own route::

        model.set_use_kernels(True, geglu.transformers_kernel_config(model))   # a loaded model: scanned
        model = AutoModelForCausalLM.from_pretrained(path, use_kernels=True, device_map="cuda",
                                                     kernel_config=geglu.transformers_kernel_config(GemmaForCausalLM))

    ``model`` is a model instance or a transformers model class (KernelConfig accepts only keys present in the
    model). The layers come from the Hub repository and commit this kernel was loaded from (a kernel loaded from a
    folder: that folder, ``use_local_kernel=True``), or from ``repo_id`` at ``version``/``revision``. The classes get
    their keys first (:func:`register_transformers` with ``register=False``). transformers accepts KernelConfig for
    accelerator models only (``ValueError: Only devices in [...] are supported`` on CPU): there, use
    :func:`register_transformers` and ``kernels.kernelize``. ``inherit_mapping=True`` keeps transformers' own
    default mapping too (its kernels-community repositories must then be reachable).
    """
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
