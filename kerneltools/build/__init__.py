"""Build the kernel-builder output tree (``build/<variant>/``) without Nix: ``kerneltools build``.

Variants (see docs/design.md):

* ``torch-cpu``   noarch, the Python package with the CPU implementation;
* ``torch-cuda``  noarch, Triton kernels only (any torch / CUDA that the compiled variant does not serve);
* ``torch-stable-abi210-cu<XY>-x86_64-linux``  the compiled CUDA library + the Python package.

Both CUDA variants carry the Triton kernels prebuilt for sm_80, 86, 89, 90, 100 and 120 (``_prebuilt_smXY.*``,
:mod:`.aot`; ``--aot-capability`` picks the architectures).

Each variant is a flat folder: the package's ``*.py`` files, a generated ``_ops.py`` and ``metadata.json``.
The modules: :mod:`.config` (build.toml, source and ops ids, metadata.json), :mod:`.noarch` (the two noarch
variants), :mod:`.cuda` (the compiled stable-ABI variant: nvcc, the torch binding, the ABI check) and :mod:`.aot`
(the prebuilt Triton kernels).
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import aot, cuda, noarch
from .config import BuildError, read_config, source_id

VARIANTS = ("cpu", "cuda", "cuda-compiled")

__all__ = ["build", "BuildError", "read_config", "source_id", "VARIANTS"]


def build(root: Path, out_root: Path | None = None, *, variants: list[str] | None = None,
          capability: str | None = None, aot_capability: str | None = None, log=print) -> list[Path]:
    """Build the requested variants (default: every one build.toml asks for) into ``out_root``."""
    root = Path(root).resolve()
    cfg = read_config(root)
    out_root = (Path(out_root) if out_root else root / "build").resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    sid = source_id(root)
    built = []
    for v in variants or VARIANTS:
        if v in ("cpu", "cuda"):
            if v not in cfg.backends:
                raise BuildError(f"build.toml's backends {list(cfg.backends)} do not include {v!r}.")
            built.append(noarch.build_noarch(cfg, out_root, v, sid, aot_archs=aot.parse_archs(aot_capability),
                                             log=log))
            log(f"built {built[-1].relative_to(out_root.parent) if out_root.parent in built[-1].parents else built[-1]}")
        elif v == "cuda-compiled":
            built.append(cuda.build_compiled(cfg, out_root, sid, capability=capability, log=log,
                                             aot_archs=aot.parse_archs(aot_capability)))
        else:
            raise BuildError(f"Unknown variant {v!r}: expected one of {', '.join(VARIANTS)}.")
    return built


def add_parser(sub) -> None:
    p = sub.add_parser("build", help="build the build/<variant>/ tree (like kernel-builder build-and-copy)")
    p.add_argument("--root", type=Path, default=Path("."), help="kernel repository root (has build.toml)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: <root>/build)")
    p.add_argument("--variant", action="append", choices=list(VARIANTS), help="variant(s) to build (default: all)")
    p.add_argument("--capability", default=None,
                   help="compile for this one CUDA capability (e.g. 9.0) instead of build.toml's list")
    p.add_argument("--aot-capability", default=None,
                   help="prebuild the Triton kernels of the CUDA variants for these CUDA capabilities (default "
                        f"{','.join(f'{a // 10}.{a % 10}' for a in aot.DEFAULT_ARCHS)}, assembled by CUDA 12.9's ptxas; "
                        "e.g. 9.0 while iterating; 'none': Triton's JIT compiles them on the user's machine)")
    p.set_defaults(_main=main)


def main(args) -> int:
    try:
        build(args.root, args.out, variants=args.variant, capability=args.capability,
              aot_capability=args.aot_capability)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
