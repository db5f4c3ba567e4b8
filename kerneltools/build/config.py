"""What every variant is made of: build.toml, the source id, the ops id, the package files and metadata.json.

``build.toml`` (kernel-builder edition 5) is the one place for the kernel's name, version, license, backends,
CUDA capabilities and Hub repository (``[general.hub] repo-id``): the builder, the publisher, the demo and the
transformers integration all read it through :func:`read_config` / :func:`hub_repo_id`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

BUILDER_NAME = "kerneltools"
BUILDER_VERSION = "0.1.0"
# metadata.json's kernels-minver: the oldest kernels release that loads the variants, with the kernel's
# transformers integration (requirements-lower.txt; kernels >= 0.19's loader refuses a variant asking for more)
KERNELS_MINVER = "0.17.2"

# The kernel repository this tooling lives in (kerneltools/build/config.py -> the repository root).
REPO_ROOT = Path(__file__).resolve().parents[2]


class BuildError(RuntimeError):
    """A build cannot proceed; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class KernelConfig:
    """The parts of build.toml the tooling uses."""

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


# --- build.toml ----------------------------------------------------------------------------------------------
#
# Nothing here imports huggingface_hub or kernels: both read HF_ENDPOINT when first imported, and the demo builds
# before it points them at its loopback Hub. build.toml's kernel-builder rules are checked in the tests with
# kernels' own parser (tests/tools/test_build_config.py); the repo id is validated where a Hub is talked to
# (kerneltools.publish, with validate_repo_id).


def _load_toml(root: Path) -> dict:
    path = root / "build.toml"
    if not path.is_file():
        raise BuildError(f"No build.toml in {root}: run the builder from the kernel repository root (or pass --root).")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise BuildError(f"{path} is not valid TOML: {e}. Fix the file and retry.") from None


def read_config(root: Path) -> KernelConfig:
    data = _load_toml(root)
    general = data.get("general", {})
    torch_cfg = data.get("torch", {})
    cuda_caps: list[str] = []
    cuda_src: list[str] = []
    for kernel in data.get("kernel", {}).values():
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
            repo_id=toml_repo_id(data),
        )
    except KeyError as e:
        raise BuildError(f"build.toml: [general] lacks the required key {e.args[0]!r}.") from None


# --- the repo id ---------------------------------------------------------------------------------------------


def toml_repo_id(data: dict) -> str | None:
    """``[general.hub] repo-id`` of a parsed build.toml (None when it has none)."""
    return ((data.get("general") or {}).get("hub") or {}).get("repo-id")


def hub_repo_id(root: Path = REPO_ROOT) -> str:
    """build.toml's ``[general.hub] repo-id``: where this kernel is published and loaded from."""
    if not (root / "build.toml").is_file():
        raise BuildError(f"No build.toml in {root}: kerneltools reads the kernel's repo id from the build.toml of the "
                         "repository it lives in. Install it from a checkout (pip install -e .) or run it there.")
    repo_id = read_config(root).repo_id
    if not repo_id:
        raise BuildError(f"{root / 'build.toml'} has no repo-id under [general.hub]: add one, e.g. "
                         'repo-id = "geglu-kernels/geglu".')
    return repo_id


def hub_org(root: Path = REPO_ROOT) -> str:
    """The organization of :func:`hub_repo_id` (the publisher the loopback Hub trusts by default)."""
    return hub_repo_id(root).split("/", 1)[0]


def validate_repo_id(repo_id: str) -> str:
    """``repo_id`` when it is a valid ``ORG/NAME`` Hub repository id (huggingface_hub's rules), else ValueError."""
    from huggingface_hub.utils import HFValidationError
    from huggingface_hub.utils import validate_repo_id as hf_validate

    expected = "expected ORG/NAME, e.g. geglu-kernels/geglu"
    if not isinstance(repo_id, str) or repo_id.count("/") != 1:
        raise ValueError(f"Invalid repo id {repo_id!r}: {expected}.")
    try:
        hf_validate(repo_id)
    except HFValidationError as e:
        raise ValueError(f"Invalid repo id {repo_id!r}: {str(e).rstrip('.')} ({expected}).") from None
    return repo_id


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
    """The variant's ops namespace and module name: ``_<name>_<tag>_<unique id>``, as kernel-builder names it."""
    return f"_{cfg.python_name}_{tag}_{sid.unique_id}"


# --- variant files -------------------------------------------------------------------------------------------


def ops_py(ops_name: str, *, load_library: bool) -> str:
    """The generated ``_ops.py`` (kernel-builder's contract: ``ops`` and ``add_op_namespace_prefix``)."""
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
    """The package's ``*.py`` files every variant ships, its subpackages' included (the generated ``_ops.py`` aside):
    paths relative to the package folder, as the variant holds them."""
    pkg = cfg.package_dir
    if not (pkg / "__init__.py").is_file():
        raise BuildError(f"{pkg}/__init__.py is missing: the kernel package must live in torch-ext/{cfg.python_name}/.")
    files = sorted(p.relative_to(pkg) for p in pkg.rglob("*.py")
                   if "__pycache__" not in p.parts and p.relative_to(pkg) != Path("_ops.py"))
    for f in files:
        if len(f.parts) > 1 and not (pkg / f.parent / "__init__.py").is_file():
            raise BuildError(f"{pkg / f.parent} holds {f.name} but no __init__.py: every folder of the package must be "
                             "a subpackage (add an __init__.py) or live outside torch-ext/.")
    return files


def copy_python_files(cfg: KernelConfig, variant: Path) -> None:
    """Copy the package's Python files (:func:`python_files`) into ``variant``, keeping the subpackage folders."""
    for rel in python_files(cfg):
        (variant / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(cfg.package_dir / rel, variant / rel)


def fresh_dir(path: Path) -> None:
    """An empty folder at ``path`` (what was there is removed)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def variant_digest(variant_dir: Path) -> dict:
    """metadata.json's ``digest``: kernels-data's own variant hash (sha256, base64, per file; it skips
    metadata.json, ``__pycache__`` and ``*.pyc``), files in path order."""
    from kernels_data import Digest, DigestAlgorithm

    digest = Digest.hash_variant(DigestAlgorithm.SHA256, variant_dir)
    files = dict(sorted(digest.files.items(), key=lambda kv: PurePosixPath(kv[0]).parts))
    return {"algorithm": str(digest.algorithm), "files": files}


def write_metadata(variant_dir: Path, cfg: KernelConfig, sid: SourceId, ops_name: str, backend: dict) -> dict:
    """Write ``metadata.json`` last (its digest covers every other file of the variant) and return it."""
    meta = {
        "name": cfg.name,
        "id": ops_name,
        "version": cfg.version,
        "license": cfg.license,
        "python-depends": [],
        "kernels-minver": KERNELS_MINVER,
        "backend": backend,
        "digest": variant_digest(variant_dir),
        # kernels' strict parser rejects null: `commit` must be a 40/64-hex git id given together with `dirty`,
        # so the builder (no git id of its own) states its version only, and `kernel` is left out outside git.
        "provenance": {"kernel-builder": {"version": f"{BUILDER_NAME}-{BUILDER_VERSION}"}},
    }
    if sid.commit is not None:
        meta["provenance"]["kernel"] = {"commit": sid.commit, "dirty": sid.dirty}
    (variant_dir / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta
