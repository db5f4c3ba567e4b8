"""The Hub card: ``CARD.md`` of the kernel repository, rendered into the ``README.md`` that publish puts on ``main``.

As kernel-builder's upload does, ``CARD.md`` is a Jinja template (``trim_blocks``) rendered with

- ``repo_id``, ``license`` (lower case), ``upstream``, ``has_benchmark`` and the lists ``functions`` (the package's
  ``__all__`` without ``layers``) and ``layers`` (``layers.__all__``): kernel-builder's own names;
- ``name``, ``python_name``, ``version`` (the version just published), ``latest_version``, ``backends``,
  ``cuda_capabilities``, ``benchmarks`` (the published ``benchmarks/benchmark*.py``);
- ``versions``: every ``vN`` branch on the Hub, newest first, each ``{version, branch, variants}``;
- ``variants``: the variants of ``version`` in the loader's order of preference (CPU last), each
  ``{name, backend, archs, serves}``; ``serves`` says which torch / CUDA / CPU combination the kernels loader
  picks it for.

A repository without ``CARD.md`` gets :data:`DEFAULT_CARD`. Undefined names are errors, so a typo in the
template fails the publish before anything is uploaded.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

CARD_FILE = "CARD.md"

DEFAULT_CARD = """\
---
license: {{ license }}
tags:
- kernels
---

# {{ name }}

Builds of the `{{ name }}` kernel for the Hugging Face [kernels](https://github.com/huggingface/kernels) loader.
Each major version lives on its own branch (`v1`, `v2`, ...); `main` holds only this card.

## Usage

```python
from kernels import get_kernel

{{ python_name }} = get_kernel("{{ repo_id }}", version={{ latest_version }})
```

{% include "versions" %}

{% include "variants" %}

## Build

- license: {{ license_id }}
{% if backends %}
- backends: {{ backends | join(", ") }}
{% endif %}
{% if cuda_capabilities %}
- CUDA capabilities: {{ cuda_capabilities | join(", ") }}
{% endif %}
"""

# The two tables publish fills in; a CARD.md includes them with {% include "versions" %} / {% include "variants" %}.
VERSIONS_TABLE = """\
## Versions

| version | branch | variants |
|---|---|---|
{% for v in versions %}
| {{ v.version }} | `{{ v.branch }}` | {% for name in v.variants %}`{{ name }}`{{ ", " if not loop.last }}{% else %}-{% endfor %} |
{% endfor %}
"""

VARIANTS_TABLE = """\
## Variants of version {{ version }}

| variant | backend | archs |
|---|---|---|
{% for v in variants %}
| `{{ v.name }}` | {{ v.backend }} | {{ v.archs | join(", ") or "any" }} |
{% endfor %}
"""


class CardError(ValueError):
    """CARD.md cannot be rendered; the message names the file, the line and what is wrong."""


@dataclass(frozen=True)
class CardVariant:
    name: str
    backend: str
    archs: tuple[str, ...]

    @property
    def serves(self) -> str:
        return variant_serves(self.name)


def variant_serves(name: str) -> str:
    """Which torch / CUDA / CPU combination the kernels loader picks this variant for (its own parser and rules:
    stable-ABI needs torch >= its ABI version, CUDA variants the same CUDA major and a minor <= torch's, noarch
    variants the matching backend; more specific variants are preferred)."""
    from .kernels_api import parse_variant

    try:
        v = parse_variant(name)
    except ValueError:
        return "not a variant name the kernels loader knows: never loaded"
    if v.arch:
        if v.framework == "TorchStableAbi":
            torch_part = f"torch >= {v.framework_version}"
        elif v.framework == "Torch":
            torch_part = f"torch {v.framework_version}" + (" (C++11 ABI)" if v.cxx11_abi else "")
        else:  # TvmFfi
            torch_part = f"tvm-ffi {v.framework_version or ''}".strip()
        if v.backend == "CUDA" and v.backend_version is not None:
            major, minor = (v.backend_version + (0,))[:2]
            backend_part = f"CUDA {major}.x" if minor == 0 else f"CUDA {major}.{minor} or a later {major}.x"
        else:
            version = ".".join(map(str, v.backend_version)) if v.backend_version else ""
            backend_part = f"{v.backend}{' ' + version if version else ''}"
        return f"{torch_part} built with {backend_part}, {v.platform} {v.os.capitalize()}"
    if v.backend == "cpu":
        return "torch on CPU, any version"
    if v.backend == "universal":
        return "any torch that no other variant serves (legacy universal build)"
    return f"any {v.backend.upper() if v.backend == 'cuda' else v.backend} torch that no compiled variant serves"


def loader_preference(name: str) -> int:
    """The order in which the kernels loader prefers variants that fit: stable ABI, per-torch builds, tvm-ffi,
    noarch, the legacy torch-universal; unknown names last."""
    from .kernels_api import parse_variant

    try:
        v = parse_variant(name)
    except ValueError:
        return 5
    if v.arch:
        return {"TorchStableAbi": 0, "Torch": 1}.get(v.framework, 2)
    return 4 if v.backend == "universal" else 3


def _all_of(path: Path) -> list[str] | None:
    """The string entries of a module's ``__all__`` list or tuple (read with ast: the module is not imported)."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            if isinstance(node.value, (ast.List, ast.Tuple)):
                return [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return None


def package_api(root: Path, python_name: str) -> tuple[list[str], list[str]]:
    """(functions, layers): the kernel package's ``__all__`` without ``layers``, and ``layers.__all__`` (empty when
    the package does not export ``layers``)."""
    pkg = root / "torch-ext" / python_name
    names = _all_of(pkg / "__init__.py") or []
    functions = [n for n in names if n != "layers"]
    layers: list[str] = []
    if "layers" in names:
        for candidate in (pkg / "layers.py", pkg / "layers" / "__init__.py"):
            if candidate.is_file():
                layers = _all_of(candidate) or []
                break
    return functions, layers


def _capability_key(cap: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", cap)]


def card_context(toml: dict, repo_id: str, version: int, variants: list[CardVariant],
                 versions_on_hub: dict[int, list[str]], root: Path | None, benchmarks: list[str]) -> dict:
    g = toml.get("general", {})
    name = g.get("name", repo_id.split("/")[1])
    python_name = name.replace("-", "_")
    functions, layers = package_api(root, python_name) if root is not None else ([], [])
    license_id = str(g.get("license", "other"))
    caps = sorted({c for k in (toml.get("kernel") or {}).values() if isinstance(k, dict)
                   for c in k.get("cuda-capabilities", [])}, key=_capability_key)
    return {
        "repo_id": repo_id,
        "name": name,
        "python_name": python_name,
        "license": license_id.lower(),
        "license_id": license_id,
        "upstream": g.get("upstream"),
        "functions": functions,
        "layers": layers,
        "has_benchmark": "benchmarks/benchmark.py" in benchmarks,
        "benchmarks": benchmarks,
        "version": version,
        "latest_version": max(versions_on_hub) if versions_on_hub else version,
        "backends": list(g.get("backends") or []),
        "cuda_capabilities": caps,
        "versions": [{"version": v, "branch": f"v{v}", "variants": versions_on_hub[v]}
                     for v in sorted(versions_on_hub, reverse=True)],
        "variants": [{"name": v.name, "backend": v.backend, "archs": list(v.archs), "serves": v.serves}
                     for v in sorted(variants, key=lambda v: (loader_preference(v.name), v.backend == "cpu", v.name))],
    }


def render_card(context: dict, root: Path | None) -> str:
    """CARD.md of ``root`` (or :data:`DEFAULT_CARD`) rendered with ``context``. Raises CardError."""
    import jinja2

    path = root / CARD_FILE if root is not None else None
    if path is not None and path.is_file():
        source, where = path.read_text(), str(path)
    else:
        source, where = DEFAULT_CARD, "the default card"
    loader = jinja2.DictLoader({"card": source, "versions": VERSIONS_TABLE, "variants": VARIANTS_TABLE})
    env = jinja2.Environment(loader=loader, trim_blocks=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)
    try:
        return env.get_template("card").render(**context)
    except jinja2.TemplateSyntaxError as e:
        raise CardError(f"{where}, line {e.lineno}: {e.message}. Fix the template (Jinja syntax, as kernel-builder's "
                        "CARD.md).") from None
    except jinja2.UndefinedError as e:
        raise CardError(f"{where}: {e.message}; the names a card can use are: {', '.join(sorted(context))}.") from None
