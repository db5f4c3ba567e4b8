"""build.toml follows kernel-builder's edition-5 rules (kernel-builder itself is not installable here, so the
rules from its kernels-data schema are checked key by key); flake.nix parses and uses the current template."""

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = {"cpu", "cuda", "metal", "rocm", "xpu", "cann", "neuron", "tpu"}
DEPENDS = {"torch", "cutlass_2_10", "cutlass_3_5", "cutlass_3_6", "cutlass_3_8", "cutlass_3_9", "cutlass_4_0",
           "cutlass_4_4", "cutlass_4_5", "sycl_tla", "metal-cpp"}
GENERAL_KEYS = {"name", "version", "edition", "license", "backends", "upstream", "source", "python-depends",
                "kernel-depends", "hub", "cuda", "xpu", "neuron", "tpu"}
TORCH_KEYS = {"src", "include", "pyext", "minver", "maxver", "cxx-flags", "stable-abi"}
KERNEL_SHARED = {"backend", "depends", "src", "include", "cxx-flags"}
KERNEL_PER_BACKEND = {"cuda": {"cuda-capabilities", "cuda-flags", "cuda-minver"}, "rocm": {"rocm-archs", "hip-flags"},
                      "xpu": {"sycl-flags"}, "cpu": set(), "metal": set()}


@pytest.fixture(scope="module")
def config():
    with (ROOT / "build.toml").open("rb") as f:
        return tomllib.load(f)


def test_general(config):
    assert set(config) <= {"general", "torch", "torch-noarch", "tvm-ffi", "kernel"}
    assert sum(k in config for k in ("torch", "torch-noarch", "tvm-ffi")) == 1, "exactly one framework table"
    g = config["general"]
    assert set(g) <= GENERAL_KEYS, f"unknown [general] keys: {set(g) - GENERAL_KEYS}"
    assert g["edition"] == 5
    assert re.fullmatch(r"[a-z][-a-z0-9]*[a-z0-9]", g["name"]) and g["name"] == "geglu"
    assert isinstance(g["version"], int) and g["version"] >= 1
    assert isinstance(g["license"], str) and g["license"]
    assert set(g["backends"]) == {"cuda", "cpu"}
    assert set(g.get("hub", {})) <= {"repo-id", "branch"}
    kernels_data = pytest.importorskip("kernels_data")
    assert kernels_data.KernelName(g["name"]).python_name == "geglu"


def test_torch_table(config):
    t = config["torch"]
    assert set(t) <= TORCH_KEYS, f"unknown [torch] keys: {set(t) - TORCH_KEYS}"
    assert t["src"], "[torch] src is required"
    for src in t["src"]:
        assert (ROOT / src).is_file(), f"[torch] src {src} does not exist"
    for backend, version in t.get("stable-abi", {}).items():
        assert backend in config["general"]["backends"]
        assert re.fullmatch(r"\d+\.\d+", version)


def test_kernel_tables(config):
    caps_seen = set()
    for name, k in config["kernel"].items():
        backend = k["backend"]
        assert backend in BACKENDS and backend in config["general"]["backends"]
        allowed = KERNEL_SHARED | KERNEL_PER_BACKEND[backend]
        assert set(k) <= allowed, f"[kernel.{name}] unknown keys: {set(k) - allowed}"
        assert set(k["depends"]) <= DEPENDS
        assert k["src"], f"[kernel.{name}] src is required"
        for src in k["src"]:
            assert (ROOT / src).is_file(), f"[kernel.{name}] src {src} does not exist"
        for cap in k.get("cuda-capabilities", []):
            assert re.fullmatch(r"\d+\.\d+[af]?(\+PTX)?", cap), cap
            caps_seen.add(cap)
    assert {"8.0", "9.0", "12.0"} <= caps_seen, "cuda-capabilities must cover 8.0 through 12.0"


def test_flake_parses():
    text = (ROOT / "flake.nix").read_text()
    assert 'kernel-builder.url = "github:huggingface/kernels"' in text
    assert "genKernelFlakeOutputs" in text
    if shutil.which("nix-instantiate") is None:
        pytest.skip("nix-instantiate is not installed (Debian: apt-get install nix-bin); .ci/run installs it")
    subprocess.run(["nix-instantiate", "--parse", str(ROOT / "flake.nix")], check=True, capture_output=True)
