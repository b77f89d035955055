"""What the ranks must agree on (contract C12), as (name, value) text fields, and the one call
that compares them: ``check_ranks_agree``, glue around ``_C.check_ranks_agree`` (src/comm/
agreement.h), which gathers a fingerprint of every rank's fields in one small all-gather and, only
when they differ, the fields themselves, then raises ValueError on every rank naming the object
being built, the first differing field and each rank's value.

DistributedDataParallel, DistributedOptimizer and Pipeline call it once, at construction, before
anything that could fail on one rank only or run a collective whose size depends on a field. The
field lists below are built from what the ranks must share: a field added to
DistributedDataParallelConfig later is covered without an edit here (dataclasses.fields)."""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.distributed as dist

from . import _C


def _device(group) -> torch.device:
    """Where the check's small tensors live: NCCL takes CUDA tensors only, other backends CPU."""
    try:
        backend = dist.get_backend(group)
    except (ValueError, RuntimeError, AttributeError):  # a group torch.distributed did not make
        backend = group.name() if callable(getattr(group, "name", None)) else ""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_ranks_agree(group, what: str, fields) -> None:
    """Every rank of `group` calls it with its own fields (an iterable of (name, value) pairs,
    values turned into text with str(), or a callable returning one, called only when the group
    has more than one rank), in the same order. Returns when they agree (one all-gather of four
    int64 per rank); raises ValueError on every rank otherwise (see the module docstring). It
    runs on a process-group communicator of its own: the communicator a DDP picks depends on
    fields being compared (comm_backend), and building a native NCCL one is itself collective."""
    if group.size() == 1:
        return  # nothing to compare with
    comm = _C.ProcessGroupCommunicator(group)
    fields = [(str(n), str(v)) for n, v in (fields() if callable(fields) else fields)]
    _C.check_ranks_agree(comm, fields, what, _device(group))


def _tensor(t: torch.Tensor) -> str:
    """dtype, shape and device type (not the index: each rank has its own GPU)."""
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)} on {t.device.type}"


def _fp8_options(m) -> str:
    """An fp8dp module's construction options (they decide its gradients' routes)."""
    opts = ", ".join(f"{k}={v!r}" for k, v in sorted(m._core_args.items()))
    return (
        f"{m._core.name} fuse_wgrad_accumulation={m.fuse_wgrad_accumulation} "
        f"delay_wgrad_compute={m.delay_wgrad_compute} {opts}"
    )


def _fp8_recipe(m) -> str:
    """The delayed-scaling recipe of an fp8dp module's scaling state, where one is fixed already
    (a cast before wrapping, a restored checkpoint); the first cast fixes it otherwise, and
    update_fp8_scales compares it then (C9)."""
    state = m._core.get_extra_state()
    if state is None:
        return "no FP8 cast yet"
    return (
        f"history={state['amax_history'].shape[0]} algo={state['amax_compute_algo']} "
        f"margin={state['margin']} fp8_max={state['fp8_max'].tolist()}"
    )


def ddp_fields(module, config, process_group, named_params) -> list:
    """What every rank of a DistributedDataParallel must share: world size, every config field,
    the resolved bucket size and communicator, the trainable parameters in order (name, dtype,
    shape, device type, delayed wgrad) and the fp8dp modules' options and recipes."""
    from .modules import _FP8LinearBase

    dp = process_group.size()
    out = [("world size", dp)]
    out += [(f"config.{f.name}", repr(getattr(config, f.name))) for f in dataclasses.fields(config)]
    out.append(("resolved bucket size", config.resolved_bucket_size(dp)))
    cuda = bool(named_params) and named_params[0][1].is_cuda
    native = config.comm_backend == "nccl" or (
        config.comm_backend == "auto" and cuda and _C.native_nccl_available()
    )
    out.append(("communicator", "native nccl" if native else "process group"))
    out.append(("trainable parameters", len(named_params)))
    for i, (name, p) in enumerate(named_params):
        delayed = " (delayed wgrad)" if getattr(p, "skip_backward_post_hook", False) else ""
        out.append((f"parameter {i}", f"{name}: {_tensor(p)}{delayed}"))
    fp8 = {}
    for name, m in module.named_modules():
        if isinstance(m, _FP8LinearBase):
            fp8.setdefault(m, name or "(root)")
    out.append(("fp8dp modules", len(fp8)))
    for m, name in fp8.items():
        out += [(f"fp8dp module {name}", _fp8_options(m))]
        out += [(f"fp8dp module {name} recipe", _fp8_recipe(m))]
    return out


def optimizer_fields(optimizer_cls, kwargs: dict, ddp) -> list:
    """What every rank of a DistributedOptimizer must share: the optimizer class, every
    hyperparameter of its param groups (the constructor's defaults with `kwargs` applied, so
    that a default that differs between torch versions is compared too), the world size and the
    bucket layout that the owned shards come from (rank r steps chunk r of every bucket)."""
    cls = optimizer_cls
    name = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else repr(cls)
    out = [("optimizer class", name)]
    hyper = {}
    try:
        params = inspect.signature(cls).parameters.values() if callable(cls) else ()
    except (TypeError, ValueError):
        params = ()
    for p in params:
        if p.name != "params" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            hyper[p.name] = "(required)" if p.default is p.empty else repr(p.default)
    for k in kwargs:
        hyper[k] = repr(kwargs[k])
    out += [(f"optimizer {k}", v) for k, v in hyper.items()]
    out.append(("world size", ddp.world_size))
    out.append(("bucket layout (buffer, dtype, offset, numel, params)", ddp._sync.buckets()))
    return out


def pipeline_fields(blocks, groups, **settings) -> list:
    """What every rank of a Pipeline must share: the settings (schedule, n_microbatches,
    virtual_stages, ...), the pp × dp layout, the example micro-batch tensors (dtype, shape) and
    every block's class and parameters; plus one verdict each rank computes for itself, whether
    its PipelineGroups matches its ranks in the groups, so that a rank with a wrong layout fails
    every rank, not only itself while the others wait in a collective."""
    out = [("world size", dist.get_world_size())]
    out += [("pipeline_parallel_size", groups.pp_size), ("data parallel size", groups.dp_size)]
    from .ddp_config import DistributedDataParallelConfig

    for k, v in settings.items():
        if k == "ddp_config" and v is None:  # None means the defaults: equal to passing them
            v = DistributedDataParallelConfig()
        out.append((k, _tensor(v) if isinstance(v, torch.Tensor) else repr(v)))
    place = (
        groups.pp_size * groups.dp_size,
        dist.get_rank(groups.pp_group),
        dist.get_rank(groups.dp_group),
        dist.get_rank() // max(groups.dp_size, 1),
        dist.get_rank() % max(groups.dp_size, 1),
    )
    want = (dist.get_world_size(), groups.pp_rank, groups.dp_rank, groups.pp_rank, groups.dp_rank)
    verdict = (
        "consistent"
        if place == want
        else (
            f"inconsistent: pp_rank {groups.pp_rank}, dp_rank {groups.dp_rank}, rank "
            f"{place[1]} in pp_group, {place[2]} in dp_group, global rank {dist.get_rank()} "
            f"(expected pp_rank * dp_size + dp_rank, make_groups' order)"
        )
    )
    out.append(("this rank's place in groups (PipelineGroups)", verdict))
    out.append(("blocks", len(blocks)))
    for i, b in enumerate(blocks):
        ps = "; ".join(f"{n}: {_tensor(p)}" for n, p in b.named_parameters())
        out.append((f"block {i}", f"{type(b).__qualname__}({ps})"))
    return out
