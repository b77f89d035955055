"""DistributedDataParallelConfig validation and the single-process pieces of fp8dp's DDP: bad fields
raise ValueError naming the field; the C++ layout rules as seen from Python."""

import pytest
import torch

import fp8dp
from fp8dp import _C


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("bucket_size", 0, "bucket_size: expected > 0 elements, got 0"),
        ("bucket_size", -5, "bucket_size: expected > 0 elements, got -5"),
        ("bucket_size", 1.5, "bucket_size: expected an int"),
        ("comm_backend", "mpi", "comm_backend: expected one of"),
        ("overlap_grad_reduce", 1, "overlap_grad_reduce: expected a bool, got 1"),
        ("grad_ledger", "yes", "grad_ledger: expected a bool"),
        ("nccl_blocking_wait", 0, "nccl_blocking_wait: expected a bool, got 0"),
        ("nccl_high_priority_stream", "no", "nccl_high_priority_stream: expected a bool"),
        ("overlap_param_gather", 1, "overlap_param_gather: expected a bool, got 1"),
        ("overlap_param_gather", True, "overlap_param_gather: True needs use_distributed_optim"),
        ("grad_reduce_wire", "fp8", "grad_reduce_wire: expected one of .*'fp8_e5m2'.*, got 'fp8'"),
        ("grad_reduce_wire", None, "grad_reduce_wire: expected one of .*, got None"),
    ],
)
def test_config_rejects_bad_fields(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        fp8dp.DistributedDataParallelConfig(**{field: value})


@pytest.mark.parametrize("wire", ["bf16", "fp8_e4m3", "fp8_e5m2"])
def test_low_precision_wire_needs_an_fp32_buffer(wire):
    with pytest.raises(ValueError, match="grad_reduce_wire: .* needs grad_reduce_in_fp32=True"):
        fp8dp.DistributedDataParallelConfig(grad_reduce_wire=wire, grad_reduce_in_fp32=False)
    assert fp8dp.DistributedDataParallelConfig(grad_reduce_wire=wire).grad_reduce_wire == wire
    # the default path, whatever the buffer dtype
    fp8dp.DistributedDataParallelConfig(grad_reduce_wire="fp32", grad_reduce_in_fp32=False)


def test_wire_default_is_fp32_and_its_old_name_buffer_is_refused():
    """grad_reduce_wire="buffer" (the old name of "fp32") is a ValueError that names the argument
    and the new value, in the Python config and in C++ (GradSyncOptions built without the config).
    Exact expected values: the default's name and the two messages.

    Mutations tried: dropping the "buffer" branch of DistributedDataParallelConfig.__post_init__
    -> this test failed: "Regex pattern did not match ... Actual message: grad_reduce_wire:
    expected one of ('fp32', 'bf16', 'fp8_e4m3', 'fp8_e5m2'), got 'buffer'". The C++ half (the
    FP8DP_CHECK_ARG for "buffer" in wire_from_name) is checked by
    test_grad_sync_options_reject_an_unknown_wire_in_cpp below and by the gtest
    Wire.OldNameBufferIsAValueErrorThatSaysFp32.
    """
    assert fp8dp.DistributedDataParallelConfig().grad_reduce_wire == "fp32"
    assert _C.GradSyncOptions().grad_reduce_wire == "fp32"
    with pytest.raises(ValueError, match=_RENAMED):
        fp8dp.DistributedDataParallelConfig(grad_reduce_wire="buffer")
    # The C++ half: test_grad_sync_options_reject_an_unknown_wire_in_cpp (needs the process group).


_RENAMED = r"grad_reduce_wire: 'buffer' was renamed to 'fp32' .*use grad_reduce_wire='fp32'"


@pytest.mark.parametrize("dp,expected", [(1, 40_000_000), (8, 40_000_000), (64, 64_000_000)])
def test_default_bucket_size_grows_with_dp(dp, expected):
    assert fp8dp.DistributedDataParallelConfig().resolved_bucket_size(dp) == expected
    assert fp8dp.DistributedDataParallelConfig(bucket_size=7).resolved_bucket_size(dp) == 7


def test_layout_from_python_matches_hand_derivation():
    # Reverse order 70@0, 5@128, 300@192 -> 492 >= 200 closes bucket 0, padded to lcm(3,128)=384
    # multiples: 768; then 10@768, padded to 1152.
    o = _C.LayoutOptions()
    o.dp, o.distributed_optimizer, o.bucket_size = 3, True, 200
    params, buckets, numel = _C.compute_layout([10, 300, 5, 70], o)
    assert params == [(768, 778, 1), (192, 492, 0), (128, 133, 0), (0, 70, 0)]
    assert buckets == [(0, 768, [3, 2, 1]), (768, 1152, [0])]
    assert numel == 1152


def test_ddp_without_process_group_is_a_clear_error():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        fp8dp.DistributedDataParallel(torch.nn.Linear(2, 2))


# Last in the module: the module-scoped `group` stays initialised until the module ends.
def test_grad_sync_options_reject_an_unknown_wire_in_cpp(group):
    """The C++ side checks the name too (GradSync built without the Python config)."""
    o = _C.GradSyncOptions()
    assert o.grad_reduce_wire == "fp32"
    comm = _C.ProcessGroupCommunicator(group)
    o.grad_reduce_wire = "buffer"  # the old name of "fp32"
    with pytest.raises(ValueError, match=_RENAMED):
        _C.GradSync([torch.zeros(3)], ["w"], comm, o)
    o.grad_reduce_wire = "fp4"
    with pytest.raises(ValueError, match="grad_reduce_wire: expected one of .*got 'fp4'"):
        _C.GradSync([torch.zeros(3)], ["w"], comm, o)
    o.grad_reduce_wire, o.grad_reduce_in_fp32 = "bf16", False
    with pytest.raises(ValueError, match="grad_reduce_wire: 'bf16' encodes FP32 gradient buffers"):
        _C.GradSync([torch.zeros(3, dtype=torch.bfloat16)], ["w"], comm, o)
