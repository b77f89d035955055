"""fp8dp.DistributedOptimizer: ZeRO-1 over fp8dp.DistributedDataParallel. Each rank keeps an FP32
master copy of the parameter shards it owns (chunk `rank` of every bucket), steps them with any
torch.optim optimizer on the reduce-scattered gradient chunk, and all-gathers the updated
parameters."""

import torch

from . import agreement
from .ddp import DistributedDataParallel
from .scaling import update_fp8_scales


class DistributedOptimizer:
    def __init__(self, optimizer_cls, ddp_model, **kwargs):
        if not isinstance(ddp_model, DistributedDataParallel):
            raise ValueError(
                f"ddp_model: expected fp8dp.DistributedDataParallel, got {type(ddp_model).__name__}"
            )
        if not ddp_model.config.use_distributed_optimizer:
            raise ValueError(
                "ddp_model: expected a model built with "
                "DistributedDataParallelConfig(use_distributed_optimizer=True), got False"
            )
        # C12: the ranks must step their shards alike (class, hyperparameters, shard layout);
        # compared before the checks below, which read what may differ between ranks.
        agreement.check_ranks_agree(
            ddp_model.process_group,
            "DistributedOptimizer",
            lambda: agreement.optimizer_fields(optimizer_cls, kwargs, ddp_model),
        )
        if not (
            isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)
        ):
            raise ValueError(
                f"optimizer_cls: expected a torch.optim.Optimizer class, got {optimizer_cls!r}"
            )
        self._ddp = ddp_model
        self._shards = ddp_model.owned_shards()
        self._masters = [
            torch.nn.Parameter(ddp_model.param_shard(s).detach().float().clone())
            for s in self._shards
        ]
        # A rank whose chunks hold only padding owns no element; torch optimizers refuse an empty
        # parameter list, so it steps one empty tensor (no state, no effect).
        params = self._masters or [torch.nn.Parameter(torch.zeros(0))]
        self.optimizer = optimizer_cls(params, **kwargs)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the DDP gradient buffers (the masters' .grad are views into them)."""
        self._ddp.zero_grad_buffer()
        for m in self._masters:
            m.grad = None

    @torch.no_grad()
    def step(self):
        """finish_grad_sync(), step the master shards on their gradient chunks, copy them back into
        the parameter buffer and launch its all-gather; then update the FP8 scales
        (update_fp8_scales over the DDP's group). With overlap_param_gather the all-gathers are left in flight for the next forward
        to wait on (see finish_param_sync()); otherwise step() waits for them."""
        self._ddp.finish_grad_sync()
        for m, s in zip(self._masters, self._shards):
            g = self._ddp.grad_shard(s)
            m.grad = g if g.dtype == torch.float32 else g.float()
        self.optimizer.step()
        self._ddp.copy_shards(self._masters)
        self._ddp.start_param_sync()
        if not self._ddp.overlap_param_gather:
            self._ddp.finish_param_sync()
        update_fp8_scales(self._ddp.process_group)

    def finish_param_sync(self) -> None:
        """Wait for the parameter all-gathers of the last step() (overlap_param_gather). Needed
        only before reading parameters outside the DDP forward, ddp.state_dict() and the next
        step, which wait by themselves: e.g. evaluation through the bare module."""
        self._ddp.finish_param_sync()

    def state_dict(self) -> dict:
        """This rank's part: its master shards, the inner optimizer's state, and where they
        belong."""
        return {
            "world_size": self._ddp.world_size,
            "rank": self._ddp.rank,
            "shards": [(s.param, s.param_offset, s.numel) for s in self._shards],
            "masters": [m.detach().clone() for m in self._masters],
            "optimizer": self.optimizer.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Restores a state_dict() saved by the same rank at the same world size, exactly, and
        copies the restored masters into the parameters.

        Everything is checked before anything changes: a state_dict that does not fit (a missing
        key, another world size, rank or layout, a master of the wrong size or dtype, an inner
        optimizer state for other parameters) raises ValueError naming the entry, and leaves the
        masters, the parameters and the inner optimizer as they were. A master of the wrong size
        must never reach copy_(), which would broadcast one element over the whole shard.

        The check is this rank's own: when only one rank's state_dict fails, the others go on
        to the parameter all-gather and wait there until the process group's timeout. A caller
        that loads per-rank files agrees on the outcome first (fp8dp.train's checkpoint.py calls
        _check_state_dict on every rank, then gathers the errors)."""
        self._check_state_dict(state_dict)
        # The inner optimizer first: torch checks its groups before changing anything, and the
        # copies below cannot fail once the masters' sizes are checked.
        self.optimizer.load_state_dict(state_dict["optimizer"])
        for m, saved in zip(self._masters, state_dict["masters"]):
            m.copy_(saved)
        self._ddp.copy_shards(self._masters)
        self._ddp.start_param_sync()
        self._ddp.finish_param_sync()

    def _check_state_dict(self, sd) -> None:
        if not isinstance(sd, dict):
            raise ValueError(
                f"state_dict: expected the dict of DistributedOptimizer.state_dict(), "
                f"got {type(sd).__name__}"
            )
        for key in ("world_size", "rank", "shards", "masters", "optimizer"):
            if key not in sd:
                raise ValueError(
                    f"state_dict['{key}']: expected a key of DistributedOptimizer.state_dict(), "
                    f"got none (keys: {sorted(map(str, sd))})"
                )
        ws, rank = self._ddp.world_size, self._ddp.rank
        if sd["world_size"] != ws:
            # The words after the colon are matched by tests/distributed (case world_size).
            raise ValueError(
                f"state_dict['world_size']: expected {ws} (this job's world size), got "
                f"{sd['world_size']!r}: saved at world size {sd['world_size']}, loading at world "
                f"size {ws} (resharding is not supported)"
            )
        if sd["rank"] != rank:
            raise ValueError(
                f"state_dict['rank']: expected {rank} (this rank; each rank loads its own "
                f"state_dict), got {sd['rank']!r}"
            )
        mine = [(s.param, s.param_offset, s.numel) for s in self._shards]
        shards = sd["shards"]
        if not isinstance(shards, (list, tuple)) or len(shards) != len(mine):
            got = f"{len(shards)}" if isinstance(shards, (list, tuple)) else repr(shards)
            raise ValueError(
                f"state_dict['shards']: expected {len(mine)} shards (this model's layout), "
                f"got {got} (a different model, bucket_size or padding)"
            )
        for i, (want, saved) in enumerate(zip(mine, shards)):
            ok = isinstance(saved, (list, tuple)) and tuple(saved) == want
            if not ok:
                raise ValueError(
                    f"state_dict['shards'][{i}]: expected (param, offset, numel) = {want} "
                    f"(this model's layout), got {saved!r} (a different model, bucket_size or "
                    f"padding)"
                )
        masters = sd["masters"]
        if not isinstance(masters, (list, tuple)) or len(masters) != len(self._masters):
            got = f"{len(masters)}" if isinstance(masters, (list, tuple)) else repr(masters)
            raise ValueError(
                f"state_dict['masters']: expected a list of {len(self._masters)} tensors "
                f"(one per shard), got {got}"
            )
        for i, (m, saved) in enumerate(zip(self._masters, masters)):
            if not isinstance(saved, torch.Tensor):
                raise ValueError(
                    f"state_dict['masters'][{i}]: expected a tensor of {m.numel()} elements "
                    f"(float32), got {type(saved).__name__}"
                )
            if tuple(saved.shape) != tuple(m.shape) or not saved.is_floating_point():
                raise ValueError(
                    f"state_dict['masters'][{i}]: expected {m.numel()} elements (float32), got "
                    f"{saved.numel()} ({str(saved.dtype).replace('torch.', '')}, shape "
                    f"{list(saved.shape)})"
                )
        self._check_inner_state(sd["optimizer"])

    def _check_inner_state(self, inner) -> None:
        """The structure torch's Optimizer.load_state_dict does not check before it changes
        anything: state for parameters the groups do not list, and state tensors of the wrong
        size (they would fail, or broadcast, only at the next step())."""
        where = "state_dict['optimizer']"
        if not isinstance(inner, dict) or not {"state", "param_groups"} <= set(inner):
            raise ValueError(
                f"{where}: expected a torch.optim state_dict (keys 'state' and 'param_groups'), "
                f"got {type(inner).__name__}"
                + (f" with keys {sorted(map(str, inner))}" if isinstance(inner, dict) else "")
            )
        groups, state = inner["param_groups"], inner["state"]
        mine = self.optimizer.param_groups
        if (
            not isinstance(groups, (list, tuple))
            or len(groups) != len(mine)
            or not all(isinstance(g, dict) and "params" in g for g in groups)
        ):
            raise ValueError(
                f"{where}['param_groups']: expected {len(mine)} group(s) with 'params', got "
                f"{len(groups) if isinstance(groups, (list, tuple)) else repr(groups)}"
            )
        numel = {}  # saved parameter id -> elements of the master it stands for
        for gi, (g, my) in enumerate(zip(groups, mine)):
            if len(g["params"]) != len(my["params"]):
                raise ValueError(
                    f"{where}['param_groups'][{gi}]['params']: expected {len(my['params'])} "
                    f"parameters (one per master shard), got {len(g['params'])}"
                )
            numel.update(zip(g["params"], (p.numel() for p in my["params"])))
        if not isinstance(state, dict):
            raise ValueError(f"{where}['state']: expected a dict, got {type(state).__name__}")
        for pid, entry in state.items():
            if pid not in numel:
                raise ValueError(
                    f"{where}['state'][{pid!r}]: expected one of the parameter ids of "
                    f"'param_groups' {sorted(numel)}, got {pid!r}"
                )
            if not isinstance(entry, dict):
                continue
            for k, v in entry.items():
                # Element-wise optimizers keep per-element state shaped like the (1-D) master,
                # and scalars such as 'step'.
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() != numel[pid]:
                    raise ValueError(
                        f"{where}['state'][{pid!r}][{k!r}]: expected {numel[pid]} elements "
                        f"(the master's) or a scalar, got {v.numel()}"
                    )
