"""The pipeline axis of the randomized gradient-accounting property test (C10 — pipelines):
generated models run through fp8dp.pipeline.Pipeline, PP 2 x DP (world / 2), with a schedule
drawn among those the case's block count and micro-batch count allow.

A case is 2-5 blocks, each a graph of property_gen.py (fp8dp Linear /
LayerNormLinear with random bias / fused / delayed routes, torch.nn.Linear, plain parameters
through F.linear and matmul, weights tied or used twice inside the block, frozen parameters),
without what a pipeline block cannot have: the embedding op (a block maps one tensor to one
tensor, so there are no token ids) and ops that run only in some micro-batches (a stage does not
know its micro-batch). With FP8 off, half the cases also tie weights across blocks (contract
C15: the same Parameter object in two blocks, on two stages or one; fp8dp.pipeline keeps a copy
per stage and sums their gradients), which the float64 reference holds as one tensor. Every case runs with
the gradient ledger on, so a gradient that reaches main_grad twice or never (route (a) at the B
step, (b) / (c) at the W step through dw_builder) is an error naming the parameter; and every
local parameter's main_grad after each step is compared with a float64 reference of the whole
model (property_model.reference's method, block by block) with property_model.grad_tolerance's
bound, the ops of all blocks counted. Two steps per case: the first learns the readiness counts,
the second launches buckets from them (the last micro-batch's B and W steps).

Pipeline cases have seeds >= PIPELINE_SEED_BASE, so --case-seed reruns one alone.

Evidence (seed 0, world size 2): its first run found that Pipeline's W runner called
backward_dw() once per delayed module per micro-batch, whatever the B step had queued: 8 of 8
cases failed ("no weight-gradient computation is queued" for an unused module, "never computed
by backward_dw()" for one used twice); fixed in fp8dp/pipeline.py (_StageSync counts). Mutations
tried since, then reverted: that runner capped at one call per module per micro-batch, 10 of 12
cases fail (the ledger's / finish_grad_sync's "never computed"); Pipeline.step without its
1/n_microbatches scaling, 6 of 6 fail with main_grad n_mb times the reference.
Ties across blocks (C15 — shared across stages), seeds 0 and 1: they found that a delayed module's
skip_backward_post_hook mark on a shared object reached a stage without that module (case
2735922621: "parameter 'blocks.4.g.tl.1.weight' has skip_backward_post_hook=True but its module
Linear has no register_wgrad_accumulation_and_reduce_hooks()"; fixed by
pipeline_shared.clear_foreign_skip_flags). Mutation: Pipeline.step without the shared-gradient
sum (reduce_grads), seed 0 with 40 pipeline cases: 5 fail, main_grad of the tied weight holding
one stage's part ("observed 0.0, expected -0.024" on a stage whose block never used it).
"""

from __future__ import annotations

import random
from datetime import timedelta

import property_gen
import property_model
import torch
from torch import nn

import fp8dp
from fp8dp.pipeline import _VIRTUAL, check_backend, check_layout

PIPELINE_SEED_BASE = 2**31
PP = 2
T = 16  # rows per micro-batch, property_gen.T (FP8 GEMMs need multiples of 16)


def is_pipeline_seed(case_seed: int) -> bool:
    return case_seed >= PIPELINE_SEED_BASE


def pipeline_case_seeds(seed: int, n: int, ws: int) -> list:
    rng = random.Random(seed * 104729 + ws)
    return [PIPELINE_SEED_BASE + rng.randrange(2**31) for _ in range(n)]


def _block_config(rng, ws, D, fp8) -> dict:
    """One block: a property_worker configuration without embedding ops, micro-batch-dependent
    ops or a 3-D input, with at least one trainable parameter."""
    c = property_gen.gen_config(rng.randrange(2**31), ws)
    c.update(D=D, fp8=fp8, input_3d=False, forget_dw=False)
    c["ops"] = [["plain_matmul", o[1]] if o[0] == "embed" else o for o in c["ops"]]
    c["when"] = ["all"] * len(c["ops"])
    with torch.random.fork_rng():
        if not any(p.requires_grad for p in property_model.GenModel(c).parameters()):
            c["frozen"] = []  # a stage with nothing to train is refused by DDP, not the point here
    return c


def gen_pipeline_config(case_seed: int, ws: int, torch_version: str = torch.__version__) -> dict:
    """A pipeline case drawn from case_seed. The schedule is drawn among those that fit the
    block and micro-batch counts (check_layout) and that torch_version runs on the worker's
    backend (check_backend: no zbv on gloo before torch 2.13), so on an older torch a seed can
    draw another schedule than on a newer one: the case is still one that the library accepts."""
    rng = random.Random(case_seed)
    D = rng.choice([16, 16, 32])
    fp8 = rng.random() < 0.3
    n_blocks = rng.randint(2, 5)
    n_mb = rng.randint(2, 4)
    choices = []
    for schedule, vs in _VIRTUAL.items():
        for v in vs:
            try:
                check_layout(schedule, PP, v, n_blocks, n_mb)
                check_backend(schedule, property_gen.BACKEND, torch_version)
                choices.append([schedule, v])
            except ValueError:
                pass
    schedule, virtual = rng.choice(choices)
    blocks = [_block_config(rng, ws // PP, D, fp8) for _ in range(n_blocks)]
    ddp = dict(
        grad_ledger=True,  # exactly once, per parameter and micro-batch (C2, C10)
        overlap_grad_reduce=rng.random() < 0.6,
        average_in_collective=rng.random() < 0.5,
        bucket_size=rng.choice([D * D // 2, D * D, 5 * D * D]),
    )
    # Drawn after everything else, so a seed's other choices are those it made before ties.
    cross_ties = []
    if not fp8 and rng.random() < 0.5:  # the FP8 reference's twins do not carry ties
        for _ in range(rng.randint(1, 2)):
            a, b = sorted(rng.sample(range(n_blocks), 2))
            cross_ties.append([a, rng.choice(_slots(blocks[a])), b, rng.choice(_slots(blocks[b]))])
    c = dict(
        case_seed=case_seed,
        ws=ws,
        pattern="pipeline",
        D=D,
        fp8=fp8,
        schedule=schedule,
        virtual_stages=virtual,
        n_mb=n_mb,
        steps=2,
        blocks=blocks,
        ddp=ddp,
        cross_ties=cross_ties,
    )
    # The FP8 recipe, drawn last (property_gen.py does the same for its cases).
    c["recipe"] = rng.choice(["current", "block"]) if fp8 else "current"
    return c


def _slots(cb) -> list:
    """A block's [D, D] weight slots (GenModel._weight): fp8 and torch Linear weights, plain (a
    LayerNormMLP has none)."""
    return (
        [["fp8", i] for i, m in enumerate(cb["fp8_mods"]) if not property_gen.is_mlp(m)]
        + [["tl", i] for i in range(len(cb["tl_mods"]))]
        + [["plain", i] for i in range(cb["n_plain"])]
    )


def tie_across_blocks(c, blocks) -> None:
    """Block b's weight slot takes block a's Parameter object. Skipped (the same decision on every
    rank) unless both are trainable and b's object fills that slot alone: replacing one slot of
    a tie inside block b would leave its old object in the other slot, still marked by the
    module that no longer holds it (a model DDP rightly refuses, pipelined or not)."""
    for a, sa, b, sb in c.get("cross_ties", []):
        pa, pb = blocks[a].g._weight(tuple(sa)), blocks[b].g._weight(tuple(sb))
        alone = sum(blocks[b].g._weight(tuple(x)) is pb for x in _slots(c["blocks"][b])) == 1
        if pa.requires_grad and pb.requires_grad and pa is not pb and alone:
            blocks[b].g._set_weight(tuple(sb), pa)


class PipeBlock(nn.Module):
    """A generated graph as a pipeline block: one tensor in, one out."""

    def __init__(self, c):
        super().__init__()
        self.g = property_model.GenModel(c)

    def forward(self, x):
        return self.g(None, x)


_GROUPS = {}  # world size -> PipelineGroups, made once per launch (new_group is collective)


def reset_groups() -> None:
    """After a failed case (a transfer may be pending on some ranks only): make new groups at
    the next pipeline case. Every rank calls it together (property_run.Runner.run)."""
    _GROUPS.clear()


def _groups(ws: int, timeout_s: float):
    from fp8dp.pipeline import make_groups

    if ws not in _GROUPS:
        _GROUPS[ws] = make_groups(PP, timeout=timedelta(seconds=timeout_s))
    return _GROUPS[ws]


def _data(c, step, dp):
    g = torch.Generator().manual_seed(c["case_seed"] % 2**31 * 1009 + step)
    shape = (dp, c["n_mb"] * T, c["D"])
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def reference(c, blocks, x, y, dp):
    """float64 gradient {id(param): g} and magnitudes {id(param): A} (property_model.reference's
    definitions) of the pipeline's loss: the mean over dp ranks of the mean over micro-batches of
    each micro-batch's mse, through every block in order."""
    n_mb = c["n_mb"]
    named = [(b, n, p) for b in blocks for n, p in b.g.named_parameters()]
    # A weight tied across blocks appears in both: one entry (its gradient is summed once).
    train = list({id(p): p for _, _, p in named if p.requires_grad}.values())
    total = {id(p): torch.zeros(p.shape, dtype=torch.float64) for p in train}
    mag = {id(p): torch.zeros(p.shape, dtype=torch.float64) for p in train}
    if not c["fp8"]:
        R = {id(p): p.detach().double().clone().requires_grad_(p.requires_grad) for *_, p in named}
        for d in range(dp):
            for k in range(n_mb):
                h = x[d, k * T : (k + 1) * T].double()
                for b in blocks:
                    h = property_model.ref_forward64(b.g, R, None, h, k)
                loss = property_model.mse(h, y[d, k * T : (k + 1) * T].double()) / n_mb
                if not loss.requires_grad:  # no trainable parameter on its path: nothing to add
                    continue
                grads = torch.autograd.grad(loss, [R[id(p)] for p in train], allow_unused=True)
                for p, g in zip(train, grads):
                    if g is not None:
                        total[id(p)] += g
                        mag[id(p)] += g.abs()
    else:
        # FP8 on: twins of the blocks (unfused, immediate wgrad, no DDP), the same current
        # scaling, so both sides cast the same values to the same bytes (property_worker).
        twins = []
        for b, cb in zip(blocks, c["blocks"]):
            t = property_model.GenModel(cb, fuse_and_delay=False)
            with torch.no_grad():
                for (_, p), (_, q) in zip(b.g.named_parameters(), t.named_parameters()):
                    q.copy_(p.detach())
            twins.append(t)
        pairs = [
            (p, q)
            for b, t in zip(blocks, twins)
            for (_, p), (_, q) in zip(b.g.named_parameters(), t.named_parameters())
            if p.requires_grad
        ]
        for d in range(dp):
            for k in range(n_mb):
                for t in twins:
                    t.zero_grad(set_to_none=True)
                h = x[d, k * T : (k + 1) * T]
                with fp8dp.fp8_autocast(enabled=True, fp8_recipe=property_model.recipe_of(c)):
                    for t in twins:
                        h = t(None, h, is_first_microbatch=None)
                # The pipeline's loss is each micro-batch's mse, and main_grad is divided by n_mb
                # afterwards; dividing the loss instead would scale the gradients that the FP8
                # backward casts by 1/n_mb, inexact for n_mb = 3, and current scaling can then
                # round an element to the other FP8 neighbour (seen: seed 7, case 2223644665).
                loss = property_model.mse(h, y[d, k * T : (k + 1) * T])
                if loss.requires_grad:
                    loss.backward()
                for p, q in pairs:
                    if q.grad is not None:
                        total[id(p)] += q.grad.double() / n_mb
                        mag[id(p)] += q.grad.double().abs() / n_mb
    for k in total:
        total[k] /= dp
        mag[k] /= dp
    return total, mag


def run_case(c, found, timeout_s: float) -> int:
    """Runs a pipeline configuration; appends each step's first mismatch to `found`; returns the
    number of checks. Every rank runs the same schedule whatever its checks find."""
    from fp8dp.pipeline import Pipeline

    ws, dp = c["ws"], c["ws"] // PP
    groups = _groups(ws, timeout_s)
    torch.manual_seed(c["case_seed"] % 2**31)
    blocks = [PipeBlock(cb) for cb in c["blocks"]]
    tie_across_blocks(c, blocks)
    any_delay = any(m["delay"] for cb in c["blocks"] for m in cb["fp8_mods"])
    cfg = fp8dp.DistributedDataParallelConfig(delay_wgrad_compute=any_delay, **c["ddp"])
    ex = torch.empty(T, c["D"])
    pp = Pipeline(
        blocks,
        groups,
        schedule=c["schedule"],
        n_microbatches=c["n_mb"],
        loss_fn=property_model.mse,
        microbatch_input=ex,
        activation=ex,
        microbatch_output=ex,
        virtual_stages=c["virtual_stages"],
        ddp_config=cfg,
    )
    for ddp in pp.modules:
        ddp._sync.communicator().set_timeout(timeout_s)
    tol_case = dict(
        ws=dp,
        n_mb=c["n_mb"],
        D=c["D"],
        ops=[o for cb in c["blocks"] for o in cb["ops"]],
        mlp_acts=[a for cb in c["blocks"] for a in property_model.mlp_acts(cb)],
        out_acts=sum(property_model.out_acts(cb) for cb in c["blocks"]),
    )
    name_of = {}
    for ddp in pp.modules:
        for n, p in ddp.module.named_parameters():
            name_of.setdefault(id(p), n)
    checks = 0
    for step in range(c["steps"]):
        x, y = _data(c, step, dp)
        ref, mag = reference(c, blocks, x, y, dp)
        with fp8dp.fp8_autocast(enabled=c["fp8"], fp8_recipe=property_model.recipe_of(c)):
            pp.step(
                *((x[groups.dp_rank],) if pp.is_first else ()),
                target=y[groups.dp_rank] if pp.is_last else None,
            )
        bad = None
        for ddp in pp.modules:
            for n, p in ddp.module.named_parameters():
                # A stage that runs on a deep copy (a tie within one rank): the reference is
                # the block's own parameter, by name.
                _, i, path = n.split(".", 2)
                orig = blocks[int(i)].get_parameter(path)
                if not p.requires_grad:
                    if hasattr(p, "main_grad"):
                        bad = bad or dict(step=step, what="frozen parameter has main_grad", param=n)
                    continue
                tol = property_model.grad_tolerance(tol_case, mag[id(orig)])
                bad = bad or property_model.first_mismatch(
                    step, "main_grad", n, p.main_grad, ref[id(orig)], tol
                )
                if p.grad is not None:
                    bad = bad or dict(step=step, what="p.grad is not None after the sync", param=n)
                checks += 1
            for n, m in ddp.module.named_modules():
                if isinstance(m, (fp8dp.Linear, fp8dp.LayerNormLinear)) and m.need_backward_dw():
                    bad = bad or dict(step=step, what="queue not empty", param=n)
        if bad:
            found.append(bad)
    return checks
