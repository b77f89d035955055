"""Contract C12 (harness.py's registry): what the ranks must share is compared once, when
DistributedDataParallel, DistributedOptimizer and Pipeline are built, and a difference raises
ValueError on EVERY rank naming the object, the first differing field and each rank's value
(src/comm/agreement.h). Odd ranks build with one value, even ranks with another, so the
expected message is exact: "rank 0 A, rank 1 B" at 2 ranks, "ranks 0,2 A, rank 1 B" at 3.
After the error every case runs one all-reduce on the world group: nothing was left half-done
in a collective, the ranks are still in step.

What each difference did before the check (C12 — ranks agree): average_in_collective gave a
different wrong mean per rank, grad_reduce_wire hung until the process-group timeout, five other
fields aborted the process inside gloo, and a per-rank n_microbatches silently consumed another
rank's pipeline steps.

Mutations tried (each case family failed, then the call was restored), at world size 2:
- the check_ranks_agree call removed from DistributedDataParallel.__init__: all 20
  agreement_ddp_config / agreement_ddp_model cases failed. 16 with "expected ValueError naming
  ..., construction passed" on both ranks (the difference surfaces only later: a wrong mean, a
  hang, an abort in gloo); shape and count with GradSync's layout error instead of the named
  field; dtype (a float64 parameter on one rank) with a local error on that rank while the other
  waited in GradSync's layout all-gather until the group's 60 s timeout ("Timed out waiting
  60000ms"). The harness bounds such hangs: a 60 s group timeout in worker.py, 600 s per launch.
- the call removed from DistributedOptimizer.__init__: all 4 agreement_optimizer cases failed,
  "construction passed" on both ranks.
- the call removed from Pipeline.__init__: all 7 agreement_pipeline cases failed, "construction
  passed" on both ranks (each rank's own check_layout accepts its own settings).
The number of collectives the check costs (one all-gather when the ranks agree, two on a
difference) is counted in tests/cpp/test_agreement.cpp.
"""

import dataclasses

import cases_ddp
import torch
import torch.distributed as dist
from cases_ddp import mlp
from harness import case
from torch import nn

import fp8dp
from fp8dp import DistributedDataParallelConfig

# For each config field: (value on even ranks, value on odd ranks, fields both need to be valid).
# A field added to the config later fails its case until it has a line here.
DIFFERS = {
    "grad_reduce_in_fp32": (True, False, {}),
    "overlap_grad_reduce": (False, True, {}),
    "use_distributed_optimizer": (False, True, {}),
    "overlap_param_gather": (False, True, {"use_distributed_optimizer": True}),
    "bucket_size": (None, 1000, {}),
    "average_in_collective": (False, True, {}),
    "check_for_nan_in_grad": (False, True, {}),
    "defer_nan_check": (
        False,
        True,
        {"check_for_nan_in_grad": True, "use_distributed_optimizer": True},
    ),
    "pad_buckets_for_high_nccl_busbw": (False, True, {"use_distributed_optimizer": True}),
    "delay_wgrad_compute": (False, True, {}),
    "grad_ledger": (False, True, {}),
    "nccl_blocking_wait": (False, True, {}),
    "nccl_high_priority_stream": (True, False, {}),
    "grad_reduce_wire": ("fp32", "bf16", {}),
    "comm_backend": ("auto", "process_group", {}),
}


def _ranks_text(ranks) -> str:
    """As the C++ message writes rank lists: "rank 2", "ranks 0,2", "ranks 0-3,5"."""
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(
            str(ranks[i])
            if j == i
            else f"{ranks[i]},{ranks[j]}" if j == i + 1 else f"{ranks[i]}-{ranks[j]}"
        )
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts)


def _groups(values) -> dict:
    """value -> the ranks that have it, in order of first appearance (as the message groups)."""
    groups = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    return groups


def _by_value(values) -> str:
    return ", ".join(f"{_ranks_text(rs)} {v}" for v, rs in _groups(values).items())


def expect_disagreement(build, what: str, field: str, values, exact: bool = True) -> None:
    """build() must raise ValueError "<what>: ranks disagree on <field>: <each rank's value>" on
    this rank (values: every rank's value as the message shows it; exact=False: the start of
    each, for values too long to spell out); then the world group must still work (one
    all-reduce)."""
    head = f"{what}: ranks disagree on {field}: "
    expected = head + _by_value(values)
    try:
        build()
    except ValueError as e:
        msg = str(e)
        if exact:
            assert expected in msg, f"expected {expected!r} in the error, got {msg}"
        else:
            assert head in msg, f"expected {head!r} in the error, got {msg}"
            for r, v in enumerate(values):
                shown = f"{_ranks_text(_groups(values)[v])} {v}"
                assert (
                    shown in msg
                ), f"expected rank {r}'s value as {shown!r} in the error, got {msg}"
    else:
        raise AssertionError(f"expected ValueError naming {expected!r}, construction passed")
    one = torch.ones(1, device=cases_ddp.DEV)
    dist.all_reduce(one)
    assert one.item() == dist.get_world_size(), "the world group is out of step after the error"


def _config_fields():
    return [f.name for f in dataclasses.fields(DistributedDataParallelConfig)]


@case(field=_config_fields())
def agreement_ddp_config(rank, ws, field):
    """Every DistributedDataParallelConfig field (dataclasses.fields: one added later comes in by
    itself), different on odd ranks: every rank raises naming config.<field> and both values."""
    assert field in DIFFERS, f"DIFFERS: add an (even, odd, needs) entry for the new field {field!r}"
    even, odd, needs = DIFFERS[field]
    cfg = DistributedDataParallelConfig(**needs, **{field: odd if rank % 2 else even})
    expect_disagreement(
        lambda: fp8dp.DistributedDataParallel(mlp(), cfg),
        "DistributedDataParallel",
        f"config.{field}",
        [repr(odd if r % 2 else even) for r in range(ws)],
    )


class _FP8Model(nn.Module):
    def __init__(self, fuse: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.fc = fp8dp.Linear(16, 16, device=cases_ddp.DEV, fuse_wgrad_accumulation=fuse)

    def forward(self, x):
        return self.fc(x)


def _fp8_cast(model, history: int) -> None:
    """One FP8 forward: the module's scaling state now has a recipe (history length)."""
    r = fp8dp.DelayedScaling(amax_history_len=history)
    with fp8dp.fp8_autocast(fp8_recipe=r):
        model(torch.randn(16, 16, device=cases_ddp.DEV))


@case(what=["shape", "count", "dtype", "name", "fp8_option", "fp8_recipe"])
def agreement_ddp_model(rank, ws, what):
    """The model differs on odd ranks: a parameter's shape, the number of parameters, a dtype, a
    name (same shapes), an fp8dp module's construction option, or its recipe (a module cast with
    another amax history length before wrapping). Every rank raises naming the first difference."""
    odd = rank % 2 == 1
    dev = cases_ddp.DEV.type
    if what in ("fp8_option", "fp8_recipe"):
        model = _FP8Model(fuse=what == "fp8_option" and odd)
        if what == "fp8_recipe":
            _fp8_cast(model, 4 if odd else 8)
            field = "fp8dp module fc recipe"
            values = [f"history={4 if r % 2 else 8} " for r in range(ws)]
        else:
            field = "fp8dp module fc"
            values = [
                f"{model.fc._core.name} fuse_wgrad_accumulation={bool(r % 2)} " for r in range(ws)
            ]
        expect_disagreement(
            lambda: fp8dp.DistributedDataParallel(model),
            "DistributedDataParallel",
            field,
            values,
            exact=False,
        )
        return
    torch.manual_seed(0)
    width = 24 if what == "shape" and odd else 20
    layers = [nn.Linear(12, width), nn.Tanh(), nn.Linear(width, 5)]
    if what == "count" and odd:
        layers.append(nn.Linear(5, 5))
    if what == "name" and odd:
        layers.insert(2, nn.Identity())
    model = nn.Sequential(*layers).to(cases_ddp.DEV)
    if what == "dtype" and odd:
        model[2].bias.data = model[2].bias.data.double()
    field, values = {
        "shape": (
            "parameter 0",
            [f"0.weight: float32 [{24 if r % 2 else 20}, 12]" for r in range(ws)],
        ),
        "count": ("trainable parameters", [6 if r % 2 else 4 for r in range(ws)]),
        "dtype": (
            "parameter 3",
            [f"2.bias: {'float64' if r % 2 else 'float32'} [5]" for r in range(ws)],
        ),
        "name": (
            "parameter 2",
            [f"{3 if r % 2 else 2}.weight: float32 [5, 20]" for r in range(ws)],
        ),
    }[what]
    if what != "count":
        values = [f"{v} on {dev}" for v in values]
    expect_disagreement(
        lambda: fp8dp.DistributedDataParallel(model), "DistributedDataParallel", field, values
    )


@case(field=["class", "lr", "betas", "extra_kwarg"])
def agreement_optimizer(rank, ws, field):
    """DistributedOptimizer built with another class or hyperparameter on odd ranks (an extra
    kwarg on odd ranks only, where the even ranks keep the default): every rank raises naming it."""
    odd = rank % 2 == 1
    ddp = fp8dp.DistributedDataParallel(
        mlp(), DistributedDataParallelConfig(use_distributed_optimizer=True)
    )
    cls, kwargs = torch.optim.AdamW, {"lr": 0.01}
    name = "optimizer lr"
    if field == "class":
        cls = torch.optim.Adam if odd else torch.optim.AdamW
        name = "optimizer class"
        values = [
            "torch.optim.adam.Adam" if r % 2 else "torch.optim.adamw.AdamW" for r in range(ws)
        ]
    elif field == "lr":
        kwargs = {"lr": 0.02 if odd else 0.01}
        values = ["0.02" if r % 2 else "0.01" for r in range(ws)]
    elif field == "betas":
        kwargs = {"lr": 0.01, "betas": (0.8, 0.99) if odd else (0.9, 0.999)}
        name = "optimizer betas"
        values = ["(0.8, 0.99)" if r % 2 else "(0.9, 0.999)" for r in range(ws)]
    else:
        if odd:
            kwargs["weight_decay"] = 0.5
        name = "optimizer weight_decay"
        values = ["0.5" if r % 2 else "0.01" for r in range(ws)]
    expect_disagreement(
        lambda: fp8dp.DistributedOptimizer(cls, ddp, **kwargs), "DistributedOptimizer", name, values
    )


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x))


@case(
    runs=("gloo",),
    field=[
        "n_microbatches",
        "schedule",
        "virtual_stages",
        "microbatch_shape",
        "activation_dtype",
        "blocks",
        "scale_grads",
    ],
)
def agreement_pipeline(rank, ws, field):
    """A Pipeline (pipeline_parallel_size = world size) built with a setting that differs on odd
    ranks: every rank raises naming it, before any stage, schedule or send exists. Today's worst,
    a per-rank n_microbatches, silently consumed another rank's steps."""
    from fp8dp.pipeline import Pipeline, make_groups

    odd = rank % 2 == 1
    groups = make_groups(ws)
    torch.manual_seed(0)
    n_blocks = 2 * ws + (1 if field == "blocks" and odd else 0)
    blocks = [_Block() for _ in range(n_blocks)]
    ex = torch.empty(4, 8)
    kw = dict(
        schedule="interleaved_1f1b",
        n_microbatches=ws,
        loss_fn=torch.nn.functional.mse_loss,
        microbatch_input=ex,
        activation=ex,
        microbatch_output=ex,
        virtual_stages=1,
    )
    shown = {
        "n_microbatches": (ws, 2 * ws),
        "schedule": ("'interleaved_1f1b'", "'1f1b'"),
        "virtual_stages": (1, 2),
        "microbatch_input": ("float32 [4, 8] on cpu", "float32 [5, 8] on cpu"),
        "activation": ("float32 [4, 8] on cpu", "float64 [4, 8] on cpu"),
        "blocks": (2 * ws, 2 * ws + 1),
        "scale_grads": (True, False),
    }
    name = {"microbatch_shape": "microbatch_input", "activation_dtype": "activation"}.get(
        field, field
    )
    if odd:
        kw.update(
            {
                "n_microbatches": {"n_microbatches": 2 * ws},
                "schedule": {"schedule": "1f1b"},
                "virtual_stages": {"virtual_stages": 2},
                "microbatch_shape": {"microbatch_input": torch.empty(5, 8)},
                "activation_dtype": {"activation": torch.empty(4, 8, dtype=torch.float64)},
                "blocks": {},
                "scale_grads": {"scale_grads": False},
            }[field]
        )
    values = [shown[name][r % 2] for r in range(ws)]
    expect_disagreement(lambda: Pipeline(blocks, groups, **kw), "Pipeline", name, values)


@case()
def agreement_passes_when_ranks_agree(rank, ws):
    """Ranks that build alike pass every check, with fp8dp modules whose recipes are set, and
    the objects work: one DDP + DistributedOptimizer step gives every rank the same parameters."""
    model = _FP8Model()
    _fp8_cast(model, 8)
    ddp = fp8dp.DistributedDataParallel(
        model, DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=100)
    )
    opt = fp8dp.DistributedOptimizer(torch.optim.AdamW, ddp, lr=0.01, betas=(0.9, 0.99))
    ddp.zero_grad_buffer()
    torch.manual_seed(rank)
    ddp(torch.randn(16, 16, device=cases_ddp.DEV)).square().mean().backward()
    opt.step()
    w = model.fc.weight.detach().clone()
    all_w = [torch.empty_like(w) for _ in range(ws)]
    dist.all_gather(all_w, w)
    for r, other in enumerate(all_w):
        assert torch.equal(other, w), f"rank {r}'s weight differs from rank {rank}'s after a step"
