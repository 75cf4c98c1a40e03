"""normkit under torch.distributed on 2 ranks: DDP, FSDP2, tensor + sequence parallelism (DTensor).

Per backend, one spawn of 2 processes (torch.multiprocessing) runs every scenario and reports back;
the tests assert on the reports. ``cpu``/gloo runs in CI (normkit's reference backend, the same
front end: functional -> ops -> backend); ``cuda``/nccl runs the Triton kernels under ``-m cuda``
and skips unless 2 GPUs are present. NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and
friends, set before the processes start): it can take shared GPUs out of service.

Scenarios (normkit model vs the same model on torch.nn norms, same init and data):
  ddp     DistributedDataParallel around a tiny transformer built from normkit.nn modules
  fsdp2   fully_shard per block + root, the model patched with normkit.patch (norm weights sharded)
  tp      parallelize_module: SequenceParallel norms (DTensor inputs sharded along the sequence),
          colwise / rowwise linears; also against the unsharded torch model
  ops     every public op on DTensors: placements kept, values and gradients vs torch on the full
          tensors, collectives counted with CommDebugMode (zero in forward and backward)
  higher  double backward (a gradient penalty, create_graph) of each op family on sharded DTensors,
          and channels_last / channels_last_3d GroupNorm and BatchNorm shards keeping their layout
  compile torch.compile(fullgraph=True) of an op on a sequence-sharded DTensor
  errors  sharding along a normalized dim, Partial inputs, plain weights with DTensor inputs
  docs    (cpu only) the FSDP2 + TP example of docs/distributed.md runs under torchrun

With ``NORMKIT_DIST_LOG=<dir>`` the per-step losses and gradient differences also go to
``<dir>/distributed-<device>.{json,txt}``; ``pytest -s`` prints them.
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import normkit
import normkit.nn as nkn

WORLD = 2
STEPS = 3
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ROOT = Path(__file__).resolve().parent.parent
# fp32 everywhere; torch's and normkit's reductions differ in order only (tf32 stays off).
LOSS_RTOL = 1e-4
GRAD_RTOL = 1e-3  # max |g_normkit - g_torch| / max |g_torch|, per parameter
OP_ATOL = 1e-4


# --- the model: a tiny pre-norm transformer, norms from a namespace (torch.nn or normkit.nn) ---------


class Attention(nn.Module):
    def __init__(self, dim, heads, ns):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.softmax = ns.Softmax(dim=-1)

    def forward(self, x):
        b, s = x.shape[0], x.shape[1]
        # -1 heads: under tensor parallelism each rank holds heads / tp of them.
        q, k, v = (m(x).view(b, s, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        mask = torch.full((s, s), -1e4, device=x.device).triu(1)
        out = self.softmax(scores + mask) @ v
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim, heads, ns):
        super().__init__()
        self.attn_norm, self.attn = ns.RMSNorm(dim), Attention(dim, heads, ns)
        self.mlp_norm, self.mlp = ns.LayerNorm(dim), MLP(dim)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    def __init__(self, ns=nn, vocab=64, dim=32, heads=4, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, ns) for _ in range(layers))
        self.norm, self.head = ns.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.tok(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _model_pair(device, normkit_by="modules"):
    """(torch.nn model, normkit model) with the same parameters; normkit by its modules or patch."""
    torch.manual_seed(0)
    ref = TinyLM(nn).to(device)
    if normkit_by == "patch":
        model = copy.deepcopy(ref)
        assert len(normkit.patch(model)) == 5  # 2 x (RMSNorm, LayerNorm) + the final LayerNorm
    else:
        model = TinyLM(nkn).to(device)
        model.load_state_dict(ref.state_dict())
    return ref, model


def _batch(device, step, rank=0, batch=2, seq=16, vocab=64):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _loss(model, tokens, targets):
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _full(t):
    """A plain tensor: DTensor gradients (sharded, or Partial for norm weights) are gathered/summed."""
    return t.full_tensor() if normkit.distributed.is_dtensor(t) else t


def _grad_rel_diffs(ref, model) -> dict[str, float]:
    out = {}
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        g_ref, g = _full(p_ref.grad), _full(p.grad)
        out[name] = float((g - g_ref).abs().max() / g_ref.abs().max().clamp_min(1e-12))
    return out


def _param_max_diff(ref, model) -> float:
    pairs = zip(ref.parameters(), model.parameters())
    return max(float((_full(p) - _full(q)).abs().max().detach()) for p, q in pairs)


def _train(ref, model, data, steps=STEPS):
    """Both models, same batches, SGD (linear in the gradients, so parameter differences stay those
    of the gradients): per step the two losses and the gradient differences."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    log = []
    for step in range(steps):
        tokens, targets = data(step)
        losses = []
        for m, opt in zip((ref, model), opts):
            opt.zero_grad(set_to_none=True)
            loss = _loss(m, tokens, targets)
            loss.backward()
            losses.append(float(loss.detach()))
        diffs = _grad_rel_diffs(ref, model)
        norm_diffs = {n: d for n, d in diffs.items() if "norm" in n}
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        for opt in opts:
            opt.step()
        log.append(dict(step=step, loss_torch=losses[0], loss_normkit=losses[1],
                        max_grad_rel_diff=max(diffs.values()),
                        max_norm_grad_rel_diff=max(norm_diffs.values()),
                        norm_params=len(norm_diffs), params_without_grad=missing))  # fmt: skip
    return dict(steps=log, param_max_diff_after=_param_max_diff(ref, model))


# --- scenarios (run on every rank) ---------------------------------------------------------------------


def scenario_ddp(device, rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref, model = _model_pair(device, "modules")
    ids = [rank] if device == "cuda" else None
    ref, model = DDP(ref, device_ids=ids), DDP(model, device_ids=ids)
    return _train(ref, model, lambda step: _batch(device, step, rank))


def scenario_fsdp2(device, rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device, (WORLD,))
    ref, model = _model_pair(device, "patch")
    for m in (ref, model):
        for block in m.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
    out = _train(ref, model, lambda step: _batch(device, step, rank))
    w = model.blocks[0].attn_norm.weight
    out["norm_weight_placements"] = str(tuple(w.placements))  # sharded by FSDP2: Shard(0)
    return out


def _tp_plan(model):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)  # fmt: skip

    gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}  # fmt: skip
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.attn_norm": SequenceParallel(),
                     f"blocks.{i}.attn": PrepareModuleInput(**gather),
                     f"blocks.{i}.attn.q": ColwiseParallel(), f"blocks.{i}.attn.k": ColwiseParallel(),
                     f"blocks.{i}.attn.v": ColwiseParallel(),
                     f"blocks.{i}.attn.o": RowwiseParallel(output_layouts=Shard(1)),
                     f"blocks.{i}.mlp_norm": SequenceParallel(),
                     f"blocks.{i}.mlp": PrepareModuleInput(**gather),
                     f"blocks.{i}.mlp.up": ColwiseParallel(),
                     f"blocks.{i}.mlp.down": RowwiseParallel(output_layouts=Shard(1))})  # fmt: skip
    return plan


def scenario_tp(device, rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh(device, (WORLD,), mesh_dim_names=("tp",))
    ref, model = _model_pair(device, "modules")
    single = copy.deepcopy(ref)  # unsharded torch.nn model: what TP must reproduce
    for m in (ref, model):
        parallelize_module(m, mesh, _tp_plan(m))
    data = lambda step: _batch(device, step, 0)  # noqa: E731  (the same batch on every TP rank)
    # Collectives of one forward + backward: normkit's norms must add none to torch's.
    counts = []
    for m in (ref, model):
        with CommDebugMode() as comm:
            _loss(m, *data(0)).backward()
        counts.append(comm.get_total_counts())
        m.zero_grad(set_to_none=True)
    seen = {}

    def record(module, args):
        seen.setdefault("attn_norm_input", str(tuple(args[0].placements)))

    hook = model.blocks[0].attn_norm.register_forward_pre_hook(record)
    out = _train(ref, model, data)
    hook.remove()
    single_losses = []
    opt = torch.optim.SGD(single.parameters(), lr=0.5)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = _loss(single, *data(step))
        loss.backward()
        opt.step()
        single_losses.append(float(loss.detach()))
    for entry, loss in zip(out["steps"], single_losses):
        entry["loss_unsharded_torch"] = loss
    grad = model.blocks[0].attn_norm.weight.grad
    out.update(comm_torch_fwd_bwd=counts[0], comm_normkit_fwd_bwd=counts[1], **seen,
               norm_weight_grad_placements=str(tuple(grad.placements)))  # fmt: skip
    return out


def _op_cases(device):
    """(name, normkit fn, torch fn, global input shape, placement, (weight, bias) shapes) per op."""
    from torch.distributed.tensor import Replicate, Shard

    F = torch.nn.functional

    def add_ln(nk):
        def fn(x, r, w, b):
            if nk:
                y, h = normkit.add_layer_norm(x, r, (16,), w, b, prenorm=True)
            else:
                h = x + r
                y = F.layer_norm(h, (16,), w, b)
            return y + 2 * h  # both outputs feed the loss

        return fn

    return [
        ("layer_norm-seq", lambda x, w, b: normkit.layer_norm(x, (16,), w, b),
         lambda x, w, b: F.layer_norm(x, (16,), w, b), (2, 6, 16), Shard(1), ((16,), (16,))),
        ("layer_norm-batch", lambda x, w, b: normkit.layer_norm(x, (16,), w, b),
         lambda x, w, b: F.layer_norm(x, (16,), w, b), (4, 3, 16), Shard(0), ((16,), (16,))),
        ("layer_norm-2d-shape", lambda x, w, b: normkit.layer_norm(x, (4, 8), w, b),
         lambda x, w, b: F.layer_norm(x, (4, 8), w, b), (3, 4, 4, 8), Shard(0), ((4, 8), (4, 8))),
        ("rms_norm-seq", lambda x, w: normkit.rms_norm(x, (16,), w, 1e-6),
         lambda x, w: F.rms_norm(x, (16,), w, 1e-6), (2, 6, 16), Shard(1), ((16,),)),
        ("rms_norm-uneven", lambda x, w: normkit.rms_norm(x, (16,), w, 1e-6),
         lambda x, w: F.rms_norm(x, (16,), w, 1e-6), (2, 5, 16), Shard(1), ((16,),)),
        ("rms_norm-replicate", lambda x, w: normkit.rms_norm(x, (16,), w, 1e-6),
         lambda x, w: F.rms_norm(x, (16,), w, 1e-6), (2, 6, 16), Replicate(), ((16,),)),
        ("add_layer_norm-seq", add_ln(True), add_ln(False), (2, 6, 16), Shard(1), ((16,), (16,))),
        ("add_rms_norm-seq", lambda x, r, w: normkit.add_rms_norm(x, r, (16,), w, 1e-6),
         lambda x, r, w: F.rms_norm(x + r, (16,), w, 1e-6), (2, 6, 16), Shard(1), ((16,),)),
        ("softmax-heads", lambda x: normkit.softmax(x, -1), lambda x: F.softmax(x, -1), (2, 4, 6, 6),
         Shard(1), ()),
        ("log_softmax-seq", lambda x: normkit.log_softmax(x, 1), lambda x: F.log_softmax(x, 1), (2, 6, 8),
         Shard(2), ()),
        ("group_norm-batch", lambda x, w, b: normkit.group_norm(x, 2, w, b),
         lambda x, w, b: F.group_norm(x, 2, w, b), (4, 8, 5), Shard(0), ((8,), (8,))),
        ("instance_norm-batch", lambda x, w, b: normkit.instance_norm(x, weight=w, bias=b),
         lambda x, w, b: F.instance_norm(x, weight=w, bias=b), (4, 8, 5), Shard(0), ((8,), (8,))),
        ("batch_norm-replicate", lambda x, w, b: normkit.batch_norm(x, None, None, w, b, True),
         lambda x, w, b: F.batch_norm(x, None, None, w, b, True), (4, 8, 5), Replicate(), ((8,), (8,))),
    ]  # fmt: skip


def scenario_ops(device, rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh(device, (WORLD,))
    results = {}
    for name, nk_fn, torch_fn, shape, placement, param_shapes in _op_cases(device):
        torch.manual_seed(1)  # the same global tensors on every rank
        n_act = 2 if name.startswith("add_") else 1
        acts = [torch.randn(shape, device=device) for _ in range(n_act)]
        params = [torch.randn(s, device=device) for s in param_shapes]
        dy = torch.randn(shape, device=device)
        d_acts = [distribute_tensor(a, mesh, [placement]).requires_grad_() for a in acts]
        d_params = [nn.Parameter(distribute_tensor(p, mesh, [Replicate()])) for p in params]
        with CommDebugMode() as fwd:
            y = nk_fn(*d_acts, *d_params)
        d_dy = distribute_tensor(dy, mesh, list(y.placements))
        with CommDebugMode() as bwd:
            y.backward(d_dy)
        ref_in = [t.clone().requires_grad_() for t in acts + params]
        ref_y = torch_fn(*ref_in)
        ref_y.backward(dy)
        got_grads = [t.grad for t in d_acts + d_params]
        results[name] = dict(
            fwd_collectives=fwd.get_total_counts(), bwd_collectives=bwd.get_total_counts(),
            is_dtensor=isinstance(y, DTensor), placements=str(tuple(y.placements)),
            expected_placements=str((placement,)),
            y_err=float((y.full_tensor() - ref_y).abs().max().detach()),
            grad_errs=[float((g.full_tensor() - r.grad).abs().max()) for g, r in zip(got_grads, ref_in)],
            grad_placements=[str(tuple(g.placements)) for g in got_grads])  # fmt: skip
    # Dropout: every shard its own mask (same seed; the halves of x are equal, their masks are not).
    from torch.distributed.tensor import Shard

    x = torch.ones(2, 8, 16, device=device)
    dx = distribute_tensor(x, mesh, [Shard(1)])
    y, h = normkit.add_rms_norm(dx, None, (16,), dropout_p=0.5, seed=7, prenorm=True)
    h = h.full_tensor()
    results["add_rms_norm-dropout"] = dict(masks_differ=bool((h[:, :4] != h[:, 4:]).any()),
                                           kept=float((h != 0).float().mean()),
                                           placements=str(tuple(y.placements)))  # fmt: skip
    return results


def _double_backward_cases():
    """(name, normkit fn, torch fn, global input shape, placement, parameter shapes): ops whose
    gradient is differentiated again (a gradient penalty on a sharded activation): six of
    :func:`_op_cases`."""
    names = ("layer_norm-seq", "rms_norm-seq", "add_rms_norm-seq", "softmax-heads", "group_norm-batch",
             "batch_norm-replicate")  # fmt: skip
    return [c for c in _op_cases(None) if c[0] in names]


def _penalty(fn, acts, params, dy, full):
    """A gradient penalty: g = d<fn(acts, params), dy>/d acts[0] (create_graph), loss = sum(g^2) +
    <fn(...), dy>; its gradients need the op's double backward. ``full`` makes a scalar plain."""
    y = fn(*acts, *params)
    (g,) = torch.autograd.grad(y, acts[0], dy, create_graph=True)
    loss = full((g * g).sum()) + full((y * dy).sum())
    loss.backward()
    return g


def scenario_higher(device, rank):
    """Issue 41's drop-in behaviour on DTensors: double backward (create_graph) of every op family,
    and channels_last GroupNorm / BatchNorm inputs, against torch on the full tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device, (WORLD,))
    F = torch.nn.functional
    results = {}
    for name, nk_fn, torch_fn, shape, placement, param_shapes in _double_backward_cases():
        torch.manual_seed(3)
        n_act = 2 if name.startswith("add_") else 1
        acts = [torch.randn(shape, device=device, dtype=torch.float64) for _ in range(n_act)]
        params = [1 + 0.5 * torch.randn(s, device=device, dtype=torch.float64) for s in param_shapes]
        dy = torch.randn(shape, device=device, dtype=torch.float64)
        d_acts = [distribute_tensor(a, mesh, [placement]).requires_grad_() for a in acts]
        d_params = [nn.Parameter(distribute_tensor(p, mesh, [Replicate()])) for p in params]
        g = _penalty(nk_fn, d_acts, d_params, distribute_tensor(dy, mesh, [placement]), _full)
        ref_in = [t.clone().requires_grad_() for t in acts + params]
        ref_g = _penalty(torch_fn, ref_in[:n_act], ref_in[n_act:], dy, lambda t: t)
        results[name] = dict(
            g_is_dtensor=isinstance(g, DTensor), g_placements=str(tuple(g.placements)),
            expected_placements=str((placement,)),
            g_err=float((g.full_tensor() - ref_g).abs().max().detach()),
            grads_missing=[i for i, t in enumerate(d_acts + d_params) if t.grad is None],
            grad_errs=[float((_full(t.grad) - r.grad).abs().max() / r.grad.abs().max().clamp_min(1e-12))
                       for t, r in zip(d_acts + d_params, ref_in) if t.grad is not None])  # fmt: skip
    # channels_last (and channels_last_3d) inputs sharded along the batch: outputs keep the layout.
    cl_cases = [
        ("group_norm-cl", (4, 8, 5, 3), torch.channels_last, Shard(0),
         lambda x, w, b: normkit.group_norm(x, 4, w, b), lambda x, w, b: F.group_norm(x, 4, w, b)),
        ("group_norm-cl3d", (4, 8, 3, 2, 3), torch.channels_last_3d, Shard(0),
         lambda x, w, b: normkit.group_norm(x, 2, w, b), lambda x, w, b: F.group_norm(x, 2, w, b)),
        ("batch_norm-cl-eval", (4, 8, 5, 3), torch.channels_last, Shard(0),
         lambda x, w, b: normkit.batch_norm(x, rm, rv, w, b, False),
         lambda x, w, b: F.batch_norm(x, rm, rv, w, b, False)),
        ("batch_norm-cl-train", (4, 8, 5, 3), torch.channels_last, Replicate(),
         lambda x, w, b: normkit.batch_norm(x, None, None, w, b, True),
         lambda x, w, b: F.batch_norm(x, None, None, w, b, True)),
    ]  # fmt: skip
    torch.manual_seed(4)
    rm, rv = torch.randn(8, device=device), torch.rand(8, device=device) + 0.5
    for name, shape, fmt, placement, nk_fn, torch_fn in cl_cases:
        x = torch.randn(shape, device=device).contiguous(memory_format=fmt)
        w, b = torch.randn(8, device=device), torch.randn(8, device=device)
        dy = torch.randn(shape, device=device)
        if placement.is_shard():
            half = shape[0] // WORLD
            local = x[rank * half:(rank + 1) * half].contiguous(memory_format=fmt)
            dx = DTensor.from_local(local, mesh, [placement], run_check=False, shape=x.shape,
                                    stride=x.stride())  # fmt: skip
        else:
            dx = DTensor.from_local(x.clone(memory_format=fmt), mesh, [placement], run_check=False)
        dx = dx.detach().requires_grad_()
        dw, db = (nn.Parameter(distribute_tensor(p, mesh, [Replicate()])) for p in (w, b))
        y = nk_fn(dx, dw, db)
        y.backward(distribute_tensor(dy.contiguous(memory_format=fmt), mesh, [placement]))
        rx, rw, rb = (t.clone().requires_grad_() for t in (x, w, b))
        ry = torch_fn(rx, rw, rb)
        ry.backward(dy)
        results[name] = dict(
            local_keeps_layout=y.to_local().is_contiguous(memory_format=fmt),
            global_keeps_layout=y.is_contiguous(memory_format=fmt), placements=str(tuple(y.placements)),
            expected_placements=str((placement,)), y_err=float((y.full_tensor() - ry).abs().max().detach()),
            grad_errs=[float((_full(t.grad) - r.grad).abs().max())
                       for t, r in ((dx, rx), (dw, rw), (db, rb))])  # fmt: skip
    return results


def scenario_errors(device, rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device, (WORLD,))
    x = torch.randn(4, 6, 16, device=device)
    w = distribute_tensor(torch.ones(16, device=device), mesh, [Replicate()])
    rm, rv = torch.zeros(6, device=device), torch.ones(6, device=device)  # running statistics of 6 channels
    other = init_device_mesh(device, (WORLD,), mesh_dim_names=("other",))  # the same ranks, another mesh
    w_other = distribute_tensor(torch.ones(16, device=device), other, [Replicate()])
    cases = {
        "layer_norm-shard-normalized-dim": lambda: normkit.layer_norm(
            distribute_tensor(x, mesh, [Shard(2)]), (16,), w),
        "rms_norm-shard-2d-normalized": lambda: normkit.rms_norm(
            distribute_tensor(x, mesh, [Shard(1)]), (6, 16)),
        "softmax-shard-dim": lambda: normkit.softmax(distribute_tensor(x, mesh, [Shard(2)]), -1),
        "rms_norm-partial-input": lambda: normkit.rms_norm(
            DTensor.from_local(x, mesh, [Partial()], run_check=False), (16,), w),
        "layer_norm-plain-weight": lambda: normkit.layer_norm(
            distribute_tensor(x, mesh, [Shard(0)]), (16,), torch.ones(16, device=device)),
        "layer_norm-sharded-weight": lambda: normkit.layer_norm(
            distribute_tensor(x, mesh, [Shard(0)]), (16,), distribute_tensor(torch.ones(16, device=device),
                                                                             mesh, [Shard(0)])),
        "add_rms_norm-plain-residual": lambda: normkit.add_rms_norm(
            distribute_tensor(x, mesh, [Shard(1)]), x, (16,), w),
        "layer_norm-plain-input-dtensor-weight": lambda: normkit.layer_norm(x, (16,), w),
        "batch_norm-train-shard-batch": lambda: normkit.batch_norm(
            distribute_tensor(x.transpose(1, 2).contiguous(), mesh, [Shard(0)]), None, None, training=True),
        "group_norm-shard-channels": lambda: normkit.group_norm(
            distribute_tensor(x.transpose(1, 2).contiguous(), mesh, [Shard(1)]), 2),
        "instance_norm-running-stats-shard-batch": lambda: normkit.instance_norm(
            distribute_tensor(x, mesh, [Shard(0)]), rm, rv),
        "batch_norm-eval-shard-channels": lambda: normkit.batch_norm(
            distribute_tensor(x, mesh, [Shard(1)]), rm, rv),
        "layer_norm-weight-on-another-mesh": lambda: normkit.layer_norm(
            distribute_tensor(x, mesh, [Shard(0)]), (16,), w_other),
        "batch_norm-sharded-running-mean": lambda: normkit.batch_norm(
            distribute_tensor(x, mesh, [Replicate()]), distribute_tensor(rm, mesh, [Shard(0)]), rv),
    }  # fmt: skip
    out = {}
    for name, call in cases.items():
        try:
            call()
        except Exception as e:  # noqa: BLE001  (the report carries type and message)
            out[name] = dict(type=type(e).__name__, message=str(e),
                             is_invalid_argument=isinstance(e, normkit.InvalidArgument))  # fmt: skip
        else:
            out[name] = dict(type=None, is_invalid_argument=False, message="no error raised")
    return out


def scenario_compile(device, rank):
    """torch.compile(fullgraph=True) traces the DTensor path (to_local / from_local) and the ops."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device, (WORLD,))
    torch.manual_seed(2)
    x, w, dy = (torch.randn(s, device=device) for s in ((2, 6, 16), (16,), (2, 6, 16)))
    dx = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
    dw = nn.Parameter(distribute_tensor(w, mesh, [Replicate()]))
    torch._dynamo.reset()
    # aot_eager: Dynamo + AOTAutograd (what must trace the DTensor path) without inductor codegen time.
    fn = torch.compile(lambda x, w: normkit.rms_norm(x, (16,), w, 1e-6), fullgraph=True, backend="aot_eager")
    y = fn(dx, dw)
    y.backward(distribute_tensor(dy, mesh, [Shard(1)]))
    rx, rw = x.clone().requires_grad_(), w.clone().requires_grad_()
    ry = torch.nn.functional.rms_norm(rx, (16,), rw, 1e-6)
    ry.backward(dy)
    return dict(placements=str(tuple(y.placements)), y_err=float((y.full_tensor() - ry).abs().max().detach()),
                grad_errs=[float((dx.grad.full_tensor() - rx.grad).abs().max()),
                           float((dw.grad.full_tensor() - rw.grad).abs().max())],
                weight_grad_placements=str(tuple(dw.grad.placements)))  # fmt: skip


SCENARIOS = {"ops": scenario_ops, "higher": scenario_higher, "compile": scenario_compile,
             "errors": scenario_errors, "ddp": scenario_ddp, "fsdp2": scenario_fsdp2,
             "tp": scenario_tp}  # fmt: skip


def _worker(rank, device, port, out_dir):
    os.environ.update(NO_MULTICAST)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    device_id = dict(device_id=torch.device("cuda", rank)) if device == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300), **device_id)  # fmt: skip
    report = {}
    try:
        for name, fn in SCENARIOS.items():
            start = time.perf_counter()
            try:
                report[name] = dict(ok=True, result=fn(device, rank))
            except Exception:  # noqa: BLE001  (reported; the test for this scenario fails with it)
                report[name] = dict(ok=False, error=traceback.format_exc())
            report[name]["seconds"] = round(time.perf_counter() - start, 2)
            dist.barrier()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(device, out_dir, deadline_s=420):
    os.environ.update(NO_MULTICAST)  # inherited by the spawned processes, before NCCL starts
    ctx = mp.start_processes(_worker, args=(device, _free_port(), out_dir), nprocs=WORLD, join=False,
                             start_method="spawn")  # fmt: skip
    end = time.monotonic() + deadline_s
    while not ctx.join(timeout=5):
        if time.monotonic() > end:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{WORLD} {device} ranks did not finish within {deadline_s} s")


def _summary(device, report) -> str:
    lines = [f"== normkit distributed, {device}, {WORLD} ranks =="]
    for name in ("ddp", "fsdp2", "tp"):
        entry = report.get(name, {})
        if not entry.get("ok"):
            lines.append(f"{name}: FAILED")
            continue
        res = entry["result"]
        for s in res["steps"]:
            extra = f" unsharded-torch {s['loss_unsharded_torch']:.6f}" if "loss_unsharded_torch" in s else ""
            lines.append(f"{name} step {s['step']}: loss torch {s['loss_torch']:.6f} "
                         f"normkit {s['loss_normkit']:.6f}"
                         f"{extra} | max grad rel diff {s['max_grad_rel_diff']:.2e} (norm weights "
                         f"{s['max_norm_grad_rel_diff']:.2e})")  # fmt: skip
        lines.append(f"{name}: max |param diff| after {len(res['steps'])} SGD steps "
                     f"{res['param_max_diff_after']:.2e}")
    tp = report.get("tp", {}).get("result")
    if tp:
        lines.append(f"tp: collectives per fwd+bwd torch {tp['comm_torch_fwd_bwd']} "
                     f"normkit {tp['comm_normkit_fwd_bwd']}; norm input {tp.get('attn_norm_input')}; "
                     f"norm weight grad {tp['norm_weight_grad_placements']}")
    ops = report.get("ops", {}).get("result") or {}
    for name, r in ops.items():
        if "fwd_collectives" in r:
            lines.append(f"op {name}: collectives fwd {r['fwd_collectives']} bwd {r['bwd_collectives']}, out "
                         f"{r['placements']}, max err y {r['y_err']:.1e} grads {max(r['grad_errs']):.1e}, "
                         f"grad placements {r['grad_placements']}")  # fmt: skip
    for name, r in (report.get("higher", {}).get("result") or {}).items():
        if "g_err" in r:
            lines.append(f"double backward {name}: first grad {r['g_placements']} err {r['g_err']:.1e}, "
                         f"penalty grads max rel err {max(r['grad_errs'], default=float('nan')):.1e}")
        else:
            lines.append(f"layout {name}: shard keeps it {r['local_keeps_layout']}, out {r['placements']}, "
                         f"max err y {r['y_err']:.1e} grads {max(r['grad_errs']):.1e}")  # fmt: skip
    return "\n".join(lines)


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def report(request):
    device = request.param
    if device == "cuda" and torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA GPUs, found {torch.cuda.device_count()}")
    if not dist.is_available() or not dist.is_backend_available("nccl" if device == "cuda" else "gloo"):
        pytest.skip(f"torch.distributed with {'nccl' if device == 'cuda' else 'gloo'} is not available")
    with tempfile.TemporaryDirectory() as tmp:
        _spawn(device, tmp)
        reports = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD)]
    summary = _summary(device, reports[0])
    print("\n" + summary)
    log_dir = os.environ.get("NORMKIT_DIST_LOG")
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        Path(log_dir, f"distributed-{device}.json").write_text(json.dumps(reports, indent=1))
        Path(log_dir, f"distributed-{device}.txt").write_text(summary + "\n")
    return dict(device=device, ranks=reports)


def _result(report, name):
    for rank, rep in enumerate(report["ranks"]):
        entry = rep.get(name)
        assert entry is not None, f"rank {rank} did not run {name}"
        assert entry["ok"], f"{name} failed on rank {rank}:\n{entry['error']}"
    return [rep[name]["result"] for rep in report["ranks"]]


def _check_training(results):
    for rank, res in enumerate(results):
        for s in res["steps"]:
            assert s["params_without_grad"] == [], (rank, s)
            assert s["norm_params"] > 0
            assert math.isclose(s["loss_normkit"], s["loss_torch"], rel_tol=LOSS_RTOL), (rank, s)
            assert s["max_grad_rel_diff"] <= GRAD_RTOL, (rank, s)
        assert res["param_max_diff_after"] <= 1e-4, (rank, res["param_max_diff_after"])


def test_ddp_matches_torch_norms(report):
    _check_training(_result(report, "ddp"))


def test_fsdp2_matches_torch_norms(report):
    results = _result(report, "fsdp2")
    _check_training(results)
    assert "Shard(dim=0)" in results[0]["norm_weight_placements"]  # the norm weights are sharded


def test_tensor_sequence_parallel_matches_torch_norms(report):
    results = _result(report, "tp")
    _check_training(results)
    for res in results:
        assert res["attn_norm_input"] == "(Shard(dim=1),)"  # the norms saw sequence-sharded DTensors
        assert res["norm_weight_grad_placements"] == "(Partial(sum),)"  # as torch's own strategy
        assert res["comm_normkit_fwd_bwd"] == res["comm_torch_fwd_bwd"]  # normkit adds no collective
        for s in res["steps"]:
            assert math.isclose(s["loss_normkit"], s["loss_unsharded_torch"], rel_tol=LOSS_RTOL), s


def test_dtensor_ops_run_locally(report):
    for results in _result(report, "ops"):
        for name, r in results.items():
            if name == "add_rms_norm-dropout":
                assert r["masks_differ"] and 0.3 < r["kept"] < 0.7 and r["placements"] == "(Shard(dim=1),)", r
                continue
            assert r["fwd_collectives"] == 0 and r["bwd_collectives"] == 0, (name, r)  # no gather, no reduce
            assert r["is_dtensor"] and r["placements"] == r["expected_placements"], (name, r)
            assert r["y_err"] <= OP_ATOL and max(r["grad_errs"]) <= OP_ATOL, (name, r)
            sharded = "Shard" in r["expected_placements"]
            n_act = 2 if name.startswith("add_") else 1
            for g in r["grad_placements"][n_act:]:  # weight / bias: pending sums over the shards
                assert g == ("(Partial(sum),)" if sharded else "(Replicate(),)"), (name, r)


def test_dtensor_double_backward_matches_torch(report):
    """create_graph through normkit ops on sharded DTensors: the first gradient stays a DTensor with
    the input's placements, and the gradient penalty's gradients (which need the op's double
    backward) match torch's on the full tensors, for every input and parameter (fp64)."""
    for results in _result(report, "higher"):
        cases = {n: r for n, r in results.items() if "g_err" in r}
        assert len(cases) == len(_double_backward_cases()), sorted(cases)
        for name, r in cases.items():
            assert r["g_is_dtensor"] and r["g_placements"] == r["expected_placements"], (name, r)
            assert r["grads_missing"] == [], (name, r)
            assert r["g_err"] <= 1e-9 and max(r["grad_errs"]) <= 1e-9, (name, r)


def test_dtensor_channels_last_kept(report):
    """channels_last / channels_last_3d GroupNorm and BatchNorm on DTensors: each shard's output
    (and the global view) keeps the layout; values and gradients as torch's on the full tensor."""
    for results in _result(report, "higher"):
        cases = {n: r for n, r in results.items() if "local_keeps_layout" in r}
        assert len(cases) == 4, sorted(cases)
        for name, r in cases.items():
            assert r["local_keeps_layout"] and r["global_keeps_layout"], (name, r)
            assert r["placements"] == r["expected_placements"], (name, r)
            assert r["y_err"] <= OP_ATOL and max(r["grad_errs"]) <= OP_ATOL, (name, r)


def test_dtensor_ops_compile_fullgraph(report):
    for r in _result(report, "compile"):
        assert r["placements"] == "(Shard(dim=1),)" and r["weight_grad_placements"] == "(Partial(sum),)", r
        assert r["y_err"] <= OP_ATOL and max(r["grad_errs"]) <= OP_ATOL, r


@pytest.mark.parametrize("case,words", [
    ("layer_norm-shard-normalized-dim", ["input", "Shard(dim=2)", "accepted", "Shard(d) with d < 2"]),
    ("rms_norm-shard-2d-normalized", ["input", "Shard(dim=1)", "d < 1"]),
    ("softmax-shard-dim", ["input", "Shard(dim=2)", "d != dim"]),
    ("rms_norm-partial-input", ["input", "Partial", "accepted"]),
    ("layer_norm-plain-weight", ["weight", "DTensor", "Replicate()"]),
    ("layer_norm-sharded-weight", ["weight", "Shard(dim=0)", "Replicate()"]),
    ("add_rms_norm-plain-residual", ["residual", "plain Tensor", "Shard(dim=1)"]),
    ("layer_norm-plain-input-dtensor-weight", ["weight is a DTensor", "input is a Tensor"]),
    ("batch_norm-train-shard-batch", ["input", "Shard(dim=0)", "SyncBatchNorm"]),
    ("group_norm-shard-channels", ["input", "Shard(dim=1)", "Shard(0)"]),
    ("instance_norm-running-stats-shard-batch", ["input", "Shard(dim=0)", "running statistics"]),
    ("batch_norm-eval-shard-channels", ["input", "Shard(dim=1)", "d != 1"]),
    ("layer_norm-weight-on-another-mesh", ["weight", "mesh", "expected the input's mesh"]),
    ("batch_norm-sharded-running-mean", ["running_mean", "Shard(dim=0)", "Replicate()"]),
])  # fmt: skip
def test_unsupported_placements_raise_clear_errors(report, case, words):
    for results in _result(report, "errors"):
        r = results[case]
        assert r["is_invalid_argument"], r
        for w in words:
            assert w in r["message"], (w, r["message"])


def _docs_example() -> str:
    text = (ROOT / "docs" / "distributed.md").read_text()
    blocks = re.findall(r"```python\n(# fsdp_tp_example\.py.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/distributed.md must hold one block starting with '# fsdp_tp_example.py'"
    return blocks[0]


def test_docs_fsdp_tp_example_runs(report, tmp_path):
    """The runnable example of docs/distributed.md, under torchrun: 2 CPU ranks (gloo) in CI; on CUDA
    NCCL ranks, 4 (a 2 x 2 dp x tp mesh) when 4 GPUs are present, else 2 (dp = 1, tp = 2)."""
    script = tmp_path / "fsdp_tp_example.py"
    script.write_text(_docs_example())
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": str(ROOT)}
    if report["device"] == "cpu":
        nproc, env["CUDA_VISIBLE_DEVICES"] = WORLD, ""
    else:
        nproc = 4 if torch.cuda.device_count() >= 4 else WORLD
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--master-port", str(_free_port()), str(script)],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    log_dir = os.environ.get("NORMKIT_DIST_LOG")
    if log_dir:
        log = Path(log_dir, f"docs-example-{report['device']}-{nproc}ranks.txt")
        log.write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    mesh = f"mesh {(nproc // 2, 2)}"
    assert "step 2" in proc.stdout and "normkit" in proc.stdout and mesh in proc.stdout, proc.stdout
