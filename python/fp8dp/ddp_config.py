"""DistributedDataParallelConfig: how fp8dp.DistributedDataParallel buckets and reduces
gradients."""

from dataclasses import dataclass, fields
from typing import Optional

_BACKENDS = ("auto", "nccl", "process_group")
_WIRES = ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2")


@dataclass
class DistributedDataParallelConfig:
    grad_reduce_in_fp32: bool = True
    """Default True. Keep main_grad (and reduce it) in FP32 whatever the parameter dtype: BF16 sums
    over micro-batches and ranks lose low-order bits that the optimizer needs. False keeps main_grad
    in the parameter dtype (half the buffer memory and bandwidth)."""

    overlap_grad_reduce: bool = False
    """Default False. Launch each bucket's collective from the backward hooks the moment the bucket
    is complete, overlapping communication with the rest of backward. Off: one bucket per buffer,
    reduced by finish_grad_sync() (simplest, and what a single-GPU-per-node debug run wants)."""

    use_distributed_optimizer: bool = False
    """Default False. ZeRO-1: reduce-scatter instead of all-reduce (rank r keeps chunk r of every
    bucket), align parameters to 64 elements and pad bucket ends to lcm(dp, 128) so chunks are
    equal. Needed by fp8dp.DistributedOptimizer."""

    overlap_param_gather: bool = False
    """Default False. True (needs use_distributed_optimizer): DistributedOptimizer.step() only
    launches the parameter all-gathers (asynchronously, first layers first) and each module that
    owns parameters waits for its bucket groups just before its forward, state_dict() or
    load_state_dict() (pre-hooks; stream-ordered on CUDA), so the all-gather overlaps the next
    forward instead of stalling the step (Megatron's overlap_param_gather). Off by default because
    code that reads parameter tensors directly right after step() (p.detach(), p.norm(), a
    comparison) would see half-gathered values: with it on, such code calls
    optimizer.finish_param_sync() first. broadcast_params() and the next step() wait by
    themselves."""

    bucket_size: Optional[int] = None
    """Default None = max(40_000_000, 1_000_000 * dp) elements: large enough that each collective
    reaches most of the link bandwidth, small enough that the first buckets overlap with backward;
    it grows with dp because each rank's chunk of a reduce-scatter shrinks as 1/dp. Only used with
    overlap_grad_reduce. Must be > 0."""

    average_in_collective: bool = False
    """Default False. Average with the collective's AVG op instead of pre-scaling the bucket by
    1/dp. The pre-scale is exact for power-of-two dp and keeps sums small in BF16; AVG saves a pass
    over the buffer where the backend supports it (a SUM then a divide where it does not)."""

    check_for_nan_in_grad: bool = False
    """Default False. Before each bucket is reduced, scan the local gradients; finish_grad_sync()
    then raises on every rank, naming the parameters with NaN or Inf and the rank that produced
    them. Costs a pass over the buffer and one tiny all-reduce per iteration."""

    defer_nan_check: bool = False
    """Default False. True (needs check_for_nan_in_grad and the distributed optimizer, not
    grad_ledger): finish_grad_sync() launches the check's flags but does not wait for them, so
    the host keeps queueing the clip, the optimizer and the next forward while the backward runs
    (the wait cost the 342M step 2% of its tokens/s on an H100, 12-06). DistributedOptimizer
    passes the flags to its optimizer as found_inf (torch's fused Adam, AdamW and SGD skip their
    step on the device, as under GradScaler): an iteration with NaN or Inf changes no parameter
    and no optimizer state. The next finish_grad_sync() raises, naming the rank and the
    parameters, before it launches anything of its own; DistributedDataParallel.check_deferred()
    raises at once (after the last step, before saving). Errors known on the host (a missing
    backward_dw()) raise at once on their rank, as with the check off."""

    pad_buckets_for_high_nccl_busbw: bool = False
    """Default False. With the distributed optimizer also pad bucket ends to a multiple of 2^16
    elements: NCCL's reduce-scatter reaches its best bus bandwidth on such sizes at large dp, at the
    cost of up to 2^16 padding elements per bucket."""

    delay_wgrad_compute: bool = False
    """Default False. The model's modules compute weight gradients later, in backward_dw() (contract
    C3). fp8dp's own modules then deliver those gradients to the buffers directly (DDP binds itself
    to them); parameters of other modules marked skip_backward_post_hook get DDP's hook through
    their module's register_wgrad_accumulation_and_reduce_hooks() instead of autograd. A marked
    parameter with this off is an error (a reminder that the loop must call backward_dw())."""

    grad_ledger: bool = False
    """Default False. Each micro-batch's forward announces the gradient contributions it owes (one
    per parameter its graph reaches through autograd, one per fp8dp use that delivers fused or
    delayed); every arrival is recorded by route, and finish_grad_sync() raises, naming the
    parameter and micro-batch, on any missing or duplicated one (contracts C2 and C8 made checkable
    in your own model). A debugging aid: costs a walk of each forward's autograd graph in Python,
    bookkeeping per arrival and one tiny all-reduce per iteration. Forwards must go through the
    DistributedDataParallel wrapper, and the loss must use every output (a parameter reached only
    by an output the loss ignores is reported missing)."""

    nccl_blocking_wait: bool = False
    """Default False: with the native NCCL communicator a collective's wait() makes the compute
    stream wait on its end event and returns at once, so the host keeps queueing work (the
    optimizer's kernels) while the collective runs; a watchdog thread aborts a collective that
    fails or outlives the communicator's timeout, and the next call raises. True: wait() blocks the
    host until the collective finished and raises right there on a timeout (a debugging aid that
    costs the overlap of host and device). Ignored by the process-group communicator (gloo waits
    on the host anyway)."""

    nccl_high_priority_stream: bool = True
    """Default True: the native NCCL communicator's stream has high priority, so a bucket's
    collective gets SMs as soon as it is launched instead of queueing behind the backward's GEMMs
    (the last bucket, which nothing can hide, finishes earliest). False gives compute the SMs
    first (torch's ProcessGroupNCCL default): the collectives may slow the kernels they overlap
    with less, and may start later. Ignored by the process-group communicator."""

    grad_reduce_wire: str = "fp32"
    """Default "fp32": each bucket is all-reduced or reduce-scattered as it is, FP32 with
    grad_reduce_in_fp32 (with grad_reduce_in_fp32=False, which the other wires refuse, the buffer
    is in the parameter dtype and reduced in it). (Its old name "buffer" is refused with a
    ValueError that says to use "fp32".) The others send fewer bytes
    and keep the sum in FP32 (needs grad_reduce_in_fp32=True): every rank encodes its 1/dp
    pre-scaled bucket as dp chunks, an all-to-all sends chunk j to rank j, and rank j adds the dp
    decoded chunks in FP32, in rank order (Megatron's reduce-scatter with FP32 accumulation); without
    the distributed optimizer the owners then encode their sums and all-gather them, so main_grad
    is bit-identical on every rank.

    - "bf16": half the bytes of FP32. Each contribution is rounded once to BF16 (relative error
      <= 2^-8: BF16 keeps 8 significant bits), the all-gathered sum once more.
    - "fp8_e4m3" / "fp8_e5m2": a quarter of the bytes, plus 4 bytes per chunk for its scale. Each
      chunk is scaled by the largest power of two that keeps its amax within the format's max
      (MS-AMP's per-tensor scaling, here per chunk); each value is then rounded with relative error
      <= 2^-4 (E4M3) or 2^-3 (E5M2), or by half a subnormal step (2^-10 or 2^-17 of the chunk's
      scale_inv, i.e. <= 2^-17.8 or 2^-31.8 of its amax) for values far below the amax. A chunk
      holding NaN or Inf arrives as all NaN (never as a finite number).

    Costs: two scratch buffers per bucket in the wire dtype (bf16: the size of the FP32 buffer in
    all; fp8: half of it, plus an FP32 chunk for decoding), kept for the life of the DDP; an
    encode and a decode pass over each bucket; and without the
    distributed optimizer a second collective (the all-gather), launched by finish_grad_sync()
    after the first one's wait, so with overlap_grad_reduce only the reduce half overlaps the
    backward pass. With one rank nothing is sent and nothing is rounded. average_in_collective
    applies the 1/dp to the FP32 sum instead of before encoding."""

    comm_backend: str = "auto"
    """Default "auto": fp8dp's native NCCL communicator for CUDA parameters when the build has it,
    the process group's own collectives otherwise. "nccl" insists on the native one (an error when
    it is not built); "process_group" always uses the c10d group (gloo on the CPU)."""

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type is bool and not isinstance(v, bool):
                raise ValueError(f"{f.name}: expected a bool, got {v!r}")
        if self.bucket_size is not None:
            if isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int):
                raise ValueError(
                    f"bucket_size: expected an int number of elements or None, "
                    f"got {self.bucket_size!r}"
                )
            if self.bucket_size <= 0:
                raise ValueError(f"bucket_size: expected > 0 elements, got {self.bucket_size}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError(
                "overlap_param_gather: True needs use_distributed_optimizer=True (only the "
                "distributed optimizer all-gathers parameters), got use_distributed_optimizer=False"
            )
        if self.defer_nan_check:
            for need, ok in (
                ("check_for_nan_in_grad=True", self.check_for_nan_in_grad),
                ("use_distributed_optimizer=True (it skips the step on the device)",
                 self.use_distributed_optimizer),
                ("grad_ledger=False (the ledger's check reads its flags on the host)",
                 not self.grad_ledger),
            ):  # fmt: skip
                if not ok:
                    raise ValueError(f"defer_nan_check: True needs {need}")
        if self.grad_reduce_wire == "buffer":
            # The old name of "fp32": a config written for it must fail loudly, naming the new one.
            raise ValueError(
                "grad_reduce_wire: 'buffer' was renamed to 'fp32' (the bucket is reduced as it is, "
                "FP32 with grad_reduce_in_fp32=True); use grad_reduce_wire='fp32'"
            )
        if self.grad_reduce_wire not in _WIRES:
            raise ValueError(
                f"grad_reduce_wire: expected one of {_WIRES}, got {self.grad_reduce_wire!r}"
            )
        if self.grad_reduce_wire != "fp32" and not self.grad_reduce_in_fp32:
            raise ValueError(
                f"grad_reduce_wire: {self.grad_reduce_wire!r} encodes an FP32 gradient buffer and "
                "sums in FP32, so it needs grad_reduce_in_fp32=True, got grad_reduce_in_fp32=False "
                "(a buffer in the parameter dtype is reduced in that dtype: use 'fp32', the default)"
            )
        if self.comm_backend not in _BACKENDS:
            raise ValueError(
                f"comm_backend: expected one of {_BACKENDS}, got {self.comm_backend!r}"
            )

    def resolved_bucket_size(self, dp: int) -> int:
        """bucket_size, or its default for data-parallel size dp."""
        return self.bucket_size if self.bucket_size is not None else max(40_000_000, 1_000_000 * dp)
