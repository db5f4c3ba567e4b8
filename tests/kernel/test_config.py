"""The package's one configuration object: read once from the environment, changed with ``configure`` (also as a
context manager), validated with messages that say what is accepted."""

import importlib
import subprocess
import sys

import pytest


def test_defaults_and_environment_parsing(geglu):
    cfg = importlib.import_module(geglu.__name__ + ".runtime.config")
    assert cfg.Config.from_env({}) == cfg.Config("auto", True, "", True)
    env = {"GEGLU_BACKEND": " Triton ", "GEGLU_FUSED_MLP": "off", "GEGLU_CUDA_PLAN": " 128,P4 ",
           "GEGLU_PREBUILT": "No"}
    assert cfg.Config.from_env(env) == cfg.Config("triton", False, "128,p4", False)
    for name, value, message in (("GEGLU_FUSED_MLP", "maybe", "GEGLU_FUSED_MLP='maybe': expected 1"),
                                 ("GEGLU_PREBUILT", "fast", "GEGLU_PREBUILT='fast': expected 1"),
                                 ("GEGLU_BACKEND", "rocm", "GEGLU_BACKEND='rocm' is not a backend"),
                                 ("GEGLU_CUDA_PLAN", "256,3", "GEGLU_CUDA_PLAN='256,3' is not a launch plan")):
        with pytest.raises(ValueError, match=message):
            cfg.Config.from_env({name: value})


@pytest.mark.parametrize("plan, canonical, args", [
    ("", "", (0, 0, 0)), ("auto", "", (0, 0, 0)), (" AUTO ", "", (0, 0, 0)), ("256,1", "256,1", (256, 1, 0)),
    ("32,4", "32,4", (32, 4, 0)), ("256,2", "256,2", (256, 2, 0)), ("128, p2", "128,p2", (128, 1, 2)),
    ("64,p4", "64,p4", (64, 1, 4))])
def test_cuda_plan_forms(geglu, plan, canonical, args):
    cfg = importlib.import_module(geglu.__name__ + ".runtime.config")
    assert cfg.parse_cuda_plan(plan, "x") == canonical
    assert cfg.plan_args(canonical) == args


@pytest.mark.parametrize("plan", ["256", "256,3", "300,1", "16,1", "0,1", "96,8", "256,p3", "256,p", "abc",
                                  "256,1,x", ",2", "256;2", None, 256])
def test_cuda_plan_refuses_malformed_plans(geglu, plan):
    cfg = importlib.import_module(geglu.__name__ + ".runtime.config")
    with pytest.raises(ValueError, match=r"is not a launch plan; expected .* \"<threads>,<unroll>\""):
        cfg.parse_cuda_plan(plan, "GEGLU_CUDA_PLAN")
    before = geglu.get_config()
    with pytest.raises(ValueError, match="configure\\(cuda_plan\\)=.* is not a launch plan"):
        geglu.configure(cuda_plan=plan)
    assert geglu.get_config() == before


def test_cuda_plan_needs_the_compiled_library(geglu):
    """Without the compiled library (a Triton/CPU variant, a CPU torch) a plan is refused, the built-in choice
    ("" / "auto") is accepted, and nothing changes on the refusal."""
    before = geglu.get_config()
    with geglu.configure(cuda_plan="auto"):
        assert geglu.get_config().cuda_plan == ""
    direct = importlib.import_module(geglu.__name__ + ".runtime.direct")
    if direct.set_plan is not None:
        pytest.skip("this variant has the compiled library (the GPU tests force plans)")
    with pytest.raises(RuntimeError, match="cuda_plan='256,2'.*has no compiled CUDA library"):
        geglu.configure(cuda_plan="256,2")
    assert geglu.get_config() == before


def test_configure_changes_and_restores(geglu):
    before = geglu.get_config()
    with geglu.configure(fused_mlp=False, backend="triton") as now:
        assert now.fused_mlp is False and geglu.get_config().backend == "triton" and geglu.get_backend() == "triton"
    assert geglu.get_config() == before
    geglu.configure(prebuilt=False)
    try:
        assert not geglu.get_config().prebuilt
    finally:
        geglu.configure(prebuilt=before.prebuilt)
    assert geglu.get_config() == before


def test_configure_refuses_unknown_settings_and_values(geglu):
    with pytest.raises(TypeError, match="unknown setting.*fused_mpl.*expected backend, fused_mlp, cuda_plan or prebuilt"):
        geglu.configure(fused_mpl=False)
    with pytest.raises(TypeError, match="fused_training setting .* is no longer offered.*Remove it"):
        geglu.configure(fused_training=True)
    with pytest.raises(TypeError, match=r"fused_mlp='no'\): expected True or False"):
        geglu.configure(fused_mlp="no")
    with pytest.raises(ValueError, match="is not a backend; expected one of auto, cuda, triton"):
        geglu.configure(backend="rocm")
    if not geglu.HAS_CUDA_LIB:
        with pytest.raises(RuntimeError, match="has no compiled CUDA library"):
            geglu.configure(backend="cuda")
    assert geglu.get_config().backend == "auto"


def test_environment_is_read_at_import(build_dir, tmp_path):
    """GEGLU_* are read once, when the package is imported (here in a fresh process); the setting that is no longer
    offered (GEGLU_FUSED_TRAINING) is named in a warning, not ignored silently."""
    code = ("import kernels, sys; g = kernels.get_local_kernel(__import__('pathlib').Path(sys.argv[1])); "
            "c = g.get_config(); print(c.backend, c.fused_mlp, c.prebuilt, c.cuda_plan)")
    env = {"GEGLU_BACKEND": "triton", "GEGLU_FUSED_MLP": "0", "GEGLU_PREBUILT": "0", "GEGLU_CUDA_PLAN": "64,P2",
           "GEGLU_FUSED_TRAINING": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code, str(build_dir)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["triton", "False", "False", "64,p2"]
    assert "GEGLU_FUSED_TRAINING is set, but the fused_training setting" in out.stderr, out.stderr


def test_leaving_a_configure_block_restores_the_settings_even_if_the_plan_setter_raises(geglu, monkeypatch):
    cfg = importlib.import_module(geglu.__name__ + ".runtime.config")
    before = cfg.current
    calls = []

    def setter(threads, unroll, stages):
        calls.append((threads, unroll, stages))
        return 0 if len(calls) == 1 else 1  # takes the block's plan, refuses the way back

    monkeypatch.setattr(cfg, "_set_plan", setter)
    with pytest.raises(ValueError, match="refused the plan"):
        with cfg.configure(cuda_plan="128,2", fused_mlp=not before.fused_mlp):
            assert cfg.current.cuda_plan == "128,2"
    assert calls == [(128, 2, 0), cfg.plan_args(before.cuda_plan)]
    assert cfg.current == before
