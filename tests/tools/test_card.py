"""The Hub card: CARD.md documents the package's public API, and publish renders it into main's README.md with
the version and variant tables (kerneltools.card)."""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from toolhelpers import GEGLU_REPO, REPO_ROOT, TRUSTED_ORG, git, make_project, make_variant, repo_dir
from kerneltools.card import package_api, variant_serves
from kerneltools.publish import PublishError, publish

CARD = REPO_ROOT / "CARD.md"


def _first_column(section: str) -> list[str]:
    """The identifiers in the first column of the table under ``## <section>`` of CARD.md."""
    part = CARD.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for line in part.splitlines() if (m := re.match(r"\| `([A-Za-z_]\w*)", line))]


def test_card_documents_exactly_the_public_api(geglu):
    functions, layers = package_api(REPO_ROOT, "geglu")
    # what publish reads from the sources is the loaded kernel's own __all__
    assert functions == [n for n in geglu.__all__ if n != "layers"]
    assert layers == list(geglu.layers.__all__)
    assert _first_column("Functions") == functions, "CARD.md's function table differs from __all__"
    assert _first_column("Layers") == layers, "CARD.md's layer table differs from layers.__all__"


@pytest.mark.parametrize("name, serves", [
    ("torch-stable-abi210-cu130-x86_64-linux", "torch >= 2.10 built with CUDA 13.x, x86_64 Linux"),
    ("torch-stable-abi210-cu126-aarch64-linux", "torch >= 2.10 built with CUDA 12.6 or a later 12.x, aarch64 Linux"),
    ("torch213-cxx11-cu128-x86_64-linux", "torch 2.13 (C++11 ABI) built with CUDA 12.8 or a later 12.x, x86_64 Linux"),
    ("torch-cuda", "any CUDA torch that no compiled variant serves"),
    ("torch-cpu", "torch on CPU, any version"),
    ("mystery-build", "not a variant name the kernels loader knows: never loaded"),
])
def test_variant_serves(name, serves):
    assert variant_serves(name) == serves


@pytest.mark.parametrize("torch_version, cuda, picked", [
    ("2.13", "13.0", "torch-stable-abi210-cu130-x86_64-linux"),
    ("2.10", "13.2", "torch-stable-abi210-cu130-x86_64-linux"),
    ("2.13", "12.8", "torch-cuda"),  # a cu12x torch falls back to the Triton variant
    ("2.12", "12.6", "torch-cuda"),
    ("2.9", "13.0", "torch-cuda"),  # older than the stable ABI
    ("2.13", None, "torch-cpu"),
])
@pytest.mark.ecosystem
def test_the_card_says_what_the_loader_does(torch_version, cuda, picked):
    """The card's claims, checked with kernels' own variant resolution for the system described."""
    from kerneltools.kernels_api import resolve_for_system

    names = ["torch-stable-abi210-cu130-x86_64-linux", "torch-cuda", "torch-cpu"]
    assert resolve_for_system(names, cuda=cuda, torch_version=torch_version)[0] == picked


def _readme(hub) -> str:
    return git(repo_dir(hub, GEGLU_REPO), "show", "main:README.md")


def _variant_rows(build_dir) -> list[str]:
    rows = []
    for d in sorted(p for p in build_dir.iterdir() if p.is_dir()):
        archs = json.loads((d / "metadata.json").read_text())["backend"].get("archs") or []
        rows.append(f"| `{d.name}` | {variant_serves(d.name)} | {', '.join(archs) or '-'} |")
    return rows


def test_published_card(hub, geglu_builds):
    r1 = geglu_builds.v1.publish(hub)
    readme = _readme(hub)
    assert readme.startswith("---\nlibrary_name: kernels\nlicense: apache-2.0\n")
    assert "{{" not in readme and "{%" not in readme
    assert f'get_kernel("{GEGLU_REPO}", version=1)' in readme
    assert "geglu.register_transformers()" in readme
    assert "kernelize(model, mode=Mode.INFERENCE)" in readme
    functions, layers = package_api(REPO_ROOT, "geglu")
    for name in functions + layers:
        assert f"| `{name}" in readme, name
    assert "| 1 | `v1` | " + ", ".join(f"`{v}`" for v in r1.variants) + " |" in readme
    for row in _variant_rows(geglu_builds.v1.build_dir):
        assert row in readme
    assert "falls back to it" in readme and "cu126" in readme  # cu12x torch -> the Triton variant
    assert "| this kernel (Triton) |" in readme and "| 8192 x 4096 x 14336 |" in readme  # benchmark summary
    assert f"kernels benchmark {GEGLU_REPO}@v1" in readme

    geglu_builds.v2.publish(hub)
    readme = _readme(hub)
    assert f'get_kernel("{GEGLU_REPO}", version=2)' in readme and "one variant of version 2" in readme
    assert "| 2 | `v2` | " in readme and "| 1 | `v1` | " in readme
    assert readme.index("| 2 | `v2` |") < readme.index("| 1 | `v1` |")
    assert f"kernels benchmark {GEGLU_REPO}@v2" in readme


@pytest.mark.parametrize("template, message", [
    ("# {{ nmae }}\n", r"CARD.md: 'nmae' is undefined; the names a card can use are: .*repo_id"),
    ("# x\n\n{% if repo_id %}\nno end\n", r"CARD.md, line 4: Unexpected end of template"),
])
def test_a_card_that_cannot_render_stops_the_publish_before_upload(hub, tmp_path, template, message):
    build = make_project(tmp_path / "p")
    make_variant(build)
    (tmp_path / "p" / "CARD.md").write_text(template)
    with pytest.raises(PublishError, match=f"Cannot render the card: .*{message}"):
        publish(build, endpoint=hub.url, progress=False)
    assert not (hub.root / "kernels").exists()  # nothing reached the server


def test_a_project_card_gets_kernel_builders_names(hub, tmp_path):
    """A CARD.md written for kernel-builder's upload renders the same way here."""
    build = make_project(tmp_path / "p")
    make_variant(build)
    (tmp_path / "p" / "CARD.md").write_text(textwrap.dedent("""\
        ---
        library_name: kernels
        {% if license %}license: {{ license }}
        {% endif %}---
        {{ repo_id }}: {% for f in functions %}{{ f }} {% endfor %}| {{ layers | join(",") }} |
        {% if has_benchmark %}benchmark{% else %}no benchmark{% endif %}
        """))
    publish(build, endpoint=hub.url, progress=False)
    readme = git(repo_dir(hub, f"{TRUSTED_ORG}/tiny"), "show", "main:README.md")
    # make_project has no torch-ext package, so no functions or layers; trim_blocks takes the newline after a tag
    assert readme == f"---\nlibrary_name: kernels\nlicense: apache-2.0\n---\n{TRUSTED_ORG}/tiny: |  |\nno benchmark"
