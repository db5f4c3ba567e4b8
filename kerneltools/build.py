"""Build the kernel-builder output tree (``build/<variant>/``) without Nix.

Variants (see docs/design.md):

* ``torch-cpu``   noarch, the Python package with the CPU implementation;
* ``torch-cuda``  noarch, Triton kernels only (any torch / CUDA that the compiled variant does not serve);
* ``torch-stable-abi210-cu<XY>-x86_64-linux``  the compiled CUDA library + the Python package
  (see ``kerneltools.cuda_build``).

Each variant is a flat folder: the package's ``*.py`` files, a generated ``_ops.py`` and ``metadata.json``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

BUILDER_NAME = "kerneltools"
BUILDER_VERSION = "0.1.0"

NOARCH_BACKENDS = {"cpu": "cpu", "cuda": "triton"}  # variant backend -> ops-id tag


class BuildError(RuntimeError):
    """A build cannot proceed; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class KernelConfig:
    """The parts of build.toml the builder uses."""

    root: Path
    name: str
    version: int
    license: str
    backends: tuple[str, ...]
    cuda_capabilities: tuple[str, ...]
    cuda_sources: tuple[str, ...]
    torch_sources: tuple[str, ...]
    stable_abi_cuda: str | None
    repo_id: str | None

    @property
    def python_name(self) -> str:
        return self.name.replace("-", "_")

    @property
    def package_dir(self) -> Path:
        return self.root / "torch-ext" / self.python_name


def read_config(root: Path) -> KernelConfig:
    path = root / "build.toml"
    if not path.is_file():
        raise BuildError(f"No build.toml in {root}: run the builder from the kernel repository root (or pass --root).")
    with path.open("rb") as f:
        data = tomllib.load(f)
    general = data.get("general", {})
    torch_cfg = data.get("torch", {})
    cuda_caps: list[str] = []
    cuda_src: list[str] = []
    for kname, kernel in data.get("kernel", {}).items():
        if kernel.get("backend") == "cuda":
            cuda_caps.extend(kernel.get("cuda-capabilities", []))
            cuda_src.extend(kernel.get("src", []))
    try:
        return KernelConfig(
            root=root,
            name=general["name"],
            version=int(general["version"]),
            license=general["license"],
            backends=tuple(general["backends"]),
            cuda_capabilities=tuple(dict.fromkeys(cuda_caps)),
            cuda_sources=tuple(cuda_src),
            torch_sources=tuple(torch_cfg.get("src", [])),
            stable_abi_cuda=torch_cfg.get("stable-abi", {}).get("cuda"),
            repo_id=general.get("hub", {}).get("repo-id"),
        )
    except KeyError as e:
        raise BuildError(f"build.toml: [general] lacks the required key {e.args[0]!r}.") from None


# --- source identity -----------------------------------------------------------------------------------------


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


@dataclass(frozen=True)
class SourceId:
    sha7: str  # 7 hex digits of the source tree id
    commit: str | None
    dirty: bool

    @property
    def unique_id(self) -> str:
        return self.sha7 + ("_dirty" if self.dirty else "")


def source_id(root: Path) -> SourceId:
    """kernel-builder's unique id: HEAD's tree id (7 hex), ``_dirty`` when tracked files differ.

    Outside git, a content hash of the kernel sources stands in (always marked dirty: it is not reproducible
    from a commit).
    """
    try:
        commit = _git(root, "rev-parse", "HEAD")
        tree = _git(root, "rev-parse", "HEAD^{tree}")
        dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no"))
        return SourceId(tree[:7], commit, dirty)
    except (subprocess.CalledProcessError, FileNotFoundError):
        h = hashlib.sha1()
        for p in sorted((root / "torch-ext").rglob("*")) + sorted((root / "geglu").rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(root)).encode())
                h.update(p.read_bytes())
        return SourceId(h.hexdigest()[:7], None, True)


def ops_id(cfg: KernelConfig, tag: str, sid: SourceId) -> str:
    return f"_{cfg.python_name}_{tag}_{sid.unique_id}"


# --- variant files -------------------------------------------------------------------------------------------


def ops_py(ops_name: str, *, load_library: bool) -> str:
    lines = ["import torch", ""]
    if load_library:
        lines += [f"from . import {ops_name}  # noqa: F401  (loads {ops_name}.abi3.so, which registers the ops)", ""]
    lines += [
        f"ops = torch.ops.{ops_name}",
        f"HAS_CUDA_LIB = {load_library}",
        "",
        "",
        "def add_op_namespace_prefix(op_name: str) -> str:",
        '    """Prefix op_name with this build\'s ops namespace."""',
        f'    return f"{ops_name}::{{op_name}}"',
        "",
    ]
    return "\n".join(lines)


def python_files(cfg: KernelConfig) -> list[Path]:
    pkg = cfg.package_dir
    if not (pkg / "__init__.py").is_file():
        raise BuildError(f"{pkg}/__init__.py is missing: the kernel package must live in torch-ext/{cfg.python_name}/.")
    return sorted(p for p in pkg.glob("*.py") if p.name != "_ops.py")


def file_digest(variant_dir: Path) -> dict:
    """sha256 of each file of the variant (base64), metadata.json excluded, as kernel-builder's digest hook."""
    files = {}
    for p in sorted(variant_dir.rglob("*")):
        if p.is_file() and p.name != "metadata.json" and "__pycache__" not in p.parts:
            files[p.relative_to(variant_dir).as_posix()] = base64.b64encode(hashlib.sha256(p.read_bytes()).digest()).decode()
    return {"algorithm": "sha256", "files": files}


def write_metadata(variant_dir: Path, cfg: KernelConfig, sid: SourceId, ops_name: str, backend: dict) -> dict:
    meta = {
        "name": cfg.name,
        "id": ops_name,
        "version": cfg.version,
        "license": cfg.license,
        "python-depends": [],
        "backend": backend,
        "digest": file_digest(variant_dir),
        # kernels' strict parser rejects null: `commit` must be a 40/64-hex git id given together with `dirty`,
        # so the builder (no git id of its own) states its version only, and `kernel` is left out outside git.
        "provenance": {"kernel-builder": {"version": f"{BUILDER_NAME}-{BUILDER_VERSION}"}},
    }
    if sid.commit is not None:
        meta["provenance"]["kernel"] = {"commit": sid.commit, "dirty": sid.dirty}
    (variant_dir / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _fresh_dir(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def build_noarch(cfg: KernelConfig, out_root: Path, backend: str, sid: SourceId | None = None) -> Path:
    """Write ``build/torch-<backend>/`` (``cpu`` or ``cuda``) and return it."""
    sid = sid or source_id(cfg.root)
    tag = NOARCH_BACKENDS[backend]
    name = ops_id(cfg, tag, sid)
    variant = out_root / f"torch-{backend}"
    _fresh_dir(variant)
    for p in python_files(cfg):
        shutil.copy2(p, variant / p.name)
    (variant / "_ops.py").write_text(ops_py(name, load_library=False))
    backend_meta = {"type": backend}
    if backend == "cuda" and cfg.cuda_capabilities:
        backend_meta["archs"] = sorted(cfg.cuda_capabilities, key=lambda c: tuple(int(x) for x in c.split(".")))
    write_metadata(variant, cfg, sid, name, backend_meta)
    return variant


def build(root: Path, out_root: Path | None = None, *, variants: list[str] | None = None,
          capability: str | None = None, log=print) -> list[Path]:
    """Build the requested variants (default: every one build.toml asks for) into ``out_root``."""
    root = root.resolve()
    cfg = read_config(root)
    out_root = (out_root or root / "build").resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    sid = source_id(root)
    wanted = variants or ["cpu", "cuda", "cuda-compiled"]
    built = []
    for v in wanted:
        if v in ("cpu", "cuda"):
            if v not in cfg.backends:
                raise BuildError(f"build.toml's backends {list(cfg.backends)} do not include {v!r}.")
            built.append(build_noarch(cfg, out_root, v, sid))
            log(f"built {built[-1].relative_to(out_root.parent) if out_root.parent in built[-1].parents else built[-1]}")
        elif v == "cuda-compiled":
            from . import cuda_build  # compiled variant: nvcc + torch stable ABI

            built.append(cuda_build.build_compiled(cfg, out_root, sid, capability=capability, log=log))
        else:
            raise BuildError(f"Unknown variant {v!r}: expected one of cpu, cuda, cuda-compiled.")
    return built


def add_parser(sub) -> None:
    p = sub.add_parser("build", help="build the build/<variant>/ tree (like kernel-builder build-and-copy)")
    p.add_argument("--root", type=Path, default=Path("."), help="kernel repository root (has build.toml)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: <root>/build)")
    p.add_argument("--variant", action="append", choices=["cpu", "cuda", "cuda-compiled"],
                   help="variant(s) to build (default: all)")
    p.add_argument("--capability", default=None,
                   help="compile for this one CUDA capability (e.g. 9.0) instead of build.toml's list")
    p.set_defaults(_main=main)


def main(args) -> int:
    try:
        build(args.root, args.out, variants=args.variant, capability=args.capability)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
