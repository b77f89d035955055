"""fp8dp.DistributedOptimizer: ZeRO-1 over fp8dp.DistributedDataParallel. Each rank keeps an FP32
master copy of the parameter shards it owns (chunk `rank` of every bucket), steps them with any
torch.optim optimizer on the reduce-scattered gradient chunk, and all-gathers the updated
parameters.

The masters follow the parameters (C13): a parameter written outside step() after the optimizer
was built (model.load_state_dict, ddp.broadcast_params, an in-place copy_) is seen by its version
counter, and step() first refreshes the masters of its shards from it; reload_model_params()
does so explicitly (Megatron's name), for writes that version counters do not see (``p.data``)."""

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
        self._defer = ddp_model.config.defer_nan_check
        self._shards = ddp_model.owned_shards()
        self._masters = [
            torch.nn.Parameter(ddp_model.param_shard(s).detach().float().clone())
            for s in self._shards
        ]
        # A rank whose chunks hold only padding owns no element; torch optimizers refuse an empty
        # parameter list, so it steps one empty tensor (no state, no effect). On the parameters'
        # device: a fused optimizer (AdamW(fused=True)) refuses a CPU tensor beside CUDA ones.
        self._device = ddp_model._params[0].device if ddp_model._params else torch.device("cpu")
        params = self._masters or [torch.nn.Parameter(torch.zeros(0, device=self._device))]
        self.optimizer = optimizer_cls(params, **kwargs)
        if self._defer and not getattr(self.optimizer, "_step_supports_amp_scaling", False):
            raise ValueError(
                "optimizer_cls: defer_nan_check needs an optimizer that skips its step on the "
                "device when told (found_inf): torch.optim.Adam, AdamW or SGD with fused=True; got "
                f"{optimizer_cls.__name__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
            )
        self._optimizer_kwargs = dict(kwargs)  # for load_state_dict's probe (_probe_state)
        # C13: the parameters that this rank's masters stand for, and their version counters
        # right after the optimizer's own last write (see _refresh_moved_masters).
        self._watched = sorted({s.param for s in self._shards})
        self._versions = self._param_versions()

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
        self._refresh_moved_masters()
        for m, s in zip(self._masters, self._shards):
            g = self._ddp.grad_shard(s)
            m.grad = g if g.dtype == torch.float32 else g.float()
        if self._defer:
            # The agreed NaN flags of this iteration, still on the device: a fused torch optimizer
            # reads found_inf (as GradScaler sets it) and leaves masters, moments and step counts
            # as they were when it is nonzero, so the copy and all-gather below rewrite the same
            # values. The next finish_grad_sync() raises (DistributedDataParallelConfig).
            self.optimizer.grad_scale = None
            self.optimizer.found_inf = self._ddp._sync.found_nonfinite()
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.grad_scale, self.optimizer.found_inf
        else:
            self.optimizer.step()
        self._ddp.copy_shards(self._masters)
        self._ddp.start_param_sync()
        if not self._ddp.overlap_param_gather:
            self._ddp.finish_param_sync()
        self._versions = self._param_versions()
        update_fp8_scales(self._ddp.process_group)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Megatron's reload_model_params(): every master of this rank takes its parameter's
        current value (FP32 of it), as if the optimizer had been built now; the inner optimizer's
        state (moments, step counts) stays. Call it on every rank after changing the weights in a
        way that version counters do not see (writes through ``p.data``, or into the storage by
        other code); writes through the parameter itself (``model.load_state_dict``,
        ``ddp.broadcast_params``, ``with torch.no_grad(): p.copy_(w)``) need no call: step()
        finds them. Waits for a parameter all-gather still in flight first, since it still
        writes the parameters. The FP8 weight caches of the model's fp8dp layers are made again
        at their next forward, even one with is_first_microbatch=False (C8: never stale)."""
        self._ddp._sync.note_params_written()
        self._copy_params_to_masters(moved=None)

    def _param_versions(self) -> list:
        params = self._ddp._params
        return [params[i]._version for i in self._watched]

    def _refresh_moved_masters(self) -> None:
        """C13: a parameter whose version counter moved since the optimizer's last write was
        written outside step(): its masters take the new values before they are stepped, or the
        step would copy the old weights back (fine-tuning from a checkpoint loaded after the
        optimizer was built reverted to the initial weights). One list compare per step when
        nothing moved. The optimizer's own writes (copy_shards, the all-gather, its
        load_state_dict) bump the counters too (GradSync::bump_param_versions), so
        the versions are recorded after each of them."""
        now = self._param_versions()
        if now == self._versions:
            return
        moved = {i for i, a, b in zip(self._watched, now, self._versions) if a != b}
        self._copy_params_to_masters(moved)

    @torch.no_grad()
    def _copy_params_to_masters(self, moved) -> None:
        """The masters of the shards of the parameters in `moved` (all when None) from the
        parameters. For `moved`, only the elements whose parameter value differs from the master
        rounded to the parameter's dtype: a write that left an element as it was (loading the
        same checkpoint again, a broadcast of equal weights, the model loaded after the
        optimizer on resume) keeps the master's extra precision of a BF16 parameter, so that
        resuming stays bit exact; a changed element takes the new value exactly. For FP32
        parameters the two are the same."""
        self._ddp.finish_param_sync()
        for m, s in zip(self._masters, self._shards):
            if moved is not None and s.param not in moved:
                continue
            p = self._ddp.param_shard(s)
            if moved is None or p.dtype == torch.float32:
                m.copy_(p)
            else:
                m.copy_(torch.where(p != m.to(p.dtype), p.float(), m))
        self._versions = self._param_versions()

    def finish_param_sync(self) -> None:
        """Wait for the parameter all-gathers of the last step() (overlap_param_gather). Needed
        only before reading parameters outside the DDP forward, ddp.state_dict() and the next
        step, which wait by themselves: e.g. evaluation through the bare module."""
        self._ddp.finish_param_sync()

    def state_dict(self) -> dict:
        """This rank's part: its master shards, the inner optimizer's state, and where they
        belong. Parameters written outside step() since the optimizer's last write refresh their
        masters first (C13, as step() does): the saved masters are the weights the model holds,
        or loading the checkpoint would restore the weights from before that write."""
        self._refresh_moved_masters()
        return {
            "optimizer_class": _class_name(type(self.optimizer)),
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
        key, another optimizer class, world size, rank or layout, a master of the wrong size or
        not float32, inner optimizer settings or state that this optimizer's class does not keep,
        or keeps with another dtype or size, state for other parameters) raises ValueError
        naming the entry, and leaves the masters, the parameters and the inner optimizer as they
        were. A master of the wrong size must never reach copy_(), which would broadcast one
        element over the whole shard; another optimizer's state (SGD's into AdamW) must not
        replace the settings and fail at the next step() (KeyError: 'betas'); BF16 masters
        would silently drop the bits that FP32 masters exist to keep.

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
        self._versions = self._param_versions()  # the optimizer's own write (C13)

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
        # Saved before the class was recorded: the settings and state checks below still tell
        # another optimizer's state apart.
        if "optimizer_class" in sd:
            mine = _class_name(type(self.optimizer))
            if sd["optimizer_class"] != mine:
                raise ValueError(
                    f"state_dict['optimizer_class']: expected {mine!r} (this optimizer's inner "
                    f"class), got {sd['optimizer_class']!r}: another optimizer's state cannot "
                    f"be loaded; build DistributedOptimizer with the class it was saved with"
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
            # FP32 exactly: a BF16 master would round the weights the masters exist to keep.
            if tuple(saved.shape) != tuple(m.shape) or saved.dtype != torch.float32:
                raise ValueError(
                    f"state_dict['masters'][{i}]: expected {m.numel()} elements (float32), got "
                    f"{saved.numel()} ({str(saved.dtype).replace('torch.', '')}, shape "
                    f"{list(saved.shape)})"
                )
        self._check_inner_state(sd["optimizer"])

    def _check_inner_state(self, inner) -> None:
        """What torch's Optimizer.load_state_dict does not check before it changes anything: the
        group settings this class reads (another optimizer's groups replaced them, and step()
        failed later), state for parameters the groups do not list, and each state entry's keys,
        dtypes and sizes against what this class keeps with the saved settings (_probe_state)."""
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
        cls = type(self.optimizer).__name__
        numel = {}  # saved parameter id -> elements of the master it stands for
        group_of = {}  # saved parameter id -> index of its group
        for gi, (g, my) in enumerate(zip(groups, mine)):
            if len(g["params"]) != len(my["params"]):
                raise ValueError(
                    f"{where}['param_groups'][{gi}]['params']: expected {len(my['params'])} "
                    f"parameters (one per master shard), got {len(g['params'])}"
                )
            # The settings step() reads are the class's defaults; load_state_dict replaces the
            # groups by the saved ones, so a missing one fails only at the next step().
            missing = sorted(k for k in self.optimizer.defaults if k not in g)
            if missing:
                raise ValueError(
                    f"{where}['param_groups'][{gi}]: expected the settings of {cls} "
                    f"{sorted(self.optimizer.defaults)}, got {sorted(k for k in g if k != 'params')}"
                    f" (missing {missing}): the state of another optimizer class?"
                )
            numel.update(zip(g["params"], (p.numel() for p in my["params"])))
            group_of.update((pid, gi) for pid in g["params"])
        if not isinstance(state, dict):
            raise ValueError(f"{where}['state']: expected a dict, got {type(state).__name__}")
        for pid in state:
            if pid not in numel:
                raise ValueError(
                    f"{where}['state'][{pid!r}]: expected one of the parameter ids of "
                    f"'param_groups' {sorted(numel)}, got {pid!r}"
                )
        probes = {}  # group index -> the state this class keeps with that group's settings
        for pid, entry in state.items():
            if not isinstance(entry, dict):
                raise ValueError(
                    f"{where}['state'][{pid!r}]: expected a dict of per-parameter state, got "
                    f"{type(entry).__name__}"
                )
            gi = group_of[pid]
            if gi not in probes:
                probes[gi] = self._probe_state(groups[gi], f"{where}['param_groups'][{gi}]")
            want = probes[gi]
            if want is not None and set(entry) != set(want):
                raise ValueError(
                    f"{where}['state'][{pid!r}]: expected the keys {sorted(want)} ({cls}'s state "
                    f"with the saved settings), got {sorted(map(str, entry))} (missing "
                    f"{sorted(set(want) - set(entry))}, unexpected "
                    f"{sorted(map(str, set(entry) - set(want)))})"
                )
            for k, v in entry.items():
                w = want.get(k) if want is not None else None
                here = f"{where}['state'][{pid!r}][{k!r}]"
                if isinstance(w, torch.Tensor) and not isinstance(v, torch.Tensor):
                    raise ValueError(f"{here}: expected a tensor, got {type(v).__name__}")
                if not isinstance(v, torch.Tensor):
                    continue
                # torch would cast a floating state tensor to the master's dtype on load,
                # silently (a BF16 exp_avg saved elsewhere): the dtype must be the class's own.
                if isinstance(w, torch.Tensor) and v.dtype != w.dtype:
                    raise ValueError(
                        f"{here}: expected {str(w.dtype).replace('torch.', '')} ({cls}'s), got "
                        f"{str(v.dtype).replace('torch.', '')}"
                    )
                # Element-wise optimizers keep per-element state shaped like the (1-D) master,
                # and scalars such as 'step'.
                per_element = w.dim() > 0 if isinstance(w, torch.Tensor) else v.dim() > 0
                if per_element and (v.dim() != 1 or v.numel() != numel[pid]):
                    raise ValueError(
                        f"{here}: expected {numel[pid]} elements (the master's) or a scalar, got "
                        f"{v.numel()} (shape {list(v.shape)})"
                    )
                if not per_element and v.numel() != 1:
                    raise ValueError(
                        f"{here}: expected a scalar ({cls}'s), got {v.numel()} elements"
                    )

    def _probe_state(self, group: dict, where: str):
        """The per-parameter state that this optimizer's class keeps once load_state_dict has
        installed the settings of `group`: a throwaway instance (built as this one was) on a
        2-element FP32 parameter on the masters' device takes those settings, as load_state_dict
        does, and steps once on a zero gradient. Raises ValueError when that step fails (the
        settings are not this class's); None when the class cannot be stepped that way at all
        (it needs a closure, as LBFGS does): its state's keys and dtypes then go unchecked."""
        cls = type(self.optimizer)
        device = self._device

        def probe(settings):
            p = torch.nn.Parameter(torch.zeros(2, device=device))
            opt = cls([p], **self._optimizer_kwargs)
            opt.param_groups[0].update(settings)
            p.grad = torch.zeros_like(p)
            opt.step()
            return opt.state[p]

        try:
            probe({})
        except (TypeError, RuntimeError):
            return None
        try:
            return probe({k: v for k, v in group.items() if k != "params"})
        except (TypeError, ValueError, RuntimeError, KeyError) as e:
            raise ValueError(
                f"{where}: {cls.__name__}.step() fails with the saved settings ({type(e).__name__}: "
                f"{e}): the state of another optimizer class?"
            ) from e


def _class_name(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
