"""The kernel package's shape (torch-ext/geglu): features in subpackages over one shared runtime, imported in one
direction. The source is read as text: nothing is imported or built.

- no import cycle between modules (relative imports at any depth of a file count, function-level ones too), and the
  settings (``runtime.config``) import none of the modules that read them;
- ``runtime`` imports no feature; a feature imports another feature's public names only (no ``_name`` of another
  subpackage) and the runtime's public names only;
- the package imports nothing but torch, triton, the standard library and itself (``kernels`` and
  ``transformers`` lazily, inside the functions that integrate with them);
- no GPU product name and no commit id in the package's code: those belong in docs/ and benchmarks/results/.
"""

import ast
import re
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "torch-ext" / "geglu"
FEATURES = ("pointwise", "mlp", "experts", "rmsnorm")
RUNTIME = "runtime"


def _name(path: Path) -> str:
    """``runtime.config`` for torch-ext/geglu/runtime/config.py, ``layers`` for layers.py."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _modules() -> dict:
    return {_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts and p.name != "_ops.py"}


def _resolve(here: str, is_package: bool, level: int, module) -> str:
    """The absolute (package-relative) name of ``from <level dots><module> import ...`` in module ``here``."""
    base = here.split(".") if here else []
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + (module.split(".") if module else []))


def _imports(path: Path):
    """(target module, [imported names]) of every relative import in ``path``; for ``from . import x`` the target is
    the subpackage and the names are its modules."""
    here = _name(path)
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            yield _resolve(here, is_package, node.level, node.module), [a.name for a in node.names]


def _graph() -> dict:
    modules = _modules()
    graph = {}
    for m, p in modules.items():
        targets = set()
        for target, names in _imports(p):
            found = {f"{target}.{n}" if target else n for n in names} & set(modules)
            targets |= found  # `from .runtime import config`: the module runtime.config
            if not found and target in modules:
                targets.add(target)  # `from .runtime.config import Config`: the module runtime.config
        graph[m] = targets - {m}
    return graph


def _feature(module: str) -> str:
    return module.split(".")[0]


def test_the_package_is_grouped_by_feature():
    modules = _modules()
    for sub in FEATURES + (RUNTIME,):
        assert sub in modules, f"torch-ext/geglu/{sub}/__init__.py is missing"
    # the runtime holds what every feature shares
    assert {"runtime.config", "runtime.backend", "runtime.aot", "runtime.launch", "runtime.gelu_math"} <= set(modules)


def test_settings_module_imports_no_module_that_reads_it():
    graph = _graph()
    assert graph["runtime.config"] <= {"runtime"}, graph["runtime.config"]
    readers = {m for m, targets in graph.items() if "runtime.config" in targets}
    assert {"runtime.backend", "runtime.direct"} <= readers, readers


def test_kernel_package_has_no_import_cycle():
    graph = {m: {t for t in ts if not (t in m.split(".") or m.startswith(t + "."))} for m, ts in _graph().items()}
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as e:
        raise AssertionError("import cycle: " + " -> ".join(e.args[1])) from None


def test_runtime_imports_no_feature_and_features_use_only_public_names():
    bad = []
    for m, p in _modules().items():
        mine = _feature(m)
        for target, names in _imports(p):
            theirs = _feature(target) if target else None
            if mine == RUNTIME and theirs in FEATURES:
                bad.append(f"{m} imports {target}: the runtime must not depend on a feature")
            if theirs is None or theirs == mine or theirs not in FEATURES + (RUNTIME,):
                continue  # the package root, the same subpackage, or a top-level module (layers, functional, ...)
            private = [n for n in names if n.startswith("_")]
            if private:
                bad.append(f"{m} imports {', '.join(private)} from {target}: another subpackage's private names")
        bad += [f"{m} reads {alias}.{attr}: a private name of {target}" for alias, target, attr in _private_reads(p)
                if _feature(target) != mine]
    assert not bad, "\n".join(bad)


def _private_reads(path: Path):
    """(alias, module, name) of every ``alias._name`` in ``path`` where ``alias`` is a package module imported by a
    relative ``from ..x import module [as alias]``."""
    here = _name(path)
    tree = ast.parse(path.read_text())
    modules = _modules()
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            target = _resolve(here, path.name == "__init__.py", node.level, node.module)
            for a in node.names:
                full = f"{target}.{a.name}" if target else a.name
                if full in modules:
                    aliases[a.asname or a.name] = full
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            yield node.value.id, aliases[node.value.id], node.attr


ALLOWED_TOP_LEVEL = {"torch", "triton", "numpy"}
LAZY_ONLY = {"kernels", "transformers"}  # imported inside the functions that integrate with them


def test_the_package_imports_only_torch_triton_and_the_standard_library():
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for m, p in _modules().items():
        tree = ast.parse(p.read_text())
        top_level = set(tree.body)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [node.module.split(".")[0]]
            else:
                continue
            for r in roots:
                if r in stdlib or r in ALLOWED_TOP_LEVEL:
                    continue
                if r in LAZY_ONLY and node not in top_level:
                    continue
                bad.append(f"{m}: import {r}")
    assert not bad, bad


GPU_NAMES = re.compile(r"\b(H100|H200|H800|GH200|A100|A10G?|A30|A40|L4|L40S?|T4|V100|B100|B200|GB200|B300|RTX|"
                       r"DGX|Jetson|Hopper|Ampere|Ada|Blackwell)\b")
# 7 to 40 hex digits with a letter and a digit; PTX float literals (0f3F800000) are not commit ids
COMMIT_ID = re.compile(r"\b(?!0f[0-9a-fA-F]{8}\b)(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def test_no_gpu_name_or_commit_id_in_the_package():
    """Architectures are named by compute capability (sm_90); measurements, with their card and commit, live in
    docs/ and benchmarks/results/."""
    bad = []
    for m, p in _modules().items():
        for i, line in enumerate(p.read_text().splitlines(), 1):
            for rx in (GPU_NAMES, COMMIT_ID):
                hit = rx.search(line)
                if hit:
                    bad.append(f"{p.relative_to(PACKAGE)}:{i}: {hit.group(0)!r} in {line.strip()[:100]}")
    assert not bad, "\n".join(bad)


MAX_FILE_LINES = 400
MAX_PACKAGE_LINES = 4600


def test_no_file_of_the_package_is_over_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in _modules().values() if (n := len(p.read_text().splitlines()))
            > MAX_FILE_LINES}
    assert not long, f"split these by concern (at most {MAX_FILE_LINES} lines a file): {long}"


def test_the_package_is_at_most_4600_lines():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in _modules().values()}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total <= MAX_PACKAGE_LINES, (f"the package holds {total} lines (at most {MAX_PACKAGE_LINES}): give a "
                                        f"cut or a shared helper before adding; largest files {largest}")
