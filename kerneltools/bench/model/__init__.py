"""Whole-model benchmark: what ``kernelize`` gives a transformers model in the modes people run.

Models are built from real transformers configs with random weights (no downloads):

* ``gemma3-4b``: Gemma 3 4B's text model (hidden 2560, intermediate 10240, 8 heads, 4 KV heads, head_dim 256,
  vocab 262208), 16 of its 34 layers;
* ``gemma3-12b``: Gemma 3 12B's text model (hidden 3840, intermediate 15360, 16 heads, 8 KV heads, head_dim 256),
  8 of its 48 layers;
* ``gemma2-2b``: Gemma 2 2B (hidden 2304, intermediate 9216, 26 layers, soft-capping: eager attention);
* ``t5-v1.1-base``: T5 v1.1 base (d_model 768, d_ff 2048, 12 + 12 layers, gated-gelu), encoder-decoder;
* ``t5-v1.1-large``: T5 v1.1 large (d_model 1024, d_ff 2816, 24 + 24 layers, 16 heads), encoder-decoder;
* ``modernbert-base``: ModernBERT base (hidden 768, intermediate 1152, 22 layers), encoder;
* ``gemma4-moe``: a Gemma 4 MoE text model with google/gemma-4-26B-A4B's hidden size (2816) and experts (128,
  top-8, moe_intermediate_size 704; the dense MLP beside them, attention and vocabulary are Gemma4TextConfig's
  defaults, which are not that checkpoint's), 6 of its 30 layers.

Each model runs as ``eager``, ``kernelized`` (``kernels.kernelize`` with this project's mapping,
``register_geglu_kernels``, the kernel loaded by kernels' loader from ``--build-dir`` through ``LOCAL_KERNELS``),
``compile`` (``torch.compile`` of the model's forward) and ``kernelized+compile``, in interleaved rounds (the order
rotates every round), and reports per part the median time, tokens/s, and the median [min, max] of the per-round
ratios to eager and to compile; the first call's time (compilation), the peak memory of one call, and the number
of Dynamo graphs over a sweep of sequence lengths. ``copy`` and ``copy+compile``, asked for by name, run a plain
deep copy of the eager model: an A/A control whose ratios show the benchmark's own bias and noise between two
identical models.

Parts: ``prefill`` (batch x seq tokens, filling an empty KV cache made before the call and returning the logits of
the last position, as ``generate``'s first step does; encoders: the whole forward), ``decode`` (greedy ``generate``
of ``--new-tokens`` tokens at each of the ``--decode-batches``, 1 and 8 by default, after a short prompt; not for
encoders; the compile modes only with ``--compile-decode``: ``generate`` with a static cache, compiling its decoding
step), ``train`` (forward, backward and an AdamW step).

    python -m kerneltools bench --model gemma3-4b [--model t5-v1.1-base ...] [--parts prefill,decode,train]
        [--modes eager,kernelized,compile,kernelized+compile] [--rounds 5] [--out DIR]

``--processes N`` repeats the run in N fresh processes, each compiling the modes in a rotated order, and pools
their rounds (each process's report stays in ``OUT/process-i``): a host-bound compiled model's ratio moves with the
process's state by more than its spread within one process, so that one process is one sample.

``--tiny`` shrinks every model to a few layers of small width (for the CPU test; timings then mean nothing).

The package, one concern a module: ``models`` (the configs, modes and parts, ``build_models``), ``rounds`` (a part
timed in interleaved rounds, ``run_part``), ``profiling`` (``profile_part``, ``call_cost``, ``count_graphs``),
``runner`` (a run in this process), ``processes`` (``--processes``, ``--pool``, ``--merge``), ``report`` (model.json,
model.md, model.png) and ``cli`` (the options, ``run``, ``main``).
"""

from .cli import add_arguments, main, run
from .models import (DECODE_BATCHES, DEFAULT_MODES, MODELS, MODES, PARTS, TINY_SHAPES, ModelSpec, Setup, build_models,
                     own_code, with_layers)
from .processes import _run_child, merge, pool, run_processes
from .profiling import KERNEL_CATEGORIES, call_cost, count_graphs, profile_part
from .report import _cell, plot, summary_markdown, to_markdown, write
from .rounds import _ids, generate_cache, make_part, prefill_kwargs, run_part
from .runner import run_here, run_model

__all__ = ["DECODE_BATCHES", "DEFAULT_MODES", "KERNEL_CATEGORIES", "MODELS", "MODES", "PARTS", "TINY_SHAPES",
           "ModelSpec", "Setup", "add_arguments", "build_models", "call_cost", "count_graphs", "generate_cache",
           "main", "make_part", "merge", "own_code", "plot", "pool", "prefill_kwargs", "profile_part", "run",
           "run_here", "run_model", "run_part", "run_processes", "summary_markdown", "to_markdown", "with_layers",
           "write", "_cell", "_ids", "_run_child"]
