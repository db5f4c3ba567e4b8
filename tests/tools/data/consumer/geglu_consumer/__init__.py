"""A model that takes its gated-MLP forward from the GeGLU kernel on the Hub, at the commit kernels.lock pins.

kernels 0.17.2 cannot find the lock file by itself (its package-metadata lookup is broken), so the path is passed.
Offline (HF_HUB_OFFLINE=1) this works once `python -m kerneltools prefetch --lockfile kernels.lock` has run.
"""

from pathlib import Path

import torch
from kernels import LockedLayerRepository, Mode, get_locked_kernel, kernelize, use_kernel_forward_from_hub
from kernels import use_kernel_mapping
from torch import nn

REPO_ID = "geglu-kernels/geglu"
LOCKFILE = Path(__file__).resolve().parent.parent / "kernels.lock"  # written by `kernels lock <project dir>`


@use_kernel_forward_from_hub("GeGLUMLP")
class GatedMLP(nn.Module):
    """The shape of transformers' Gemma MLP: down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)
        self.act_fn = nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def geglu_kernel(lockfile: Path = LOCKFILE):
    """The kernel module itself, at the locked commit."""
    return get_locked_kernel(REPO_ID, lockfile=lockfile)


def kernelized(model: nn.Module, lockfile: Path = LOCKFILE, mode: Mode = Mode.INFERENCE) -> nn.Module:
    """Swap in the locked kernel's GeGLUMLP forward for every GatedMLP of model (in place)."""
    repo = LockedLayerRepository(REPO_ID, lockfile=lockfile, layer_name="GeGLUMLP")
    with use_kernel_mapping({"GeGLUMLP": {"cpu": repo, "cuda": repo}}):
        return kernelize(model, mode=mode, device=next(model.parameters()).device.type)
