"""build.toml follows kernel-builder's edition-5 rules, checked with kernels' own parser (kernel-builder's
kernels-data types, ``kernels._rust.Build``), plus what this repository needs of it; flake.nix parses and uses
the current template."""

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def config():
    with (ROOT / "build.toml").open("rb") as f:
        return tomllib.load(f)


@pytest.mark.ecosystem
def test_build_toml_passes_kernels_own_parser():
    from kerneltools.kernels_api import build_backend, open_build_toml

    parsed = open_build_toml(ROOT)
    assert sorted(map(str, parsed.general.backends)) == sorted(map(str, (build_backend("cpu"), build_backend("cuda"))))


@pytest.mark.parametrize("edit, message", [
    (('cuda-capabilities = ', 'cuda_capabilities = '), "Unknown field cuda_capabilities"),
    (('name = "geglu"', 'name = "geglu_kernel"'), "Invalid kernel name `geglu_kernel`"),
    (('edition = 5\n', ''), "unsupported legacy format"),
    (('depends = ["torch"]', 'depends = ["cutlass_3_x"]'), "cutlass_3_x"),
])
@pytest.mark.ecosystem
def test_kernels_parser_rejects_what_kernel_builder_rejects(tmp_path, edit, message):
    """The parser really checks: the same file with one kernel-builder rule broken is refused."""
    from kerneltools.kernels_api import open_build_toml

    text = (ROOT / "build.toml").read_text()
    assert edit[0] in text
    (tmp_path / "build.toml").write_text(text.replace(edit[0], edit[1], 1))
    with pytest.raises(ValueError, match=message):
        open_build_toml(tmp_path)


def test_what_this_repository_needs(config):
    g = config["general"]
    assert g["name"] == "geglu" and g["edition"] == 5 and g["version"] >= 1
    assert set(g["backends"]) == {"cuda", "cpu"}
    assert config["torch"]["stable-abi"] == {"cuda": "2.10"}
    sources = list(config["torch"]["src"]) + [s for k in config["kernel"].values() for s in k["src"]]
    missing = [s for s in sources if not (ROOT / s).is_file()]
    assert not missing, f"build.toml lists sources that do not exist: {missing}"
    caps = {c for k in config["kernel"].values() for c in k.get("cuda-capabilities", [])}
    assert {"8.0", "9.0", "12.0"} <= caps, "cuda-capabilities must cover 8.0 through 12.0"
    assert set(g["hub"]) == {"repo-id"}, "[general.hub] holds the repo id (the branch comes from the version)"


def test_flake_parses():
    text = (ROOT / "flake.nix").read_text()
    assert 'kernel-builder.url = "github:huggingface/kernels"' in text
    assert "genKernelFlakeOutputs" in text
    if shutil.which("nix-instantiate") is None:
        pytest.skip("nix-instantiate is not installed (Debian: apt-get install nix-bin); .ci/run installs it")
    subprocess.run(["nix-instantiate", "--parse", str(ROOT / "flake.nix")], check=True, capture_output=True)
