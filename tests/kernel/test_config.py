"""The package's one configuration object: read once from the environment, changed with ``configure`` (also as a
context manager), validated with messages that say what is accepted."""

import importlib
import subprocess
import sys

import pytest


def test_defaults_and_environment_parsing(geglu):
    cfg = importlib.import_module(geglu.__name__ + "._config")
    assert cfg.Config.from_env({}) == cfg.Config("auto", True, False)
    env = {"GEGLU_BACKEND": " Triton ", "GEGLU_FUSED_MLP": "off", "GEGLU_FUSED_TRAINING": "YES"}
    assert cfg.Config.from_env(env) == cfg.Config("triton", False, True)
    for name, value, message in (("GEGLU_FUSED_MLP", "maybe", "GEGLU_FUSED_MLP='maybe': expected 1"),
                                 ("GEGLU_FUSED_TRAINING", "fast", "GEGLU_FUSED_TRAINING='fast': expected 1"),
                                 ("GEGLU_BACKEND", "rocm", "GEGLU_BACKEND='rocm' is not a backend")):
        with pytest.raises(ValueError, match=message):
            cfg.Config.from_env({name: value})


def test_configure_changes_and_restores(geglu):
    before = geglu.get_config()
    with geglu.configure(fused_mlp=False, backend="triton") as now:
        assert now.fused_mlp is False and geglu.get_config().backend == "triton" and geglu.get_backend() == "triton"
    assert geglu.get_config() == before
    geglu.configure(fused_training=True)
    try:
        assert geglu.get_config().fused_training
    finally:
        geglu.configure(fused_training=before.fused_training)
    assert geglu.get_config() == before


def test_configure_refuses_unknown_settings_and_values(geglu):
    with pytest.raises(TypeError, match="unknown setting.*fused_mpl.*expected backend, fused_mlp or fused_training"):
        geglu.configure(fused_mpl=False)
    with pytest.raises(TypeError, match=r"fused_mlp='no'\): expected True or False"):
        geglu.configure(fused_mlp="no")
    with pytest.raises(ValueError, match="is not a backend; expected one of auto, cuda, triton"):
        geglu.configure(backend="rocm")
    if not geglu.HAS_CUDA_LIB:
        with pytest.raises(RuntimeError, match="has no compiled CUDA library"):
            geglu.configure(backend="cuda")
    assert geglu.get_config().backend == "auto"


def test_environment_is_read_at_import(build_dir, tmp_path):
    """GEGLU_* are read once, when the package is imported (here in a fresh process)."""
    code = ("import kernels, sys; g = kernels.get_local_kernel(__import__('pathlib').Path(sys.argv[1])); "
            "c = g.get_config(); print(c.backend, c.fused_mlp, c.fused_training)")
    env = {"GEGLU_BACKEND": "triton", "GEGLU_FUSED_MLP": "0", "GEGLU_FUSED_TRAINING": "1", "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code, str(build_dir)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["triton", "False", "True"]
