"""The noarch variants ``torch-cpu`` (the CPU implementation) and ``torch-cuda`` (Triton kernels only, for any
torch / CUDA that the compiled variant does not serve): the package's files, ``_ops.py`` and ``metadata.json``;
``torch-cuda`` also carries the Triton kernels prebuilt for each architecture asked for (:mod:`.aot`, the same
files as the compiled variant's), so that its users compile nothing either."""

from __future__ import annotations

from pathlib import Path

from .aot import DEFAULT_ARCHS, build_aot
from .config import KernelConfig, SourceId, copy_python_files, fresh_dir, ops_id, ops_py, source_id, write_metadata

NOARCH_BACKENDS = {"cpu": "cpu", "cuda": "triton"}  # variant backend -> ops-id tag


def _capability_key(cap: str) -> tuple[int, ...]:
    return tuple(int(x) for x in cap.split("."))


def build_noarch(cfg: KernelConfig, out_root: Path, backend: str, sid: SourceId | None = None,
                 aot_archs: list[int] | None = None, log=print) -> Path:
    """Write ``out_root/torch-<backend>/`` (``cpu`` or ``cuda``) and return it; ``torch-cuda`` with the Triton
    kernels prebuilt for ``aot_archs`` (``aot.DEFAULT_ARCHS`` when None; [] for none)."""
    sid = sid or source_id(cfg.root)
    name = ops_id(cfg, NOARCH_BACKENDS[backend], sid)
    variant = out_root / f"torch-{backend}"
    fresh_dir(variant)
    copy_python_files(cfg, variant)
    (variant / "_ops.py").write_text(ops_py(name, load_library=False))
    if backend == "cuda":
        build_aot(cfg, variant, list(DEFAULT_ARCHS) if aot_archs is None else aot_archs, log)
    backend_meta: dict = {"type": backend}
    if backend == "cuda" and cfg.cuda_capabilities:
        backend_meta["archs"] = sorted(cfg.cuda_capabilities, key=_capability_key)
    write_metadata(variant, cfg, sid, name, backend_meta)
    return variant
