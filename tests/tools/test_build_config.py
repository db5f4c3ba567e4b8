"""kerneltools.build checked with the ecosystem's own tools: the variant names with kernels' variant grammar, the
digest with kernels-data; the repo id's one home; kerneltools has no import cycle. (build.toml itself is checked
with kernels' parser in tests/test_repo_config.py.)"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from toolhelpers import REPO_ROOT
from kerneltools.build import build, config, cuda, noarch

# --- variant names -------------------------------------------------------------------------------------------


@pytest.mark.ecosystem
def test_every_variant_name_parses_with_kernels_grammar(tmp_path):
    from kerneltools.kernels_api import parse_variant

    cfg = config.read_config(REPO_ROOT)
    names = [noarch.build_noarch(cfg, tmp_path, b, config.SourceId("abcdef1", None, True), aot_archs=[]).name
             for b in noarch.NOARCH_BACKENDS]
    assert names == ["torch-cpu", "torch-cuda"]
    for backend in names:
        v = parse_variant(backend)
        assert not v.arch and v.name == backend
    # the compiled variant's name for each CUDA toolkit it can be built with
    for major, minor in [(12, 6), (12, 8), (13, 0), (13, 2)]:
        nvcc = cuda.Nvcc(Path("nvcc"), major, minor, "", ("9.0",))
        name = cuda.variant_name(cfg, nvcc)
        v = parse_variant(name)
        assert v.arch and v.name == name
        assert v.framework == "TorchStableAbi" and v.framework_version == cfg.stable_abi_cuda
        assert v.backend == "CUDA" and v.backend_version == (major, minor)


# --- the digest ------------------------------------------------------------------------------------------------


def _digest_before_kernels_data(variant_dir: Path) -> dict:
    """The digest the builder wrote by hand before it used kernels-data (kept here as the reference)."""
    files = {}
    for p in sorted(variant_dir.rglob("*")):
        if p.is_file() and p.name != "metadata.json" and "__pycache__" not in p.parts:
            files[p.relative_to(variant_dir).as_posix()] = base64.b64encode(hashlib.sha256(p.read_bytes()).digest()).decode()
    return {"algorithm": "sha256", "files": files}


def test_metadata_json_bytes_are_what_the_hand_written_digest_gave(tmp_path):
    out = tmp_path / "build"
    for variant in build(REPO_ROOT, out, variants=["cpu", "cuda"], aot_capability="none", log=lambda *a: None):
        text = (variant / "metadata.json").read_text()
        meta = json.loads(text)
        expected = _digest_before_kernels_data(variant)
        assert len(expected["files"]) >= 5 and "_ops.py" in expected["files"]
        assert text == json.dumps({**meta, "digest": expected}, indent=2) + "\n"  # same bytes, same key order


def test_digest_matches_on_nested_files_and_orders_by_path(tmp_path):
    """Nested folders, names where path order and string order differ, and what the hash skips."""
    v = tmp_path / "variant"
    for rel, data in {"a.py": b"a", "a/b.py": b"ab", "a-b.py": b"dash", "sub/deep/x.json": b"{}",
                      "__pycache__/c.cpython-311.pyc": b"\0", "metadata.json": b"{}"}.items():
        (v / rel).parent.mkdir(parents=True, exist_ok=True)
        (v / rel).write_bytes(data)
    got = config.variant_digest(v)
    assert got == _digest_before_kernels_data(v)
    assert list(got["files"]) == list(_digest_before_kernels_data(v)["files"])
    assert list(got["files"]) == ["a/b.py", "a-b.py", "a.py", "sub/deep/x.json"]


def test_digest_is_what_kernels_data_validates(tmp_path):
    import kernels_data

    (variant,) = build(REPO_ROOT, tmp_path, variants=["cpu"], log=lambda *a: None)
    meta = kernels_data.Metadata.read_from_file(variant / "metadata.json")
    meta.digest.validate(kernels_data.Digest.hash_variant(kernels_data.DigestAlgorithm.SHA256, variant))
    (variant / "layers.py").write_text("# changed\n")
    with pytest.raises(kernels_data.DigestValidationError, match="layers.py"):
        meta.digest.validate(kernels_data.Digest.hash_variant(kernels_data.DigestAlgorithm.SHA256, variant))


# --- the repo id -----------------------------------------------------------------------------------------------


def test_repo_id_comes_from_build_toml():
    import tomllib

    from kerneltools import demo, transformers_kernels

    data = tomllib.loads((REPO_ROOT / "build.toml").read_text())
    repo_id = data["general"]["hub"]["repo-id"]
    assert config.hub_repo_id() == repo_id == config.validate_repo_id(repo_id)
    assert transformers_kernels.DEFAULT_REPO_ID == demo.REPO_ID == repo_id
    assert config.hub_org() == repo_id.split("/")[0]


@pytest.mark.parametrize("bad, reason", [
    ("geglu", "expected ORG/NAME"),
    ("a/b/c", "expected ORG/NAME"),
    ("not a/repo", "alphanumeric"),
    ("org/name.git", ".git"),
    ("org--x/name", "--"),
])
def test_repo_id_validation(bad, reason):
    with pytest.raises(ValueError, match=f"Invalid repo id {bad!r}.*{reason.replace('.', '[.]')}"):
        config.validate_repo_id(bad)


def test_missing_repo_id_is_explained(tmp_path):
    shutil.copy(REPO_ROOT / "build.toml", tmp_path / "build.toml")
    text = (tmp_path / "build.toml").read_text()
    (tmp_path / "build.toml").write_text(text.replace('repo-id = "', 'branch = "', 1))
    with pytest.raises(config.BuildError, match=r"has no repo-id under \[general.hub\]"):
        config.hub_repo_id(tmp_path)
    with pytest.raises(config.BuildError, match="Install it from a checkout"):
        config.hub_repo_id(tmp_path / "elsewhere")


# --- no import cycles ------------------------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO_ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    """kerneltools modules that ``module`` imports, at any depth of the file (lazy imports count too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found |= {f"{target}.{a.name}" for a in node.names}
    return {m for m in found if m == "kerneltools" or m.startswith("kerneltools.")}


def test_kerneltools_has_no_import_cycle():
    files = {_module_name(p): p for p in (REPO_ROOT / "kerneltools").rglob("*.py")}
    graph = {m: {t for t in _imports(p, m) if t in files and t != m} for m, p in files.items()}
    assert graph["kerneltools.build.cuda"] == {"kerneltools.build.config", "kerneltools.build.aot"}
    assert graph["kerneltools.build.aot"] == {"kerneltools.build.config"}
    assert graph["kerneltools.build.noarch"] == {"kerneltools.build.config", "kerneltools.build.aot"}
    assert graph["kerneltools.build.config"] == set()

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = [c for m in sorted(graph) if (c := cycle_from(m))]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_kernels_minver_is_the_oldest_supported_kernels(tmp_path):
    """metadata.json asks for the kernels release CI tests as the oldest (requirements-lower.txt), and kernels'
    own parser reads it."""
    import re

    import kernels

    pin = re.search(r"^kernels==(\S+)$", (REPO_ROOT / "requirements-lower.txt").read_text(), re.M).group(1)
    assert config.KERNELS_MINVER == pin
    cfg = config.read_config(REPO_ROOT)
    variant = noarch.build_noarch(cfg, tmp_path, "cpu", config.SourceId("abcdef1", None, True))
    meta = (variant / "metadata.json").read_bytes()
    assert json.loads(meta)["kernels-minver"] == pin
    kernels.Metadata.from_bytes(meta)  # parses (kernels 0.19 also checks it against its own version at load)
