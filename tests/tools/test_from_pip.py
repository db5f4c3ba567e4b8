"""The README's transformers example with nothing but pip-installed packages: a fresh virtualenv whose packages are
this environment's installed ones (kernels, transformers, torch: what ``pip install kernels transformers`` gives)
and nothing of this checkout (no kerneltools, no torch-ext on the path, run with ``python -I`` from an empty
folder) loads the published kernel from the loopback Hub with ``get_kernel`` and maps every supported class with
the kernel's own ``register_transformers()``; also from a lock file, and through transformers' ``KernelConfig``."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.version import Version

from toolhelpers import GEGLU_REPO, REPO_ROOT, kernels_env

pytestmark = pytest.mark.ecosystem

USER_CODE = r'''
import importlib.util, json, sys
import torch, transformers
from kernels import Mode, get_kernel, get_locked_kernel, kernelize

out = {"kerneltools": importlib.util.find_spec("kerneltools") is not None,
       "checkout_on_path": [p for p in sys.path if (p == CHECKOUT or p.startswith(CHECKOUT + "/"))
                            and not p.endswith("site-packages")]}

if LOCKFILE:
    geglu = get_locked_kernel(REPO, lockfile=__import__("pathlib").Path(LOCKFILE))
else:
    geglu = get_kernel(REPO, version=1)
reg = geglu.register_transformers()          # the README's one call
out["skipped"] = reg.skipped
out["classes"] = sorted(reg.classes)
out["kernel_file"] = geglu.__file__


def tiny_gemma():
    torch.manual_seed(0)
    cfg = transformers.GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, vocab_size=128, max_position_embeddings=64)
    return transformers.GemmaForCausalLM(cfg).eval()


model = tiny_gemma()
ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    ref = model(ids).logits
kernelize(model, mode=Mode.INFERENCE)
with torch.no_grad():
    logits = model(ids).logits
names = [type(m).__name__ + ":" + m.forward.__qualname__ for m in model.modules()
         if type(m).__name__ in ("GemmaMLP", "GemmaRMSNorm")]
out["gemma"] = {"forwards": sorted(set(names)), "mlps": sum(n.startswith("GemmaMLP:") for n in names),
                "equal": bool(torch.equal(logits, ref))}

# DiffusionGemma's self-conditioning block and EoMT-DINOv3's gated MLP, as modules: forward and backward
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import (DiffusionGemmaSelfConditioning,
                                                                          DiffusionGemmaTextConfig)
from transformers.models.eomt_dinov3.modeling_eomt_dinov3 import EomtDinov3Config, EomtDinov3GatedMLP

def check(module, *inputs):
    import copy
    torch.manual_seed(0)
    mod = copy.deepcopy(module)
    kernelize(mod, mode=Mode.TRAINING)
    a = [t.clone().requires_grad_() for t in inputs]
    b = [t.clone().requires_grad_() for t in inputs]
    y, y_ref = mod(*a), module(*b)
    y.sum().backward(), y_ref.sum().backward()
    return {"forward": mod.forward.__qualname__, "equal": bool(torch.equal(y, y_ref)),
            "grads": all(torch.equal(p.grad, q.grad) for p, q in zip(a, b))}

torch.manual_seed(0)
x, s = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
sc = DiffusionGemmaSelfConditioning(DiffusionGemmaTextConfig(hidden_size=32, intermediate_size=64,
                                                             num_hidden_layers=1, num_attention_heads=2))
out["self_conditioning"] = check(sc, x, s)
eomt = EomtDinov3GatedMLP(EomtDinov3Config(hidden_size=32, intermediate_size=64, use_gated_mlp=True,
                                          num_hidden_layers=1, num_attention_heads=2))
out["eomt"] = check(eomt, x)

# transformers' own route: from_pretrained(use_kernels=True) kernelizes with the registered mapping (any device);
# from transformers 5.25 it does so by default
import tempfile
path = tempfile.mkdtemp()
tiny_gemma().save_pretrained(path)
loaded = {}
for name, kw in (("use_kernels", {"use_kernels": True}), ("default", {}), ("no_kernels", {"use_kernels": False})):
    m = transformers.GemmaForCausalLM.from_pretrained(path, **kw).eval()
    with torch.no_grad():
        loaded[name] = [m.model.layers[0].mlp.forward.__qualname__, bool(torch.equal(m(ids).logits, ref))]
out["from_pretrained"] = loaded
out["transformers"] = transformers.__version__

# the KernelConfig the kernel builds names the repository and commit it came from
cfg = geglu.transformers_kernel_config(tiny_gemma())
out["kernel_config"] = {k: [v[0], v[1]] for k, v in cfg.kernel_mapping.items()}
try:  # transformers accepts KernelConfig for accelerator models only
    tiny_gemma().set_use_kernels(True, cfg)
    out["kernel_config_cpu"] = "accepted"
except ValueError as e:
    out["kernel_config_cpu"] = str(e)
print("@@OUT@@" + json.dumps(out))
'''


def _fresh_venv(path: Path) -> Path:
    """A new virtualenv (no pip) that sees this environment's installed packages through a .pth file of plain
    paths: the site-packages folders, in their order, without running their own .pth files (so the editable
    kerneltools install, a .pth finder pointing at this checkout, stays out)."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(path)], check=True)
    py = path / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages")]  # (CI's venvs happen to sit in the checkout)
    assert sysconfig.get_path("purelib") in ours
    (Path(site) / "_installed_packages.pth").write_text("\n".join(ours) + "\n")
    return py


def _run(py: Path, hub, tmp: Path, lockfile: Path | None = None) -> dict:
    env = kernels_env(hub.url, tmp)
    env.pop("PYTHONPATH", None)
    code = f"REPO = {GEGLU_REPO!r}\nCHECKOUT = {str(REPO_ROOT)!r}\nLOCKFILE = {str(lockfile or '')!r}\n" + USER_CODE
    work = tmp / "user"
    work.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([str(py), "-I", "-c", code], capture_output=True, text=True, env=env, cwd=work, timeout=600)
    marker = [line for line in r.stdout.splitlines() if line.startswith("@@OUT@@")]
    assert r.returncode == 0 and marker, f"the user's script failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(marker[-1][len("@@OUT@@"):])


def test_readme_transformers_example_from_pip_installed_packages(hub, geglu_builds, tmp_path):
    from kerneltools.kernels_api import write_locks
    from kerneltools.transformers_kernels import GEGLU_CLASSES, NORM_CLASSES, ROPE_CLASSES

    published = geglu_builds.v1.publish(hub)
    py = _fresh_venv(tmp_path / "venv")
    out = _run(py, hub, tmp_path / "by-version")

    assert not out["kerneltools"] and out["checkout_on_path"] == [], out
    assert "kernels--" in out["kernel_file"] and published.commit in out["kernel_file"]  # from the Hub cache
    rows = [h for h in GEGLU_CLASSES + NORM_CLASSES + ROPE_CLASSES if h.layer]
    assert out["skipped"] == [] and out["classes"] == sorted(f"{h.module}.{h.name}" for h in rows)
    g = out["gemma"]
    assert g["forwards"] == ["GemmaMLP:GeGLUMLP.forward", "GemmaRMSNorm:GemmaRMSNorm.forward"] and g["mlps"] == 2, g
    assert g["equal"], g
    assert out["self_conditioning"] == {"forward": "GeGLUSelfConditioning.forward", "equal": True, "grads": True}
    assert out["eomt"] == {"forward": "GeGLUMLP.forward", "equal": True, "grads": True}

    fp = out["from_pretrained"]
    assert fp["use_kernels"] == ["GeGLUMLP.forward", True] and fp["no_kernels"] == ["GemmaMLP.forward", True], fp
    by_default = "GeGLUMLP.forward" if Version(out["transformers"]) >= Version("5.25") else "GemmaMLP.forward"
    assert fp["default"] == [by_default, True], fp

    layer = "GeGLUMLP"
    assert out["kernel_config"] == {f"geglu.{layer}": [f"{GEGLU_REPO}:{layer}", {"revision": published.commit,
                                                                                  "trust_remote_code": False}]}
    assert out["kernel_config_cpu"].startswith("Only devices in") and out["kernel_config_cpu"].endswith("got: cpu")

    lock = tmp_path / "kernels.lock"
    lock.write_text(write_locks([(GEGLU_REPO, 1, published.commit)]))
    locked = _run(py, hub, tmp_path / "by-lock", lockfile=lock)
    assert published.commit in locked["kernel_file"] and locked["gemma"]["equal"] and locked["gemma"]["mlps"] == 2
