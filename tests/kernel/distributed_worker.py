"""One rank of the torch.distributed checks, run by test_distributed.py as two processes (gloo on loopback, a
FileStore rendezvous). It loads the kernel from a build tree with ``kernels.get_local_kernel``, runs the checks of
the requested groups and writes what it measured to OUT_DIR/rank<r>.json; the assertions are in the test module.

    python distributed_worker.py RANK WORLD_SIZE STORE_FILE BUILD_DIR OUT_DIR GROUP[,GROUP...]

Groups: ``ops`` (the DTensor sharding rules, op by op), ``tp`` (transformers' tp_plan="auto" on a tiny Gemma 3;
parallelize_module on T5 v1.1 and ModernBERT), ``fsdp`` (FSDP2 training with the training node), ``fsdp_compile``
(the same under torch.compile).

Every check records where the kernel ran: the local shapes the kernel's CPU implementation was called with (so a
check cannot pass because our code was bypassed), and for the op checks the ops the profiler saw with their local
input shapes.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

GEMMA3 = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16, vocab_size=128, max_position_embeddings=64, sliding_window=16, query_pre_attn_scalar=16,
              layer_types=["sliding_attention", "full_attention"])
T5 = dict(vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, relative_attention_num_buckets=8,
          decoder_start_token_id=0, feed_forward_proj="gated-gelu", dropout_rate=0.0)
MODERNBERT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  max_position_embeddings=64, local_attention=16, pad_token_id=0,
                  initializer_range=0.2)  # an MLP output that is not negligible next to the residual


class Calls:
    """The (rows, cols) of every call of the kernel's CPU implementation, forward and backward."""

    def __init__(self, kernel):
        self.cpu = importlib.import_module(kernel.__name__ + ".pointwise.cpu")
        self.fwd: list = []
        self.bwd: list = []
        fwd, bwd = self.cpu.geglu_fwd, self.cpu.geglu_bwd

        def counted_fwd(out, gate, up, approximate):
            self.fwd.append(list(gate.shape))
            return fwd(out, gate, up, approximate)

        def counted_bwd(d_gate, d_up, grad, gate, up, approximate):
            self.bwd.append(list(gate.shape))
            return bwd(d_gate, d_up, grad, gate, up, approximate)

        self.cpu.geglu_fwd, self.cpu.geglu_bwd = counted_fwd, counted_bwd

    def take(self) -> dict:
        out = {"fwd": self.fwd, "bwd": self.bwd}
        self.fwd, self.bwd = [], []
        return out


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def diff(a, b) -> dict:
    """a (under test) vs b (reference), both gathered: bitwise equality, max |a - b| and max |b|."""
    a, b = full(a).detach().double(), full(b).detach().double()
    return {"equal": bool(torch.equal(a, b)), "max_abs": float((a - b).abs().max()) if a.numel() else 0.0,
            "max_ref": float(b.abs().max()) if b.numel() else 0.0, "shape": list(a.shape)}


def placements(t) -> list:
    return [str(p) for p in getattr(t, "placements", ())]


# ----------------------------------------------------------------------------------------------------------------
# the sharding rules, op by op
# ----------------------------------------------------------------------------------------------------------------


def op_checks(kernel, calls, mesh, rank) -> dict:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.profiler import profile

    prefix = kernel._ops.add_op_namespace_prefix("")
    ops = kernel.ops
    results = {}

    def run(name, fn):
        calls.take()
        try:
            with profile(record_shapes=True) as prof:
                res = fn()
            events = sorted({(e.name[len(prefix):], json.dumps(e.input_shapes[0] if e.input_shapes else []))
                             for e in prof.events() if e.name.startswith(prefix)})
            res.update(ops=[[n, json.loads(s)] for n, s in events], calls=calls.take())
        except Exception as e:  # noqa: BLE001 - reported to the test
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        results[name] = res

    gen = torch.Generator().manual_seed(1234)
    M, D = 6, 64  # shards of 32 columns / 3 rows
    a, b, dy = (torch.randn(M, D, generator=gen) for _ in range(3))
    xp = torch.randn(M, 2 * D, generator=gen)
    dyp = torch.randn(M, D, generator=gen)
    split_places = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}

    def eager_split(approximate):
        ga, gb = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = F.gelu(ga, approximate=approximate) * gb
        d_a, d_b = torch.autograd.grad(out, (ga, gb), dy)
        return out, d_a, d_b

    for approximate in ("none", "tanh"):
        ref, ref_da, ref_db = eager_split(approximate)
        for pname, pl in split_places.items():
            for inplace in (False, True):
                for grad_pl in ((pl,) if pl == Replicate() else (pl, Replicate())):
                    def case(pl=pl, inplace=inplace, grad_pl=grad_pl, approximate=approximate):
                        # clones: a replicated DTensor's local tensor is the source tensor itself, and the
                        # in-place backward writes the gradients over it
                        da = distribute_tensor(a.clone(), mesh, [pl]).requires_grad_()
                        db = distribute_tensor(b.clone(), mesh, [pl]).requires_grad_()
                        out = kernel.geglu(da, db, approximate, inplace_backward=inplace)
                        out.backward(distribute_tensor(dy, mesh, [grad_pl]))
                        return {"out_placements": placements(out), "grad_placements": placements(da.grad),
                                "out": diff(out, ref), "d_gate": diff(da.grad, ref_da), "d_up": diff(db.grad, ref_db)}
                    tag = f"split/{approximate}/{pname}/inplace={inplace}/grad={grad_pl}"
                    run(tag, case)

    # the out= form (geglu_out) keeps out where it is; gate and up come to out's placement
    ref = F.gelu(a) * b
    for pname, pl in split_places.items():
        def case_out(pl=pl):
            out = distribute_tensor(torch.zeros(M, D), mesh, [pl])
            ga = distribute_tensor(a, mesh, [Replicate()])
            gb = distribute_tensor(b, mesh, [Shard(0)])
            res = kernel.geglu(ga, gb, out=out)
            return {"same_object": res is out, "out_placements": placements(out), "out": diff(out, ref)}
        run(f"out/{pname}", case_out)

    # linear in up (forward) / in grad (backward): Partial stays Partial, the other inputs replicated
    def partial_parts(t):
        part = torch.randn(t.shape, generator=torch.Generator().manual_seed(99))
        local = part if rank == 0 else t - part  # rank 0 holds part, rank 1 the rest: the sum is t up to rounding
        return DTensor.from_local(local, mesh, [Partial()], run_check=False), part, t - part

    def case_partial_fwd():
        pu, u0, u1 = partial_parts(b)
        out = kernel.geglu(distribute_tensor(a, mesh, [Replicate()]), pu)
        h = F.gelu(a)
        return {"out_placements": placements(out), "out": diff(out, h * (u0 + u1))}
    run("partial/forward", case_partial_fwd)

    def case_partial_bwd():
        pg, g0, g1 = partial_parts(dy)
        rep = [Replicate()]
        d_gate, d_up = kernel.geglu_backward(pg, distribute_tensor(a, mesh, rep), distribute_tensor(b, mesh, rep))
        ref_g, ref_u = kernel.geglu_backward(g0 + g1, a, b)
        return {"out_placements": placements(d_gate) + placements(d_up), "d_gate": diff(d_gate, ref_g),
                "d_up": diff(d_up, ref_u)}
    run("partial/backward", case_partial_bwd)

    def case_partial_packed_bwd():
        pg, g0, g1 = partial_parts(dyp)
        dx = ops.geglu_packed_backward.default(pg, distribute_tensor(xp, mesh, [Replicate()]), "none", True)
        ref_dx = ops.geglu_packed_backward.default(g0 + g1, xp, "none", True)
        return {"out_placements": placements(dx), "dx": diff(dx, ref_dx)}
    run("partial/packed_backward", case_partial_packed_bwd)

    # packed: eager on contiguous halves is the reference (the CPU promise for the packed form)
    packed_places = {"R": Replicate(), "S0": Shard(0), "SS1": _StridedShard(1, split_factor=2), "S1": Shard(1)}
    for act_first in (True, False):
        g_half, u_half = (xp[:, :D], xp[:, D:]) if act_first else (xp[:, D:], xp[:, :D])
        g_half, u_half = g_half.contiguous().requires_grad_(), u_half.contiguous().requires_grad_()
        ref = F.gelu(g_half) * u_half
        rd_g, rd_u = torch.autograd.grad(ref, (g_half, u_half), dyp)
        ref_dx = torch.cat((rd_g, rd_u) if act_first else (rd_u, rd_g), dim=1)
        for pname, pl in packed_places.items():
            grad_pl = Shard(1) if pname in ("SS1", "S1") else pl
            for inplace in (False, True):
                def case_packed(pl=pl, grad_pl=grad_pl, inplace=inplace, act_first=act_first, ref=ref,
                                ref_dx=ref_dx):
                    dx = distribute_tensor(xp.clone(), mesh, [pl]).requires_grad_()
                    out = kernel.geglu_packed(dx, act_first=act_first, inplace_backward=inplace)
                    out.backward(distribute_tensor(dyp, mesh, [grad_pl]))
                    return {"out_placements": placements(out), "grad_placements": placements(dx.grad),
                            "out": diff(out, ref), "dx": diff(dx.grad, ref_dx)}
                run(f"packed/act_first={act_first}/{pname}/inplace={inplace}", case_packed)

    # in-place packed backward where grad and x share a placement, called directly
    def case_packed_inplace_direct():
        dx = distribute_tensor(xp.clone(), mesh, [Shard(0)])
        ops.geglu_packed_backward_.default(distribute_tensor(dyp, mesh, [Shard(0)]), dx, "none", True)
        return {"dx": diff(dx, ops.geglu_packed_backward.default(dyp, xp, "none", True)),
                "dx_placements": placements(dx)}
    run("packed/inplace_direct", case_packed_inplace_direct)

    def case_packed_inplace_last_dim():
        dx = distribute_tensor(xp.clone(), mesh, [Shard(1)])
        ops.geglu_packed_backward_.default(distribute_tensor(dyp, mesh, [Shard(1)]), dx, "none", True)
        return {}
    run("packed/inplace_direct_last_dim", case_packed_inplace_last_dim)

    # a 2-D mesh: pointwise rules expand over both dims; in-place ops refuse mixed placements
    mesh2 = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    ref, ref_da, ref_db = eager_split("none")

    def case_mesh2():
        pl = [Replicate(), Shard(1)]
        da = distribute_tensor(a.clone(), mesh2, pl).requires_grad_()
        db = distribute_tensor(b.clone(), mesh2, pl).requires_grad_()
        out = kernel.geglu(da, db, inplace_backward=True)
        out.backward(distribute_tensor(dy, mesh2, pl))
        return {"out_placements": placements(out), "out": diff(out, ref), "d_gate": diff(da.grad, ref_da),
                "d_up": diff(db.grad, ref_db)}
    run("mesh2/split", case_mesh2)

    def case_mesh2_inplace_direct():
        pl = [Replicate(), Shard(1)]
        ops.geglu_backward_.default(*(distribute_tensor(t.clone(), mesh2, pl) for t in (dy, a, b)), "none")
        return {}
    run("mesh2/inplace_direct", case_mesh2_inplace_direct)
    return results


# ----------------------------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------------------------


def local_mapping(build_dir: Path):
    """register_geglu_kernels' classes, mapped to the local build (LocalLayerRepository), every mode, cpu."""
    from kernels import LocalLayerRepository, Mode, register_kernel_mapping

    from kerneltools.transformers_kernels import GEGLU_CLASSES, register_geglu_kernels

    reg = register_geglu_kernels(devices=("cpu",), register=False)
    modes = (Mode.INFERENCE, Mode.TRAINING, Mode.INFERENCE | Mode.TORCH_COMPILE, Mode.TRAINING | Mode.TORCH_COMPILE)
    repos = {}
    mapping = {}
    for h in GEGLU_CLASSES:
        if h.key in reg.mapping:
            repo = repos.setdefault(h.layer, LocalLayerRepository(build_dir, layer_name=h.layer))
            mapping[h.key] = {"cpu": {m: repo for m in modes}}
    register_kernel_mapping(mapping, inherit_mapping=False)


def kernelize(model, training: bool, compile_: bool = False):
    from kernels import Mode
    from kernels import kernelize as _kernelize

    mode = Mode.TRAINING if training else Mode.INFERENCE
    if compile_:
        mode = mode | Mode.TORCH_COMPILE
    return _kernelize(model, mode=mode, device="cpu")


def model_outputs(model, inputs: dict, training: bool, out_weight):
    """Logits (no grad) or (logits, {param name: gathered grad}) for the loss sum(logits * out_weight)."""
    model.zero_grad(set_to_none=True)
    if not training:
        with torch.no_grad():
            return model(**inputs).logits, {}
    logits = model(**inputs).logits
    (full(logits) * out_weight).sum().backward()
    return logits.detach(), {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def compare_models(test_model, ref_model, inputs, training, out_weight) -> dict:
    a, ga = model_outputs(test_model, inputs, training, out_weight)
    b, gb = model_outputs(ref_model, inputs, training, out_weight)
    res = {"logits": diff(a, b)}
    if training:
        res["grads"] = {n: diff(ga[n], gb[n]) for n in gb}
        res["missing_grads"] = sorted(set(gb) - set(ga))
    return res


def tp_checks(kernel, calls, mesh, rank, work: Path) -> dict:
    import transformers
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor.placement_types import _StridedShard

    results = {}
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 128, (2, 12), generator=gen)
    out_weight = torch.randn(2, 12, 128, generator=gen)

    def run(name, fn):
        calls.take()
        try:
            res = fn()
            res.setdefault("calls", calls.take())
        except Exception as e:  # noqa: BLE001 - reported to the test
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        results[name] = res

    # Gemma 3: transformers' own tensor parallelism from its config's plan
    path = work / "gemma3"
    if rank == 0:
        torch.manual_seed(0)
        transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3)).save_pretrained(path)
    dist.barrier()
    cls = transformers.Gemma3ForCausalLM
    # use_kernels=False: transformers >= 5.25 kernelizes in from_pretrained by default, with the registered mapping
    ref = cls.from_pretrained(path, dtype=torch.float32, use_kernels=False).eval()
    for training in (False, True):
        mode = "training" if training else "inference"

        def gemma(training=training):
            cfg = transformers.DistributedConfig(tp_plan="auto", tp_size=dist.get_world_size())
            tp_eager = cls.from_pretrained(path, dtype=torch.float32, distributed_config=cfg, use_kernels=False).eval()
            tp = cls.from_pretrained(path, dtype=torch.float32, distributed_config=cfg).eval()
            kernelize(tp, training)
            w = tp.model.layers[0].mlp.gate_proj.weight
            res = {"weight_type": type(w).__name__, "weight_placements": placements(w),
                   "forward": type(tp.model.layers[0].mlp).forward.__qualname__,
                   "kernel_forward": tp.model.layers[0].mlp.forward.__qualname__}
            res["vs_unsharded"] = compare_models(tp, ref, {"input_ids": ids}, training, out_weight)
            res["calls"] = calls.take()
            res["vs_tp_eager"] = compare_models(tp, tp_eager, {"input_ids": ids}, training, out_weight)
            return res
        run(f"gemma3/tp_plan_auto/{mode}", gemma)

    # T5 v1.1 (gated-gelu): no plan in transformers; wi_0/wi_1 colwise, wo rowwise
    torch.manual_seed(0)
    t5_ref = transformers.T5ForConditionalGeneration(transformers.T5Config(**T5)).eval()
    t5_inputs = {"input_ids": ids, "decoder_input_ids": ids[:, :6]}
    t5_weight = out_weight[:, :6]
    t5_plan = {f"{stack}.block.*.layer.{i}.DenseReluDense.{n}": style
               for stack, i in (("encoder", 1), ("decoder", 2))
               for n, style in (("wi_0", ColwiseParallel()), ("wi_1", ColwiseParallel()), ("wo", RowwiseParallel()))}
    for training in (False, True):
        mode = "training" if training else "inference"

        def t5(training=training):
            import copy

            m = copy.deepcopy(t5_ref)
            parallelize_module(m, mesh, t5_plan)
            m_k = copy.deepcopy(m)
            kernelize(m_k, training)
            res = {"vs_unsharded": compare_models(m_k, t5_ref, t5_inputs, training, t5_weight)}
            res["calls"] = calls.take()
            res["tp_eager_vs_unsharded"] = compare_models(m, t5_ref, t5_inputs, training, t5_weight)
            return res
        run(f"t5/parallelize/{mode}", t5)

    # ModernBERT: packed Wi [2I, D] = [gate; up]. Colwise with a plain Shard(0) gives rank 0 the gate rows and
    # rank 1 the up rows (wrong for the model, kernel or not); _StridedShard(0, split_factor=2) gives each rank
    # [gate_r; up_r], so its local output is a valid packed [g_r | u_r].
    class PackedColwise(ColwiseParallel):
        def __init__(self):  # the output stays [g_r | u_r] (to_local without a redistribution to Shard(-1))
            super().__init__(output_layouts=_StridedShard(-1, split_factor=2))

        def _partition_linear_fn(self, name, module, device_mesh):
            for pname, param in list(module.named_parameters(recurse=False)):
                dist_param = torch.nn.Parameter(torch.distributed.tensor.distribute_tensor(
                    param, device_mesh, [_StridedShard(0, split_factor=2)]))
                module.register_parameter(pname, dist_param)

    torch.manual_seed(0)
    mb_ref = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**MODERNBERT)).eval()
    mb_inputs = {"input_ids": ids}
    for plan_name, wi_style in (("strided", PackedColwise), ("naive", ColwiseParallel)):
        for training in (False, True):
            mode = "training" if training else "inference"

            def modernbert(training=training, wi_style=wi_style):
                import copy

                m = copy.deepcopy(mb_ref)
                parallelize_module(m, mesh, {"model.layers.*.mlp.Wi": wi_style(), "model.layers.*.mlp.Wo":
                                             RowwiseParallel()})
                m_k = copy.deepcopy(m)
                kernelize(m_k, training)
                res = {"wi_placements": placements(m_k.model.layers[0].mlp.Wi.weight),
                       "vs_unsharded": compare_models(m_k, mb_ref, mb_inputs, training, out_weight)}
                res["calls"] = calls.take()
                res["tp_eager_vs_unsharded"] = compare_models(m, mb_ref, mb_inputs, training, out_weight)
                return res
            run(f"modernbert/{plan_name}/{mode}", modernbert)
    return results


def fsdp_checks(kernel, calls, mesh, rank, compile_: bool) -> dict:
    import copy

    import transformers
    from torch.distributed.fsdp import fully_shard

    results = {}
    torch.manual_seed(0)
    ref = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3)).eval()
    # rows large enough that the MLP is not host-bound (the node runs on CPU at any size)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 128, (2 * dist.get_world_size(), 16), generator=gen)
    out_weight = torch.randn(ids.shape + (128,), generator=gen)

    for data in ("same", "split"):
        def case(data=data):
            m = copy.deepcopy(ref)
            kernelize(m, True, compile_)
            nodes = []  # the autograd node of each MLP output (eager only: dynamo would trace the hook)
            hooks = [] if compile_ else [layer.mlp.register_forward_hook(
                lambda mod, args, out: nodes.append(type(out.grad_fn).__name__ if out.grad_fn else None))
                for layer in m.model.layers]
            for layer in m.model.layers:
                fully_shard(layer)
            fully_shard(m)
            if compile_:
                for layer in m.model.layers:
                    layer.mlp.compile(fullgraph=True)
            if data == "same":  # every rank the whole batch: the averaged gradients are each rank's own
                my_ids, my_w, scale = ids, out_weight, 1.0
            else:  # data parallel: rank r its slice; the average over ranks is the whole batch's mean
                n = ids.shape[0] // dist.get_world_size()
                my_ids, my_w = ids[rank * n:(rank + 1) * n], out_weight[rank * n:(rank + 1) * n]
                scale = float(dist.get_world_size())
            steps = []
            for _ in range(2):  # the second step reuses what FSDP2 and the compiled graphs kept
                m.zero_grad(set_to_none=True)
                (m(input_ids=my_ids).logits * my_w).sum().mul(scale).backward()
                steps.append({n: p.grad.full_tensor() for n, p in m.named_parameters()})
            for h in hooks:
                h.remove()
            ref.zero_grad(set_to_none=True)
            (ref(input_ids=ids).logits * out_weight).sum().backward()
            return {"grads": [{n: diff(g[n], p.grad) for n, p in ref.named_parameters()} for g in steps],
                    "nodes": nodes, "calls": calls.take()}
        calls.take()
        try:
            results[f"fsdp/{'compile' if compile_ else 'eager'}/{data}"] = case()
        except Exception as e:  # noqa: BLE001 - reported to the test
            results[f"fsdp/{'compile' if compile_ else 'eager'}/{data}"] = {
                "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    return results


def main(argv) -> int:
    rank, world, store_file, build_dir, out_dir, groups = argv
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world)
    try:
        import kernels

        kernel = kernels.get_local_kernel(Path(build_dir))
        calls = Calls(kernel)
        mesh = init_device_mesh("cpu", (world,))
        results = {"sharding_available": kernel._sharding.AVAILABLE, "registered": kernel._sharding.REGISTERED}
        local_mapping(Path(build_dir))
        for group in groups.split(","):
            if group == "ops":
                results.update(op_checks(kernel, calls, mesh, rank))
            elif group == "tp":
                results.update(tp_checks(kernel, calls, mesh, rank, Path(out_dir)))
            elif group in ("fsdp", "fsdp_compile"):
                results.update(fsdp_checks(kernel, calls, mesh, rank, group == "fsdp_compile"))
            else:
                raise ValueError(f"unknown group {group!r}")
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.exit(main(sys.argv[1:]))
