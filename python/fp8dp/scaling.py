"""update_fp8_scales: the once-per-step delayed-scaling update (C7).

Every fp8dp module keeps its delayed-scaling state (amax history [L, 3] for the roles input,
weight and grad_output, scales) in C++ and registers it in a per-process registry. During a step
each FP8 cast records its amax in row 0 of its history. Once per step, after the last backward
and before the next forward, this function:

1. gathers row 0 of every state into one flat tensor (registration order, which is the same on
   every rank that builds the same model),
2. reduces it with ONE ``all_reduce(MAX)`` across ``group`` (skipped when torch.distributed is not
   initialised or the group has one rank),
3. computes the new scales from the histories and rolls every history by one row.

``fp8dp.DistributedOptimizer.step()`` calls it; a training loop without that optimizer calls
``fp8dp.update_fp8_scales()`` once per step itself (after ``optimizer.step()``). Without it, the
scales stay at the ones chosen on the first cast.

First scales: a role whose scale was never set takes the scale its own amax gives on its very
first cast (current scaling, once), so step 0 is not cast with an arbitrary scale.
"""

from __future__ import annotations

import torch

from . import _C


def update_fp8_scales(group=None) -> None:
    """Reduce the step's amaxes (MAX) across ``group`` (default: the default process group) and
    update every delayed-scaling state of this process: new scales, histories rolled once."""
    amaxes = _C.fp8_registry_amaxes()
    if (
        amaxes.numel() > 0
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
    ):
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX, group=group)
    _C.fp8_registry_update(amaxes)
