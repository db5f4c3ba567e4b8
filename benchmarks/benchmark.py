"""Workloads for ``kernels benchmark``: the GeGLU kernel against eager PyTorch, both GELUs, the three input forms.

    kernels benchmark geglu-kernels/geglu@v1 [--iterations 100] [--warmup 10]

publish puts this file on the version branch beside ``build/``. The runner loads the kernel into ``self.kernel``,
sets ``self.device`` (cuda on a CUDA torch, else cpu), seeds torch, calls ``setup`` and times each
``benchmark_<workload>``; ``verify_<workload>`` returns eager PyTorch's result for the same inputs, which the runner
compares with ``self.out`` and times as the reference (its "Ref" and "Speedup" columns).

Workloads of each class (one GELU form):

- ``forward_split``: ``geglu(gate, up)`` = ``F.gelu(gate) * up``;
- ``forward_packed``: ``geglu_packed(x)`` = ``F.gelu(x[..., :d]) * x[..., d:]``;
- ``forward_packed_act_second``: ``geglu_packed(x, act_first=False)`` = ``x[..., :d] * F.gelu(x[..., d:])``;
- ``forward_backward_*``: the same forward and its backward through autograd, for an output gradient ``dy``
  (``self.out``: the input gradients).

Shapes: an 8192-token activation of Gemma 7B's MLP (d = 14336, bf16) on a GPU; a small fp32 one on CPU, where the
kernel runs eager's own operators.
"""

import torch
import torch.nn.functional as F
from kernels import Benchmark

GPU_SHAPE = (8192, 14336)  # rows, d (the output's width; the packed input is 2d wide)
CPU_SHAPE = (64, 512)


class _Workloads:
    """The workloads; each subclass of Benchmark below picks the GELU form."""

    approximate = "none"
    seed = 0

    @property
    def out(self):
        """What the runner compares with verify_*: gradients (a tuple) as one flat tensor. Concatenated only when
        read, so the timed calls do not pay for the copy."""
        out = self._out
        return torch.cat([t.flatten() for t in out]) if isinstance(out, tuple) else out

    @out.setter
    def out(self, value):
        self._out = value

    def setup(self):
        rows, d = GPU_SHAPE if self.device == "cuda" else CPU_SHAPE
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.x = (torch.randn(rows, 2 * d, device=self.device) * 2).to(dtype)  # packed: [first half | second half]
        self.gate, self.up = (t.contiguous() for t in self.x.chunk(2, dim=-1))
        self.dy = torch.randn(rows, d, device=self.device).to(dtype)

    def _gelu(self, t):
        return F.gelu(t, approximate=self.approximate)

    # --- eager PyTorch, the reference -------------------------------------------------------------------------

    def _eager_split(self, gate, up):
        return self._gelu(gate) * up

    def _eager_packed(self, x, act_first=True):
        a, b = x.chunk(2, dim=-1)
        return self._gelu(a) * b if act_first else a * self._gelu(b)

    def _grads(self, fn, *inputs):
        leaves = [t.detach().requires_grad_() for t in inputs]
        return torch.autograd.grad(fn(*leaves), leaves, self.dy)

    def _flat(self, grads):
        return torch.cat([t.flatten() for t in grads])

    # --- forward ------------------------------------------------------------------------------------------------

    def benchmark_forward_split(self):
        self.out = self.kernel.geglu(self.gate, self.up, self.approximate)

    def verify_forward_split(self):
        return self._eager_split(self.gate, self.up)

    def benchmark_forward_packed(self):
        self.out = self.kernel.geglu_packed(self.x, self.approximate)

    def verify_forward_packed(self):
        return self._eager_packed(self.x)

    def benchmark_forward_packed_act_second(self):
        self.out = self.kernel.geglu_packed(self.x, self.approximate, act_first=False)

    def verify_forward_packed_act_second(self):
        return self._eager_packed(self.x, act_first=False)

    # --- forward and backward -------------------------------------------------------------------------------

    def benchmark_forward_backward_split(self):
        self.out = self._grads(lambda g, u: self.kernel.geglu(g, u, self.approximate), self.gate, self.up)

    def verify_forward_backward_split(self):
        return self._flat(self._grads(self._eager_split, self.gate, self.up))

    def benchmark_forward_backward_packed(self):
        self.out = self._grads(lambda x: self.kernel.geglu_packed(x, self.approximate), self.x)

    def verify_forward_backward_packed(self):
        return self._flat(self._grads(self._eager_packed, self.x))

    def benchmark_forward_backward_packed_act_second(self):
        self.out = self._grads(lambda x: self.kernel.geglu_packed(x, self.approximate, act_first=False), self.x)

    def verify_forward_backward_packed_act_second(self):
        return self._flat(self._grads(lambda x: self._eager_packed(x, act_first=False), self.x))


class GeGLUErf(_Workloads, Benchmark):
    """``gelu(a) * b`` with the exact (erf) GELU."""

    approximate = "none"


class GeGLUTanh(_Workloads, Benchmark):
    """``gelu(a) * b`` with the tanh approximation of the GELU."""

    approximate = "tanh"
