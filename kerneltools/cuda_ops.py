"""Load the compiled variant's low-level ops (``geglu_fwd``/``geglu_bwd``) for the device scripts.

Goes through ``kernels.get_local_kernel`` when ``kernels`` is installed (as a user would), else imports the
variant folder the way the loader does (``<variant>/__init__.py`` under ``metadata.id``). Fails loudly when the
loader would pick anything but the compiled variant: a device script must never time or check Triton by mistake.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_dir(path: str | os.PathLike | None = None) -> Path:
    return Path(path or os.environ.get("GEGLU_BUILD_DIR") or REPO / "build").resolve()


def _import_variant(variant: Path):
    name = json.loads((variant / "metadata.json").read_text())["id"]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, variant / "__init__.py", submodule_search_locations=[str(variant)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_package(path: str | os.PathLike | None = None):
    """The package of the compiled variant in ``path`` (default $GEGLU_BUILD_DIR or build/), loaded as kernels'
    loader loads it; its ``configure(cuda_plan=...)`` forces launch plans."""
    import torch

    root = build_dir(path)
    if not root.is_dir():
        raise SystemExit(f"no build at {root}: run `python -m kerneltools build --variant cuda-compiled` first")
    try:
        import kernels
    except ImportError:
        variants = sorted(root.glob("torch-stable-abi*-cu*-linux"))
        if not variants:
            raise SystemExit(f"no compiled variant (torch-stable-abi*-cu*-linux) in {root}") from None
        print(f"(kernels is not installed: importing {variants[-1].name} directly)", file=sys.stderr)
        module = _import_variant(variants[-1])
    else:
        module = kernels.get_local_kernel(root, backend="cuda")
    if not getattr(importlib.import_module(module.__name__ + "._ops"), "HAS_CUDA_LIB", False):
        raise SystemExit(
            f"{root}: the loader chose {Path(module.__file__).parent.name}, not the compiled variant "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda})"
        )
    return module


def load_ops(path: str | os.PathLike | None = None):
    """``torch.ops.<OPS>`` of the compiled variant in ``path`` (default $GEGLU_BUILD_DIR or build/)."""
    return importlib.import_module(load_package(path).__name__ + "._ops").ops
