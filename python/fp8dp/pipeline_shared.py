"""Parameters shared between pipeline stages (contract C15): Megatron's tied embedding / output
weight, or one module placed on two stages.

Each stage that holds a shared parameter keeps its own copy of it, in its own
fp8dp.DistributedDataParallel, as Megatron's first and last stage each hold a word-embedding
weight. Three things make the copies one parameter:

- **Found or declared.** A Parameter object that blocks of two stages reach is shared (every
  rank builds the whole block list, so every rank finds the same); so is every group of names
  passed as ``Pipeline(shared_parameters=[["blocks.0.tok.weight", "blocks.4.weight"]])`` (names
  as in the stage modules: ``blocks.<index in the block list>.<path in the block>``), for copies
  that are distinct objects (a model built untied, as Megatron builds it). The ranks compare what
  they found before any group is made: a rank that ties something the others do not raises on
  every rank, naming it.
- **One copy per stage.** Stages on different ranks hold different objects anyway. Two stages on
  one rank (interleaved, zbv) cannot share an object: each stage's DDP owns its parameters' grad
  buffer (a second wrap is refused) and each fp8dp module queues its weight gradients for one
  stage. So a stage that reaches an object an earlier stage of the same rank holds runs on a deep
  copy of its blocks (``Pipeline.modules[k].module`` is what trains; the block objects passed in
  are left as they were).
- **Initialised identical, summed, stepped identical.** At construction every copy takes the
  value of the copy on the lowest stage (a broadcast within each data-parallel replica, before
  the stages are wrapped). Each step, after every local stage's finish_grad_sync() and scaling,
  the copies' gradients are replaced by their sum over the stages (Megatron's embedding-group
  all-reduce), so every copy gets the same total, bit for bit, and an element-wise optimizer
  steps the copies alike:
  * plain data parallelism: main_grad is the data-parallel mean on every rank; the ranks of one
    replica that hold copies (the embedding group: same dp rank, the pipeline ranks of the
    stages) sum their local copies and all-reduce that sum.
  * ZeRO-1 (use_distributed_optimizer): after the reduce-scatter a rank holds the reduced
    gradient only of the elements it owns, and which data-parallel rank owns an element of the
    shared parameter differs from stage to stage (the parameter sits at another offset of
    another buffer). An all-reduce within one replica would add a reduced value to an unreduced
    one. Instead every rank that holds a copy, in every replica, puts the elements it owns into
    a zero tensor of the parameter's size, and one all-reduce over all of them sums, for each
    element, exactly one reduced value per stage (adding zeros is exact); each rank copies its
    owned elements back. The masters step on that sum.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import agreement


@dataclass
class SharedParameter:
    """One parameter held by several stages. `copies`: (stage, name in that stage's module), in
    stage order, one per distinct Parameter object of a stage; the first is the source of the
    initial value."""

    copies: list
    shape: tuple
    dtype: torch.dtype
    requires_grad: bool
    replica_group: object = None  # this rank's embedding group (its replica's holders), or None
    full_group: object = None  # every holder of every replica (ZeRO-1), or None
    src_rank: int = -1  # the global rank that holds the first copy in this rank's replica
    local: list | None = None  # [(ddp, index in ddp._params)] of this rank's copies

    def describe(self) -> str:
        names = ", ".join(f"stage {s}: {n}" for s, n in self.copies)
        shape = "x".join(map(str, self.shape))
        return f"[{names}] ({shape}, {str(self.dtype).replace('torch.', '')})"


def _stage_params(blocks, ranges, s: int):
    """(name in the stage module, Parameter) of stage s, every name (duplicates included)."""
    for i in ranges[s]:
        for path, p in blocks[i].named_parameters(remove_duplicate=False):
            yield f"blocks.{i}.{path}", p


def find_shared(blocks: Sequence, ranges: Sequence, declared=None) -> list:
    """The parameters shared between stages: Parameter objects reached from blocks of two or more
    stages, and the declared groups of names (module docstring). Pure: changes nothing.
    ValueError for a declared name that no block has, or copies of different shape, dtype or
    requires_grad."""
    names = {}  # name -> (stage, Parameter)
    for s in range(len(ranges)):
        for n, p in _stage_params(blocks, ranges, s):
            names.setdefault(n, (s, p))
    # Union-find over Parameter objects: an object is linked to itself across stages by
    # identity, and declared names link distinct objects.
    parent = {}

    def find(k):
        while parent.setdefault(k, k) != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    objs = {id(p): p for _, p in names.values()}
    declared = [] if declared is None else declared
    if isinstance(declared, str) or not isinstance(declared, (list, tuple)):
        raise ValueError(
            "shared_parameters: expected a list of groups of parameter names, e.g. "
            f"[['blocks.0.tok.weight', 'blocks.4.weight']], got {declared!r}"
        )
    for gi, group in enumerate(declared):
        if isinstance(group, str) or not isinstance(group, (list, tuple)) or len(group) < 2:
            raise ValueError(
                f"shared_parameters[{gi}]: expected a list of two or more parameter names, "
                f"got {group!r}"
            )
        for n in group:
            if n not in names:
                # Suggest the names of the same block first, then any with the same last part.
                parts = str(n).split(".")
                near = [k for k in names if k.split(".")[:2] == parts[:2]]
                near = sorted(near or [k for k in names if k.endswith("." + parts[-1])])[:6]
                raise ValueError(
                    f"shared_parameters[{gi}]: no parameter named {n!r} in the blocks (names are "
                    f"'blocks.<index in the block list>.<path in the block>'; similar: {near})"
                )
            parent[find(id(names[n][1]))] = find(id(names[group[0]][1]))
    # Stages that reach each root, and the first name of each (stage, object).
    held = {}  # root -> {(stage, id(obj)): name}
    for n, (s, p) in names.items():
        held.setdefault(find(id(p)), {}).setdefault((s, id(p)), n)
    out = []
    for root, copies in held.items():
        if len(copies) < 2:  # one object in one stage: DDP sums its uses (C8)
            continue
        ordered = sorted(copies.items(), key=lambda kv: (kv[0][0], kv[1]))
        first = objs[ordered[0][0][1]]
        for (s, o), n in ordered[1:]:
            p = objs[o]
            if p.shape != first.shape or p.dtype != first.dtype:
                raise ValueError(
                    f"shared_parameters: {n!r} ({list(p.shape)}, {p.dtype}) cannot share with "
                    f"{ordered[0][1]!r} ({list(first.shape)}, {first.dtype}): copies need the "
                    "same shape and dtype"
                )
            if p.requires_grad != first.requires_grad:
                raise ValueError(
                    f"shared_parameters: {n!r} has requires_grad={p.requires_grad} but "
                    f"{ordered[0][1]!r} has {first.requires_grad}: copies of one parameter are "
                    "trained or frozen together"
                )
        out.append(
            SharedParameter(
                copies=[(s, n) for (s, _), n in ordered],
                shape=tuple(first.shape),
                dtype=first.dtype,
                requires_grad=first.requires_grad,
            )
        )
    out.sort(key=lambda t: t.copies)
    return out


def check_ranks_agree(shared: list, group=None) -> None:
    """ValueError on every rank when the ranks found different shared parameters (a model tied
    on some ranks only): the groups made next would not match and the step would hang. C12's one
    check (agreement.py), over one field: every tie this rank found."""
    agreement.check_ranks_agree(
        dist.group.WORLD if group is None else group,
        "Pipeline shared parameters (build the same model, with the same ties and "
        "shared_parameters, on every rank)",
        lambda: [("shared parameters", "; ".join(t.describe() for t in shared) or "none")],
    )


def untie_local_stages(blocks: Sequence, ranges: Sequence, local_stages: Sequence) -> dict:
    """{stage: {block index: block}} of this rank's stages: a stage that reaches a module or
    parameter that an earlier local stage reaches gets a deep copy of all its blocks (one memo,
    so ties inside the stage survive); the others get the blocks as passed (module docstring)."""
    claimed, out = set(), {}
    for s in local_stages:
        mine = {i: blocks[i] for i in ranges[s]}
        reach = {id(o) for b in mine.values() for o in (*b.modules(), *b.parameters())}
        if reach & claimed:
            memo = {}
            mine = {i: copy.deepcopy(b, memo) for i, b in mine.items()}
            reach = {id(o) for b in mine.values() for o in (*b.modules(), *b.parameters())}
        claimed |= reach
        out[s] = mine
    return out


def make_groups(shared: list, owner: dict, dp_size: int, dp_rank: int, zero1: bool, **kw):
    """Per shared parameter, this replica's embedding group (the pipeline ranks holding a copy,
    at this dp rank) and, with ZeRO-1, the group of every holder of every replica. Every rank
    calls it (new_group is collective); groups of one rank are not made (None)."""
    for t in shared:
        holders = sorted({owner[s] for s, _ in t.copies})
        for d in range(dp_size):
            ranks = [r * dp_size + d for r in holders]
            g = dist.new_group(ranks, **kw) if len(ranks) > 1 else None
            if d == dp_rank:
                t.replica_group = g
        t.src_rank = owner[t.copies[0][0]] * dp_size + dp_rank
        if zero1:
            ranks = [r * dp_size + d for r in holders for d in range(dp_size)]
            t.full_group = dist.new_group(ranks, **kw) if len(ranks) > 1 else None


def _local_params(t: SharedParameter, local: dict) -> list:
    """This rank's copies; `local`: {stage: {block index: block}}."""
    out = []
    for s, n in t.copies:
        if s in local:
            _, i, path = n.split(".", 2)
            out.append(local[s][int(i)].get_parameter(path))
    return out


def prepare(blocks, ranges, owners, groups, zero1: bool, declared) -> tuple:
    """Everything Pipeline.__init__ does for shared parameters before it wraps the stages (module
    docstring): returns (the SharedParameter list, {local stage: {block index: block}})."""
    shared = find_shared(blocks, ranges, declared)
    check_ranks_agree(shared)
    owner = {s: r for r, ss in enumerate(owners) for s in ss}
    backend = dist.get_backend(groups.pp_group)
    make_groups(
        shared,
        owner,
        groups.dp_size,
        groups.dp_rank,
        zero1,
        backend=backend,
        timeout=groups.timeout,
    )
    local = untie_local_stages(blocks, ranges, owners[groups.pp_rank])
    clear_foreign_skip_flags(shared, local)
    broadcast_initial(shared, local)
    return shared, local


def clear_foreign_skip_flags(shared: list, local: dict) -> None:
    """A delayed-wgrad module marks its weight skip_backward_post_hook (its gradient comes from
    backward_dw(), C3). One object shared with a stage where only other modules use it (an
    fp8dp head's weight that is also a plain embedding elsewhere) carries that mark into a stage
    that has no such module, and DDP there would refuse it ("... has no
    register_wgrad_accumulation_and_reduce_hooks()") although autograd delivers its gradient.
    Each local copy belongs to one stage of this rank (untie_local_stages), so its mark is set
    from that stage: kept where a module of the stage that registers it has the delayed-wgrad
    API, cleared elsewhere."""
    for t in shared:
        for s, n in t.copies:
            if s not in local:
                continue
            _, i, path = n.split(".", 2)
            p = local[s][int(i)].get_parameter(path)
            if not getattr(p, "skip_backward_post_hook", False):
                continue
            users = [
                m
                for b in local[s].values()
                for m in b.modules()
                if any(q is p for q in m._parameters.values())
            ]
            if not any(
                callable(getattr(m, "register_wgrad_accumulation_and_reduce_hooks", None))
                for m in users
            ):
                p.skip_backward_post_hook = False


@torch.no_grad()
def broadcast_initial(shared: list, local: dict) -> None:
    """Every copy takes the value of the copy on the lowest stage, within each replica: a
    broadcast over the embedding group from the rank holding that stage. Before the stages are
    wrapped (DDP copies the values into its buffers)."""
    for t in shared:
        mine = _local_params(t, local)
        if not mine:
            continue
        value = mine[0] if t.copies[0][0] in local else torch.empty_like(mine[0])
        if t.replica_group is not None:
            dist.broadcast(value, src=t.src_rank, group=t.replica_group)
        for p in mine:
            if p is not value:
                p.copy_(value)


def bind(shared: list, stage_ddps: dict) -> None:
    """Record (ddp, parameter index) of this rank's copies, once the stages are wrapped."""
    for t in shared:
        t.local = []
        for s, n in t.copies:
            if s in stage_ddps:
                ddp = stage_ddps[s]
                p = ddp.module.get_parameter(n)
                if p.requires_grad:
                    t.local.append((ddp, ddp._index[id(p)]))


@torch.no_grad()
def reduce_grads(shared: list, zero1: bool) -> None:
    """Replace each local copy's gradient by the sum over the stages' copies (module
    docstring). Call after finish_grad_sync() and scaling of every local stage, before any
    optimizer step."""
    for t in shared:
        if not t.local:
            continue
        if not zero1:
            grads = [ddp._params[i].main_grad for ddp, i in t.local]
            total = grads[0].clone()
            for g in grads[1:]:
                total += g
            if t.replica_group is not None:
                dist.all_reduce(total, group=t.replica_group)
            for g in grads:
                g.copy_(total)
            continue
        pieces = []  # (grad shard view, offset in the flattened parameter)
        for ddp, i in t.local:
            for sh in ddp.owned_shards():
                if sh.param == i:
                    pieces.append((ddp.grad_shard(sh), sh.param_offset))
        dtype = t.local[0][0]._params[t.local[0][1]].main_grad.dtype
        device = t.local[0][0]._params[t.local[0][1]].main_grad.device
        flat = torch.zeros(int(torch.Size(t.shape).numel()), dtype=dtype, device=device)
        for g, off in pieces:
            flat[off : off + g.numel()] += g
        if t.full_group is not None:
            dist.all_reduce(flat, group=t.full_group)
        for g, off in pieces:
            g.copy_(flat[off : off + g.numel()])
