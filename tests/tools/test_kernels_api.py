"""What the project uses of kernels and transformers, checked against the installed releases: CI runs this file with
the newest pins (requirements.txt) and with the oldest supported pair (requirements-lower.txt, scripts/test-lower.sh).
A failure here names the missing piece; kerneltools/kernels_api.py is the one place that reads kernels' private
modules, and torch-ext/geglu/_transformers.py uses only the public names checked below."""

from __future__ import annotations

import importlib

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kerneltools import kernels_api

pytestmark = pytest.mark.ecosystem

# the kernel's transformers integration (torch-ext/geglu/_transformers.py) and kerneltools call these
KERNELS_PUBLIC = ("get_kernel", "get_local_kernel", "get_locked_kernel", "load_kernel", "kernelize", "Mode",
                  "LayerRepository", "LocalLayerRepository", "LockedLayerRepository", "register_kernel_mapping",
                  "use_kernel_mapping", "replace_kernel_forward_from_hub", "get_loaded_kernels", "Metadata")
TRANSFORMERS_RANGE = SpecifierSet(">=5.22.2,<5.26")


def test_the_installed_kernels_is_in_the_supported_range_and_the_adapter_reads_it():
    version = kernels_api.check()
    assert Version(version) in SpecifierSet(kernels_api.SUPPORTED), (
        f"kernels {version} is outside kerneltools.kernels_api.SUPPORTED ({kernels_api.SUPPORTED}): check the "
        "adapter against it and widen the range (and the README's)")


def test_kernels_public_names_the_project_uses():
    import kernels

    missing = [n for n in KERNELS_PUBLIC if n not in kernels.__all__]
    assert not missing, f"kernels {kernels.__version__} no longer exports {missing}"


def test_transformers_names_the_integration_uses():
    import transformers

    assert Version(transformers.__version__) in TRANSFORMERS_RANGE, (
        f"transformers {transformers.__version__} is outside the supported {TRANSFORMERS_RANGE} (README)")
    assert hasattr(transformers, "KernelConfig")
    hub_kernels = importlib.import_module("transformers.integrations.hub_kernels")
    assert callable(getattr(hub_kernels, "get_kernel_mapping_transformers", None)), (
        "transformers.integrations.hub_kernels.get_kernel_mapping_transformers is gone: register_transformers "
        "reads it to silence kernelize's 'No kernel mapping' warnings")
    moe = importlib.import_module("transformers.integrations.moe")
    assert callable(getattr(moe, "_default_apply_gate", None)), (
        "transformers.integrations.moe._default_apply_gate is gone: the experts' gate layer stands in for it")


def test_a_moved_module_is_named_with_the_installed_version():
    import kernels

    with pytest.raises(kernels_api.KernelsApiError) as e:
        kernels_api._module("kernels._nowhere.variants", "kernels.nowhere")
    msg = str(e.value)
    assert f"kernels {kernels.__version__} has none of the modules kernels._nowhere.variants, kernels.nowhere" in msg
    assert "update kerneltools/kernels_api.py" in msg


def test_a_missing_name_is_named():
    with pytest.raises(kernels_api.KernelsApiError, match=r"kernels\._rust has no NoSuchType"):
        kernels_api._attr(importlib.import_module("kernels._rust"), "NoSuchType")


def test_lock_commits_are_strings():
    sha = "0123456789abcdef0123456789abcdef01234567"
    [(dep, commit)] = kernels_api.read_locks(kernels_api.write_locks([("geglu-kernels/geglu", 1, sha)]))
    assert commit == sha and isinstance(commit, str)
    assert (dep.repo_id, kernels_api.dependency_version(dep), kernels_api.dependency_revision(dep)) == (
        "geglu-kernels/geglu", 1, None)
