"""Tensor parallelism and FSDP2 with the kernel: eager against kernelized on a Gemma 3 4B-shaped model (hidden 2560,
intermediate 10240, 16 layers, random weights from a config; nothing is downloaded).

Phases, each timed in interleaved rounds (eager, kernelized, kernelized, eager, ...; the ratio eager/kernelized of
each round and their median):

* ``prefill``: TP forward of ``--batch`` x ``--prefill`` tokens (last-token logits, as generation does);
* ``decode``: TP, ``--decode-steps`` one-token steps on a KV cache prefilled with ``--prefill`` tokens;
* ``train``: an FSDP2 training step (``fully_shard`` on each decoder layer and the root; forward + backward of
  ``--train-batch`` x ``--train-seq`` tokens), Mode.TRAINING.

TP is transformers' ``tp_plan="auto"`` (the Gemma config's plan: gate/up colwise, down rowwise) when the world size
is above 1, and ``parallelize_module`` with the same plan (torch's ColwiseParallel / RowwiseParallel) on a
1-process mesh, so that one GPU runs the DTensor code too. One kernelized step of each phase runs under
torch.profiler: the report lists the GPU kernels whose names contain "geglu" (ours: the Triton ``_geglu_*_kernel``
and fused ``*_gate_up_geglu_kernel``, the CUDA library's ``geglu_fwd_kernel`` / ``geglu_bwd_kernel``) with their
counts and times, and the shapes of the gate projection's local outputs (the kernel's inputs: ``[.., I / world]``
under TP).

    torchrun --standalone --nproc-per-node 2 -m kerneltools.bench.distributed --build-dir build \\
        --out benchmarks/results/h200x2/distributed.json
    python -m kerneltools.bench.distributed --build-dir build            # one GPU: a 1-process mesh
    torchrun --standalone --nproc-per-node 2 -m kerneltools.bench.distributed --device cpu --tiny ...  # smoke test

The kernel is loaded from ``--build-dir`` with ``kernels.get_local_kernel`` and mapped for kernelize with
``LocalLayerRepository`` (the classes of ``kerneltools.transformers_kernels``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

GEMMA3_4B = dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=16, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=256, vocab_size=262144, max_position_embeddings=8192,
                 sliding_window=1024, query_pre_attn_scalar=256)
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            head_dim=16, vocab_size=128, max_position_embeddings=256, sliding_window=16, query_pre_attn_scalar=16)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kerneltools.bench.distributed", description=__doc__.split("\n")[0])
    p.add_argument("--build-dir", type=Path, default=Path("build"), help="kernel build tree (kerneltools build)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--tiny", action="store_true", help="a tiny config (tests, CPU)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--phases", default="prefill,decode,train", help="comma-separated: prefill, decode, train")
    p.add_argument("--batch", type=int, default=None, help="TP batch (default 4; tiny 2)")
    p.add_argument("--prefill", type=int, default=None, help="prefill tokens per sequence (default 2048; tiny 16)")
    p.add_argument("--decode-steps", type=int, default=None, help="decode steps per round (default 32; tiny 4)")
    p.add_argument("--train-batch", type=int, default=None, help="per-rank training batch (default 1; tiny 2)")
    p.add_argument("--train-seq", type=int, default=None, help="training sequence length (default 2048; tiny 16)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per variant (default 10; tiny 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls of each variant first")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="where the random-weight checkpoint is saved for from_pretrained (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="write the report (JSON) here (rank 0)")
    return p


def _defaults(args) -> None:
    tiny = args.tiny
    for name, big, small in (("batch", 4, 2), ("prefill", 2048, 16), ("decode_steps", 32, 4), ("train_batch", 1, 2),
                             ("train_seq", 2048, 16), ("rounds", 10, 2)):
        if getattr(args, name) is None:
            setattr(args, name, small if tiny else big)


def _init(device: str):
    import torch
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    if "RANK" in os.environ:  # torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(backend, rank=rank, world_size=world)
    else:  # one process: a 1-process group, so the DTensor code runs as it would on more
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def _map_kernel(build_dir: Path) -> None:
    from kernels import LocalLayerRepository, Mode, register_kernel_mapping

    from kerneltools.transformers_kernels import GEGLU_CLASSES, register_geglu_kernels

    reg = register_geglu_kernels(devices=("cuda", "cpu"), register=False)
    modes = (Mode.INFERENCE, Mode.TRAINING, Mode.INFERENCE | Mode.TORCH_COMPILE, Mode.TRAINING | Mode.TORCH_COMPILE)
    repos: dict = {}
    mapping = {}
    for h in GEGLU_CLASSES:
        if h.key in reg.mapping:
            repo = repos.setdefault(h.layer, LocalLayerRepository(build_dir, layer_name=h.layer))
            mapping[h.key] = {dev: {m: repo for m in modes} for dev in ("cuda", "cpu")}
    register_kernel_mapping(mapping, inherit_mapping=False)


class _Timer:
    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def __call__(self, fn) -> float:
        """Milliseconds of one call of fn, all ranks together (barrier before, synchronize after)."""
        import torch
        import torch.distributed as dist

        dist.barrier()
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if self.cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        # the slowest rank's time: a step is as fast as its slowest shard
        t = torch.tensor([dt], dtype=torch.float64, device="cuda" if self.cuda else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item()) * 1e3


def _interleaved(timer, fns: dict, rounds: int, warmup: int, before: dict | None = None) -> dict:
    """fns: {"eager": fn, "kernelized": fn}. Alternating order per round; per-round ratios eager / kernelized.
    ``before``: an untimed call before each call of the same key (e.g. a prefill before decode steps)."""
    def call(k, timed):
        if before is not None:
            before[k]()
        return timer(fns[k]) if timed else fns[k]()

    for _ in range(warmup):
        for k in fns:
            call(k, False)
    times = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            times[k].append(call(k, True))
    ratios = [e / k for e, k in zip(times["eager"], times["kernelized"])]
    return {"ms": {k: statistics.median(v) for k, v in times.items()}, "rounds_ms": times,
            "ratio_eager_over_kernelized": statistics.median(ratios), "round_ratios": ratios}


def _profile(fn, device: str, mlp_modules) -> dict:
    """One call under torch.profiler: our kernels (names with "geglu") and the shapes of the gate projections' local
    outputs (the kernel's input: rows x this rank's share of the intermediate size)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    shapes = []

    def record(mlp, args):  # a hook on the MLP, not on its projections (hooked projections change GeGLUMLP's path)
        x, w = args[0], mlp.gate_proj.weight
        w = w.to_local() if hasattr(w, "to_local") else w
        shapes.append(list(x.shape[:-1]) + [w.shape[0]])
    hooks = [m.register_forward_pre_hook(record) for m in mlp_modules]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    try:
        with profile(activities=acts) as prof:
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
    finally:
        for h in hooks:
            h.remove()
    kernels = {}
    for e in prof.key_averages():  # GPU kernels and CPU-side ops / autograd nodes alike
        if "geglu" in e.key.lower():
            dev_us = getattr(e, "device_time_total", None)
            if dev_us is None:
                dev_us = getattr(e, "cuda_time_total", 0.0)
            kernels[e.key] = {"count": e.count, "device_time_us": float(dev_us), "cpu_time_us": float(e.cpu_time_total)}
    return {"geglu_events": kernels, "gate_local_shapes": sorted({tuple(s) for s in shapes})}


def _mlps(model):
    return [layer.mlp for layer in model.model.layers]


def _torch_tp(model, mesh) -> None:
    """The model's own plan (colwise / rowwise entries) through torch's parallelize_module."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {}
    for key, style in model.model.config.base_model_tp_plan.items():
        if style in styles:
            plan["model." + key] = styles[style]()
    parallelize_module(model, mesh, plan)


def run(args, log=print) -> dict:
    import torch
    import torch.distributed as dist
    import transformers
    from kernels import Mode, kernelize
    from torch.distributed.device_mesh import init_device_mesh

    from kerneltools.bench.common import cache_arg, output_cache

    _defaults(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    rank, world = _init(device)
    say = log if rank == 0 else (lambda *a, **k: None)
    report: dict = {"world_size": world, "device": device, "dtype": str(dtype).replace("torch.", ""),
                    "config": TINY if args.tiny else GEMMA3_4B, "torch": torch.__version__,
                    "transformers": transformers.__version__, "phases": {}}
    if device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    try:
        import kernels

        geglu = kernels.get_local_kernel(args.build_dir.resolve())
        report["kernel"] = {"module": geglu.__name__, "backend": geglu.get_backend(), "cuda_lib": geglu.HAS_CUDA_LIB}
        _map_kernel(args.build_dir.resolve())
        cfg = transformers.Gemma3TextConfig(**(TINY if args.tiny else GEMMA3_4B))
        tmp = None
        model_dir = args.model_dir
        if model_dir is None:  # rank 0's temp dir, for every rank (one host: torchrun --standalone)
            tmp = tempfile.TemporaryDirectory(prefix="geglu-bench-dist-") if rank == 0 else None
            shared = [tmp.name if tmp else None]
            dist.broadcast_object_list(shared, src=0)
            model_dir = Path(shared[0])
        if rank == 0 and not (model_dir / "config.json").is_file():
            say(f"[bench-dist] random {cfg.num_hidden_layers}-layer model -> {model_dir}")
            torch.manual_seed(0)
            with torch.device(device):
                transformers.Gemma3ForCausalLM(cfg).to(dtype).save_pretrained(model_dir)
        dist.barrier()
        phases = [p for p in args.phases.split(",") if p]
        gen = torch.Generator().manual_seed(0)
        vocab = cfg.vocab_size

        def load():
            if world > 1:
                dcfg = transformers.DistributedConfig(tp_plan="auto", tp_size=world)
                return transformers.Gemma3ForCausalLM.from_pretrained(model_dir, dtype=dtype, distributed_config=dcfg,
                                                                       use_kernels=False).eval()
            m = transformers.Gemma3ForCausalLM.from_pretrained(model_dir, dtype=dtype, use_kernels=False)
            m = m.to(device).eval()
            _torch_tp(m, init_device_mesh(device, (1,)))
            return m

        timer = _Timer(device)
        if {"prefill", "decode"} & set(phases):
            eager, kern = load(), load()
            kernelize(kern, mode=Mode.INFERENCE, device=device)
            report["tp"] = "transformers tp_plan='auto'" if world > 1 else "parallelize_module on a 1-process mesh"
            ids = torch.randint(1, vocab, (args.batch, args.prefill), generator=gen).to(device)
            models = {"eager": eager, "kernelized": kern}
            if "prefill" in phases:
                fns = {k: (lambda m=m: m(input_ids=ids, logits_to_keep=1, use_cache=False)) for k, m in models.items()}
                with torch.no_grad():
                    res = _interleaved(timer, fns, args.rounds, args.warmup)
                    res["profile"] = _profile(fns["kernelized"], device, _mlps(kern))
                res["tokens"] = args.batch * args.prefill
                report["phases"]["prefill"] = res
                say(f"[bench-dist] prefill: eager {res['ms']['eager']:.3f} ms, kernelized "
                    f"{res['ms']['kernelized']:.3f} ms, ratio {res['ratio_eager_over_kernelized']:.3f}")
            if "decode" in phases:
                step_ids = torch.randint(1, vocab, (args.batch, 1), generator=gen).to(device)
                caches: dict = {}

                def prefill(k, m):
                    def fn():
                        caches[k] = output_cache(m(input_ids=ids, use_cache=True, logits_to_keep=1))
                    return fn

                def steps(k, m):
                    def fn():
                        cache = caches.pop(k)
                        for _ in range(args.decode_steps):
                            cache = output_cache(m(**{"input_ids": step_ids, cache_arg(m): cache,
                                                      "use_cache": True}))
                    return fn

                with torch.no_grad():  # each timed round starts from a freshly prefilled cache (untimed)
                    res = _interleaved(timer, {k: steps(k, m) for k, m in models.items()}, args.rounds,
                                       args.warmup, before={k: prefill(k, m) for k, m in models.items()})
                    prefill("kernelized", kern)()
                    res["profile"] = _profile(steps("kernelized", kern), device, _mlps(kern))
                res["steps"] = args.decode_steps
                res["ms_per_step"] = {k: v / args.decode_steps for k, v in res["ms"].items()}
                report["phases"]["decode"] = res
                say(f"[bench-dist] decode: eager {res['ms_per_step']['eager']:.3f} ms/step, kernelized "
                    f"{res['ms_per_step']['kernelized']:.3f} ms/step, ratio {res['ratio_eager_over_kernelized']:.3f}")
            del eager, kern, models
        if "train" in phases:
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device, (world,))
            models = {}
            for k in ("eager", "kernelized"):
                # use_kernels=False: transformers >= 5.25 kernelizes in from_pretrained by default
                m = transformers.Gemma3ForCausalLM.from_pretrained(model_dir, dtype=dtype, use_kernels=False).to(device)
                if k == "kernelized":
                    kernelize(m, mode=Mode.TRAINING, device=device)
                for layer in m.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(m, mesh=mesh)
                models[k] = m
            tids = torch.randint(1, vocab, (args.train_batch, args.train_seq), generator=gen).to(device)

            def step(m):
                def fn():
                    m.zero_grad(set_to_none=True)
                    m(input_ids=tids, labels=tids).loss.backward()
                return fn
            fns = {k: step(m) for k, m in models.items()}
            res = _interleaved(timer, fns, args.rounds, args.warmup)
            res["profile"] = _profile(fns["kernelized"], device, _mlps(models["kernelized"]))
            res["tokens_per_rank"] = args.train_batch * args.train_seq
            report["phases"]["train"] = res
            say(f"[bench-dist] FSDP2 train step: eager {res['ms']['eager']:.3f} ms, kernelized "
                f"{res['ms']['kernelized']:.3f} ms, ratio {res['ratio_eager_over_kernelized']:.3f}")
            del models
        dist.barrier()
        if tmp is not None:
            tmp.cleanup()
    finally:
        dist.destroy_process_group()
    if rank == 0 and args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=list))
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
