"""fp8dp.DistributedOptimizer: ZeRO-1 over fp8dp.DistributedDataParallel. Each rank keeps an FP32
master copy of the parameter shards it owns (chunk `rank` of every bucket), steps them with any
torch.optim optimizer on the reduce-scattered gradient chunk, and all-gathers the updated
parameters."""

import torch

from .ddp import DistributedDataParallel


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
        if not (
            isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)
        ):
            raise ValueError(
                f"optimizer_cls: expected a torch.optim.Optimizer class, got {optimizer_cls!r}"
            )
        self._ddp = ddp_model
        self._sync = ddp_model._sync
        self._shards = self._sync.owned_shards()
        self._masters = [
            torch.nn.Parameter(self._sync.param_shard(s).detach().float().clone())
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
        the parameter buffer and launch its all-gather; then update FP8 scales when fp8dp provides
        that. With overlap_param_gather the all-gathers are left in flight for the next forward
        to wait on (see finish_param_sync()); otherwise step() waits for them."""
        self._ddp.finish_grad_sync()
        for m, s in zip(self._masters, self._shards):
            g = self._sync.grad_shard(s)
            m.grad = g if g.dtype == torch.float32 else g.float()
        self.optimizer.step()
        self._sync.copy_shards(self._masters)
        self._sync.start_param_sync()
        if not self._ddp.overlap_param_gather:
            self._sync.finish_param_sync()
        import fp8dp

        if hasattr(fp8dp, "update_fp8_scales"):
            fp8dp.update_fp8_scales(self._ddp.process_group)

    def finish_param_sync(self) -> None:
        """Wait for the parameter all-gathers of the last step() (overlap_param_gather). Needed
        only before reading parameters outside the DDP forward, ddp.state_dict() and the next
        step, which wait by themselves: e.g. evaluation through the bare module."""
        self._ddp.finish_param_sync()

    def state_dict(self) -> dict:
        """This rank's part: its master shards, the inner optimizer's state, and where they
        belong."""
        return {
            "world_size": self._sync.world_size,
            "rank": self._sync.rank,
            "shards": [(s.param, s.param_offset, s.numel) for s in self._shards],
            "masters": [m.detach().clone() for m in self._masters],
            "optimizer": self.optimizer.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Restores a state_dict() saved by the same rank at the same world size, exactly, and
        copies the restored masters into the parameters."""
        ws, rank = self._sync.world_size, self._sync.rank
        if state_dict.get("world_size") != ws:
            raise ValueError(
                f"state_dict['world_size']: saved at world size {state_dict.get('world_size')}, "
                f"loading at world size {ws}: mismatched world sizes (resharding is not supported)"
            )
        if state_dict.get("rank") != rank:
            raise ValueError(
                f"state_dict['rank']: saved by rank {state_dict.get('rank')}, "
                f"loading on rank {rank}"
            )
        mine = [(s.param, s.param_offset, s.numel) for s in self._shards]
        if [tuple(x) for x in state_dict["shards"]] != mine:
            raise ValueError(
                "state_dict['shards']: the saved shards do not match this model's layout "
                "(a different model, bucket_size or padding)"
            )
        for m, saved in zip(self._masters, state_dict["masters"]):
            m.copy_(saved)
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._sync.copy_shards_and_sync_params(self._masters)
