"""python -m fp8dp.train --profile FIRST:COUNT (fp8dp/train/step_profile.py): where a training step's
time goes, by category.

- category(): the kernel names of the H200 profiles in bench/results (cuBLASLt's FP8 and 16-bit
  GEMMs, fp8dp's kernels, torch's) and the CPU operators land where the table says.
- summarize() on hand-made events: per-step means, categories that add up to the work total.
- A CPU run of the demo's tiny config with --profile 3:2: the JSON holds steps 3..4, its
  categories add up to the total, the GEMMs are there, and exactly steps 3 and 4 are marked
  "profiled" in metrics.jsonl.

- idle_by_phase() on hand-made kernels and phase ranges: the gaps between the union of the
  kernels, each given to the innermost phase around its end.

Mutations tried (then restored): _train_steps without the profiler's begin(): the run test failed
(no step_profile.json). idle_by_phase measuring gaps from the previous kernel's end instead of the
union's (`end = b`): test_idle_by_phase failed (the overlapped kernel opened a false gap).
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fp8dp.train.step_profile import PHASE, category, idle_by_phase, parse_range, summarize

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("nvjet_sm90_qqtst_256x128_128x4_1x2_h_bz_coopA_bias_TNT", "FP8 GEMMs"),
        ("nvjet_sm90_qrtst_144x128_128x6_1x2_h_bz_coopA_algo2_TNN", "FP8 GEMMs"),
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT", "GEMMs"),
        ("aten::mm", "GEMMs"),
        (
            "void fp8dp::cuda::(anonymous namespace)::cast_transpose_kernel<(fp8dp::Format)0, "
            "__nv_bfloat16, true, 5, false>",
            "FP8 casts",
        ),
        (
            "void fp8dp::cuda::norm::(anonymous namespace)::norm_fwd_kernel<__nv_bfloat16, true, "
            "4, 2, 2, false>(fp8dp::cuda::norm",
            "norms",
        ),
        (
            "fp8dp::cuda::(anonymous namespace)::update_scaling_batched_kernel(fp8dp::cuda::"
            "(anonymous namespace)::SlotBatch)",
            "FP8 scaling",
        ),
        ("torch::autograd::CppNode<fp8dp::(anonymous namespace)::LinearFunction>", "fp8dp "
         "autograd nodes (host)"),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
         "communication"),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel>",
         "attention"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
         "optimizer"),
        ("void at::native::vectorized_elementwise_kernel<8, at::native::GeluCUDAKernelImpl>",
         "elementwise and copies"),
        ("Memcpy DtoD (Device -> Device)", "elementwise and copies"),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>",
         "norms"),
        ("some_unknown_kernel", "other"),
    ],
)  # fmt: skip
def test_category(name, expected):
    assert category(name) == expected


@pytest.mark.parametrize("text", ["3", "0:2", "3:0", "a:b", "1:2:3"])
def test_parse_range_refuses(text):
    with pytest.raises(ValueError, match=r"--profile: expected FIRST:COUNT .* got '"):
        parse_range(text)


def test_parse_range():
    assert parse_range("20:3") == (20, 3)


def _ev(name, device_us=0.0, self_cpu_us=0.0, cuda=True, annotation=False):
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return SimpleNamespace(
        name=name,
        device_type=kind,
        device_time=device_us,
        self_cpu_time_total=self_cpu_us,
        is_user_annotation=annotation,
    )


def test_summarize_means_per_step_and_categories_add_up():
    # two steps: one FP8 GEMM launch of 3 ms and one of 5 ms, a 1 ms cast per step; a CPU event
    # (ignored on CUDA); the optimizer's record_function range on the GPU timeline, which spans
    # kernels counted on their own (ignored: it was counted twice on 2026-12-05)
    events = [
        _ev("nvjet_sm90_qqtst_x", 3000.0),
        _ev("nvjet_sm90_qqtst_x", 5000.0),
        _ev("void fp8dp::cuda::cast_transpose_kernel<>", 1000.0),
        _ev("void fp8dp::cuda::cast_transpose_kernel<>", 1000.0),
        _ev("aten::mm", self_cpu_us=9e9, cuda=False),
        _ev("Optimizer.step#AdamW.step", 7000.0, annotation=True),
    ]
    res = summarize(events, steps=2, walls=[0.010, 0.012], cuda=True)
    assert res["wall_ms"] == pytest.approx(11.0)
    assert res["categories_ms"] == pytest.approx({"FP8 GEMMs": 4.0, "FP8 casts": 1.0})
    assert res["work_ms"] == pytest.approx(5.0)
    assert res["top"][0] == {
        "name": "nvjet_sm90_qqtst_x",
        "ms": pytest.approx(4.0),
        "per_step": 1.0,
        "category": "FP8 GEMMs",
    }
    cpu = summarize(events, steps=2, walls=[0.01, 0.01], cuda=False)
    assert cpu["categories_ms"] == pytest.approx({"GEMMs": 9e9 / 1e3 / 2})


@pytest.mark.slow
def test_a_cpu_run_profiles_the_steps_asked_for(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cmd += ["-m", "fp8dp.train", "--config", str(REPO / "configs" / "ci_convergence.yaml")]
    cmd += ["--device", "cpu", "--no-progress", "--profile", "3:2"]
    for kv in (
        "train.steps=6",
        "train.eval_every=100",
        f"out.dir={tmp_path}",
        f"data.cache_dir={tmp_path / 'corpus'}",
    ):
        cmd += ["--set", kv]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    res = json.loads((tmp_path / "fp8" / "step_profile.json").read_text())
    assert res["steps"] == [3, 4] and res["device"] == "cpu"
    assert sum(res["categories_ms"].values()) == pytest.approx(res["work_ms"], rel=1e-9)
    assert res["categories_ms"]["GEMMs"] > 0 and 0 < res["work_ms"] <= res["wall_ms"] * 1.05
    assert "steps 3..4:" in p.stdout and "ms per step (wall)" in p.stdout
    recs = [json.loads(x) for x in (tmp_path / "fp8" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r.get("profiled")] == [3, 4]


def _span(name, start, end, cuda=True, annotation=False):
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return SimpleNamespace(
        name=name,
        device_type=kind,
        time_range=SimpleNamespace(start=start, end=end),
        is_user_annotation=annotation,
    )


def test_idle_by_phase():
    """Kernels (us): [0, 40] overlaps [10, 20] (no gap after the short one), a 3 us gap (below
    min_gap_us), a 20 us gap ending in "forward", a 50 us gap ending in "backward_dw" nested in
    "backward", a 100 us gap ending outside the phases; the optimizer's range on the GPU timeline
    is not a kernel. Two steps: per-step means."""
    events = [
        _span("k", 0, 40),
        _span("k", 10, 20),
        _span("k", 43, 60),
        _span("k", 80, 90),
        _span("k", 140, 150),
        _span("k", 250, 260),
        _span("Optimizer.step#AdamW.step", 0, 260, annotation=True),
        _span(PHASE + "forward", 0, 85, cuda=False, annotation=True),
        _span(PHASE + "backward", 100, 200, cuda=False, annotation=True),
        _span(PHASE + "backward_dw", 120, 200, cuda=False, annotation=True),
        _span("aten::mm", 130, 145, cuda=False),
    ]
    res = idle_by_phase(events, steps=2)
    assert res["idle_by_phase_ms"] == pytest.approx(
        {"forward": 0.010, "backward_dw": 0.025, "(between steps)": 0.050}
    )
    assert res["idle_ms"] == pytest.approx(0.085)
    assert list(res["idle_by_phase_ms"])[0] == "(between steps)"  # largest first
    assert idle_by_phase([], steps=1) == {"idle_ms": 0, "idle_by_phase_ms": {}}
