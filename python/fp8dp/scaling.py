"""update_fp8_scales: the once-per-step delayed-scaling update (C7), over one registry that every
rank orders and checks the same way (C9).

Every fp8dp module keeps its delayed-scaling state (amax history [L, 3] for the roles input,
weight and grad_output, scales) in C++ and registers it in a per-process registry under an
identity: its name in the model that ``fp8dp.DistributedDataParallel`` wraps (given by
``set_fp8_identities``), or, for a module not wrapped (yet), "unnamed #k <class and shape>", k
counting the modules of that class and shape created in this process. During a step each
non-empty FP8 cast records its amax in row 0 of its history. Once per step, after the last
backward and before the next forward, ``update_fp8_scales``:

1. checks that every rank has the same states, in the same order, with the same recipe: one
   ``all_reduce(MAX)`` of five int64s (a hash h of every state's identity and recipe, -h,
   whether any amax was recorded since the last update, and r, -r for the recipes without state,
   current and block scaling, that training forwards used since the last update, compared among
   the ranks that ran one), so that ranks that differ can never reach the variable-size
   collective below, and ranks that train with other numerics are stopped; the hashes are
   recomputed only when a state, an identity or a recipe changed,
2. gathers row 0 of every state into one flat tensor, ordered by identity (not by creation or by
   first cast), and reduces it with ONE ``all_reduce(MAX)`` across the amax-reduction group (below),
3. computes the new scales from the histories and rolls every history by one row.

The collectives are skipped when torch.distributed is not initialised or the group has one rank.

The amax-reduction group, for the check and the reduction alike: the ``group`` argument when given;
else the ``fp8_group`` of the enabled ``fp8_autocast`` contexts entered since the last update (as
TransformerEngine reduces across ``fp8_group``); else the default group. Since every amax goes
into one collective, a step has one such group: contexts that name groups of different ranks, or
a ``group`` argument whose ranks differ from the contexts' ``fp8_group``, raise ValueError before
any collective (each rank decides from its own contexts, so consistent ranks all raise alike).

``fp8dp.DistributedOptimizer.step()`` calls it; a training loop without that optimizer calls
``fp8dp.update_fp8_scales()`` once per step itself (after ``optimizer.step()``). Without it, the
scales stay at the ones chosen on the first cast.

First scales: a role whose scale was never set takes the scale its own amax gives on its very
first non-empty cast (current scaling, once), so step 0 is not cast with an arbitrary scale.
Empty casts (a 0-token micro-batch) are not amax observations. Casts under
``torch.inference_mode()`` change no state: they use the scales training set (or their own amax
where none is set yet) and record nothing.
"""

from __future__ import annotations

import torch

from . import _C
from .autocast import take_step_fp8_groups


def set_fp8_identities(module: torch.nn.Module) -> None:
    """Name the FP8 scaling state of every fp8dp module in ``module`` after its path in it
    (``"layers.0.fc1: Linear(in_features=..., out_features=...)"``; ``"(root)"`` for ``module``
    itself), so that update_fp8_scales orders and checks the states by name across ranks (C9).
    fp8dp.DistributedDataParallel calls it on the module it wraps; call it yourself for a model
    that you reduce amaxes for without that wrapper. A module reachable under several names gets
    the first one (``named_modules`` order)."""
    from .modules import _FP8LinearBase

    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    for name, m in module.named_modules():
        if isinstance(m, _FP8LinearBase):
            m._core.fp8_identity = f"{name or '(root)'}: {m._core.name}"


def _check_device(group) -> torch.device:
    """Where the check's five int64s live: NCCL needs a CUDA tensor, other backends take CPU."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _raise_mismatch(group) -> None:
    """Every rank comes here together (they all saw the same reduced hashes): gather the lists
    and name the first state where they differ."""
    mine = list(_C.fp8_registry_descriptions())
    world = torch.distributed.get_world_size(group)
    lists = [None] * world
    torch.distributed.all_gather_object(lists, mine, group=group)
    longest = max(len(lst) for lst in lists)
    first = next(
        (i for i in range(longest) if len({lst[i] if i < len(lst) else None for lst in lists}) > 1),
        None,
    )
    if first is None:  # pragma: no cover - equal lists hash equally
        detail = "the lists are equal but their hashes differ"
    else:
        detail = "; ".join(
            (
                f"rank {r}: {lst[first]!r}"
                if first < len(lst)
                else f"rank {r}: none ({len(lst)} entries)"
            )
            for r, lst in enumerate(lists)
        )
        detail = f"first difference at position {first} of the amax reduction: {detail}"
    counts = ", ".join(str(len(lst)) for lst in lists)
    raise RuntimeError(
        "update_fp8_scales: the ranks' FP8 scaling states differ (C9), so their amaxes cannot be "
        f"reduced together; {detail} (entries per rank: {counts}). Every rank must cast the same "
        "fp8dp modules with the same recipe in a step, and name them alike "
        "(fp8dp.DistributedDataParallel names them by fp8dp.scaling.set_fp8_identities)."
    )


def _ranks(group):
    """The global ranks of ``group`` (None: the default group), for comparing groups by what they
    reduce over; the group itself where it is not registered with torch.distributed."""
    dist = torch.distributed
    try:
        return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    except (RuntimeError, ValueError, KeyError, AttributeError):
        return group


def _show(ranks) -> str:
    return str(list(ranks)) if isinstance(ranks, tuple) else repr(ranks)


def _amax_group(group):
    """The amax-reduction group of this step (module docstring): ``group``, else the fp8_group of
    the step's fp8_autocast contexts, else None (the default group). Forgets the contexts' groups,
    so the next step starts afresh."""
    step_groups = take_step_fp8_groups()
    dist = torch.distributed
    if not step_groups or not (dist.is_available() and dist.is_initialized()):
        return group
    distinct = {_ranks(g): g for g in step_groups}
    if len(distinct) > 1:
        raise ValueError(
            "update_fp8_scales: the fp8_autocast contexts since the last update named different "
            f"fp8_group's (ranks {' and '.join(_show(r) for r in distinct)}); every amax is "
            "reduced in one collective, so every context of a step must name the same group"
        )
    [(step_ranks, step_group)] = distinct.items()
    if group is not None and _ranks(group) != step_ranks:
        raise ValueError(
            f"update_fp8_scales: group (ranks {_show(_ranks(group))}) differs from the fp8_group "
            f"of this step's fp8_autocast (ranks {_show(step_ranks)}); pass the same group, or "
            "none to reduce across fp8_group"
        )
    return step_group if group is None else group


_NONE = -(2**62) - 1  # below every -h of a 62-bit hash h: the MAX's neutral element in the check


def update_fp8_scales(group=None) -> None:
    """Reduce the step's amaxes (MAX) across the amax-reduction group and update every
    delayed-scaling state of this process: new scales, histories rolled once.

    group: the amax-reduction group; None: the ``fp8_group`` of the step's ``fp8_autocast``
    contexts, else the default process group (see the module docstring for how they combine).

    A no-op (no collective but the check, no history rolled) when no rank recorded an amax since
    the last update: calling it twice in one step, or in a step with only empty or inference
    casts, rolls nothing. Raises RuntimeError on every rank, before any amax is reduced or any
    state changed, when the ranks' states differ (a module cast in FP8 on some ranks only, other
    names or shapes, another recipe, also between current and block scaling), naming the first
    differing state or recipe."""
    group = _amax_group(group)
    sig_hash, observed, _, recipes_hash = _C.fp8_registry_signature()
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        # A rank that noted no stateless recipe (no training forward this step) sends the MAX's
        # neutral element for the recipes' pair, so only the ranks that trained are compared.
        r, minus_r = (recipes_hash, -recipes_hash) if recipes_hash >= 0 else (_NONE, _NONE)
        check = torch.tensor(
            [sig_hash, -sig_hash, int(observed), r, minus_r],
            dtype=torch.int64,
            device=_check_device(group),
        )
        dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
        high, minus_low, any_observed, r_high, r_minus_low = check.tolist()
        if high != -minus_low or r_high != -r_minus_low and r_high != _NONE:
            _raise_mismatch(group)
        _C.fp8_registry_forget_recipes()  # the ranks agreed on this step's stateless recipes
        if not any_observed:
            return
        amaxes = _C.fp8_registry_amaxes()
        if amaxes.numel() > 0:  # the same size on every rank: the check passed
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
        _C.fp8_registry_update(amaxes)
    else:
        _C.fp8_registry_forget_recipes()
        if observed:
            _C.fp8_registry_update_local()  # nothing to reduce: each state's row 0 is its amax
