"""The FP8 probe (fp8dp/train/fp8_stats.py, train.fp8_stats_every) and the head outside FP8
(fp8.exclude [head]): the tools for finding where an FP8 run loses against its BF16 twin.

- quantize() on a tensor built to hit each case: exact shares of saturated and flushed values,
  the fill of the range, and the relative error, computed by hand.
- The probe's emulation against fp8dp's own results (the probe's *_kernel checks): a Linear and a
  LayerNormLinear in FP32 with current scaling (CPU) compute y = cast(norm(x)) cast(w)^T + b,
  dx and main_grad with FP32 accumulation; the emulation gives the same to within FP32 rounding
  (the 64-term sums, k * 2^-24 of the sum of |terms|) plus the rare element whose norm differs
  from torch's by an ulp and rounds to the neighbouring FP8 value: measured ~1e-7 relative,
  asserted < 1e-4, while the FP8 error of each GEMM is 1e-2 to 6e-2. An emulation that cast
  with another scale, format or input (before the norm) is off by the FP8 error or more.
- Training with the probe is bit-identical to training without it (it only reads).
- fp8.exclude [head]: the head's output is the unquantized LayerNormLinear's, bit for bit, inside
  fp8_autocast; the head gets no FP8 state; a checkpoint from before the key resumes.

Mutations tried (each then restored): _gemm_input returning x (no norm): test_probe_matches_
fp8dp_cast[LayerNormLinear] fails (fprop_kernel 0.68 against 1e-4); quantize without the clamp: the E5M2 case gives inf
(torch's E5M2 conversion does not saturate); GPT.forward without head_precision: test_head_outside_fp8_is_unquantized fails.
"""

import io
import json
import math
import socket
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fp8dp
from fp8dp.train.config import load_config
from fp8dp.train.fp8_stats import FP8Probe, quantize, summarize
from fp8dp.train.model import GPT

REPO = Path(__file__).resolve().parents[2]


def test_quantize_counts_saturated_and_flushed_values_exactly():
    # E4M3 with scale 1: 1000 saturates to 448; 1.0 and 0.5 are exact; 2^-10 is below half the
    # smallest subnormal (2^-9) and flushes to 0; 0 is not counted among the flushed.
    v = torch.tensor([1000.0, 1.0, 0.5, 2.0**-10, 0.0])
    q, s = quantize(v, 1.0, "E4M3")
    assert q.tolist() == [448.0, 1.0, 0.5, 0.0, 0.0]
    assert s["saturated"] == 1 / 5
    assert s["flushed"] == 1 / 4
    assert s["fill"] == 1000.0 / 448.0
    expected = math.sqrt((1000.0 - 448.0) ** 2 + 2.0**-20) / math.sqrt(1000.0**2 + 1.25 + 2.0**-20)
    assert s["rel_err"] == pytest.approx(expected, rel=1e-6)
    # E5M2 keeps 2 mantissa bits: 1.125 rounds to 1.0 (round to nearest even), scale 4 first.
    q, s = quantize(torch.tensor([1.125]), 4.0, "E5M2")
    assert q.tolist() == [1.0] and s["saturated"] == 0.0 and s["fill"] == 4.5 / 57344.0
    # fp8dp's casts saturate; torch's E5M2 conversion alone would give inf.
    q, s = quantize(torch.tensor([1e6, -1e6]), 1.0, "E5M2")
    assert q.tolist() == [57344.0, -57344.0] and s["saturated"] == 1.0


def _tiny_model(exclude=()):
    cfg = load_config(REPO / "configs" / "demo.yaml", ["model.n_layer=1", "model.d_model=32"])
    torch.manual_seed(0)
    return cfg, GPT(cfg.model, False, False, torch.device("cpu"), exclude)


@pytest.mark.parametrize("module", ["Linear", "LayerNormLinear"])
def test_probe_matches_fp8dp_cast(tmp_path, fp8_states_released, module):
    torch.manual_seed(1)
    kw = dict(params_dtype=torch.float32, fuse_wgrad_accumulation=True)
    m = getattr(fp8dp, module)(64, 48, **kw)
    if module == "LayerNormLinear":
        with torch.no_grad():
            m.layer_norm_weight.uniform_(0.5, 1.5)
            m.layer_norm_bias.uniform_(-0.2, 0.2)
    m.weight.main_grad = torch.zeros_like(m.weight)
    x = (torch.randn(32, 64) * 3).requires_grad_()
    recipe = fp8dp.Float8CurrentScaling()
    probe = FP8Probe(torch.nn.Sequential(m), recipe, str(tmp_path / "s.jsonl"))
    with probe.capture(1):
        with fp8dp.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = m(x)
        (y * torch.linspace(-1, 1, 48)).sum().backward()
    rec = json.loads((tmp_path / "s.jsonl").read_text())
    assert rec["module"] == "0" and rec["step"] == 1
    assert rec["x"]["format"] == "E4M3" and rec["dy"]["format"] == "E5M2"
    assert rec["x"]["fill"] == pytest.approx(1.0, rel=1e-6)  # current scaling fills the range
    # fp8dp's forward, input gradient and main_grad against the emulation: FP32 rounding ...
    for key in ("fprop_kernel", "dgrad_kernel", "wgrad_kernel"):
        assert rec[key] < 1e-4, (key, rec[key])
    # ... far below what FP8 itself does to each GEMM
    for key in ("fprop", "dgrad", "wgrad"):
        assert 1e-3 < rec[key] < 0.2, (key, rec[key])


def test_probe_emulates_a_high_precision_weight_gradient(tmp_path, fp8_states_released):
    """override_linear_precision (False, False, True): the probe's emulated weight gradient is the
    unquantized product, which fp8dp's main_grad matches to FP32 rounding; no FP8 wgrad error is
    reported, the forward and dgrad ones still are."""
    torch.manual_seed(1)
    m = fp8dp.LayerNormLinear(64, 48, params_dtype=torch.float32, fuse_wgrad_accumulation=True)
    m.weight.main_grad = torch.zeros_like(m.weight)
    recipe = fp8dp.Float8CurrentScaling(override_linear_precision=(False, False, True))
    probe = FP8Probe(torch.nn.Sequential(m), recipe, str(tmp_path / "s.jsonl"))
    with probe.capture(1):
        with fp8dp.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = m((torch.randn(32, 64) * 3).requires_grad_())
        (y * torch.linspace(-1, 1, 48)).sum().backward()
    probe.close()
    rec = json.loads((tmp_path / "s.jsonl").read_text())
    assert "wgrad" not in rec and rec["wgrad_kernel"] < 1e-5
    assert 1e-3 < rec["fprop"] < 0.2 and 1e-3 < rec["dgrad"] < 0.2


def test_probe_reports_each_part_of_qkv_gradient(tmp_path, fp8_states_released):
    """One scale covers q, k and v's gradients (PARTS): built so that each part lands in a
    different place of E5M2's range under current scaling (amax 1, scale 57344): v's 1.0 and k's
    2^-10 (56 after scaling: 1.75 * 2^5) are exact, q's 1e-11 (6e-7 after scaling) is below half
    the smallest subnormal 2^-16 and flushes. So q's numbers are exactly 1 (all flushed, all its
    gradient lost, its weight-gradient rows zero) and k's and v's dy exact; their weight-gradient
    rows carry x's E4M3 error only, the same relative error for both (rows c * sum_t qx_t)."""
    from collections import OrderedDict

    torch.manual_seed(2)
    m = fp8dp.Linear(16, 48, params_dtype=torch.float32)
    weights = torch.tensor([1e-11] * 16 + [2.0**-10] * 16 + [1.0] * 16)
    recipe = fp8dp.Float8CurrentScaling()
    probe = FP8Probe(torch.nn.Sequential(OrderedDict(qkv=m)), recipe, str(tmp_path / "s.jsonl"))
    with probe.capture(1):
        with fp8dp.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = m(torch.randn(16, 16, requires_grad=True))
        (y * weights).sum().backward()
    probe.close()
    parts = json.loads((tmp_path / "s.jsonl").read_text())["dy_parts"]
    assert sorted(parts) == ["k", "q", "v"]
    assert parts["q"]["flushed"] == 1.0 and parts["q"]["rel_err"] == 1.0
    assert parts["q"]["wgrad"] == 1.0
    assert parts["q"]["rms_over_amax"] == pytest.approx(1e-11, rel=1e-6)
    for part, level in (("k", 2.0**-10), ("v", 1.0)):
        assert parts[part]["flushed"] == 0.0 and parts[part]["rel_err"] == 0.0
        assert parts[part]["rms_over_amax"] == level
        assert 0.0 < parts[part]["wgrad"] < 0.1
    assert parts["k"]["wgrad"] == pytest.approx(parts["v"]["wgrad"], rel=1e-5)
    table = summarize([json.loads((tmp_path / "s.jsonl").read_text())])
    assert "| 1 | q | 1e-11 | 1 | 1 | 1 |" in table


def test_probe_file_restarts_or_keeps_the_resumed_steps(tmp_path, fp8_states_released):
    """As metrics.jsonl: a fresh run starts the file, a resumed one keeps the steps up to its
    checkpoint (the later ones are probed again)."""
    _, gpt = _tiny_model()
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({"step": s, "module": "head"}) + "\n" for s in (1, 2, 3)))
    FP8Probe(gpt, fp8dp.DelayedScaling(), str(path), truncate_after=2).close()
    assert [json.loads(line)["step"] for line in path.open()] == [1, 2]
    FP8Probe(gpt, fp8dp.DelayedScaling(), str(path)).close()
    assert path.read_text() == ""


@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID"])
def test_probe_matches_fp8dp_block_scaling(tmp_path, fp8_states_released, fmt):
    """Float8BlockScaling: the probe casts with fp8dp's own CPU block casts (x and dy in 1x128
    tiles, their transposes re-cast along the tokens, w in 128x128 blocks), so fp8dp's forward,
    input gradient and main_grad match the emulation to FP32 rounding (bound as above); shapes
    with a partial tile in every direction (in 208, out 144, tokens 160). Scales not rounded to
    powers of two, so that a tile's scale moves where its values round: the transposed casts then
    differ from the row-major ones by about the FP8 error, and a wgrad emulated from the
    row-major casts fails the wgrad_kernel check (0.04-0.06 against 1e-4; with power-of-two scales
    both casts round every normal value alike)."""
    torch.manual_seed(3)
    m = fp8dp.LayerNormLinear(208, 144, params_dtype=torch.float32, fuse_wgrad_accumulation=True)
    m.weight.main_grad = torch.zeros_like(m.weight)
    x = (torch.randn(160, 208) * torch.logspace(-2, 2, 208)).requires_grad_()
    qp = fp8dp.recipe.QParams(power_2_scale=False)
    recipe = fp8dp.Float8BlockScaling(
        fp8_format=getattr(fp8dp.Format, fmt),
        fp8_quant_fwd_inp=qp,
        fp8_quant_fwd_weight=qp,
        fp8_quant_bwd_grad=qp,
    )
    probe = FP8Probe(torch.nn.Sequential(m), recipe, str(tmp_path / "s.jsonl"))
    with probe.capture(1):
        with fp8dp.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = m(x)
        (y * torch.linspace(-1, 1, 144)).sum().backward()
    probe.close()
    rec = json.loads((tmp_path / "s.jsonl").read_text())
    assert rec["dy"]["format"] == ("E4M3" if fmt == "E4M3" else "E5M2")
    for key in ("fprop_kernel", "dgrad_kernel", "wgrad_kernel"):
        assert rec[key] < 1e-4, (key, rec[key])
    for key in ("fprop", "dgrad", "wgrad"):
        assert 1e-3 < rec[key] < 0.2, (key, rec[key])
    for role in ("x", "dy"):
        assert rec[role]["rel_err_t"] != rec[role]["rel_err"]
        assert rec[role]["saturated"] == 0.0  # a tile's scale maps its own amax into range
        assert rec[role]["fill"] == pytest.approx(1.0, rel=1e-6)  # ... onto fp8_max exactly
    assert "rel_err_t" not in rec["w"]


@pytest.mark.parametrize(
    "sets, message",
    [
        (["train.fp8_stats_every=-1"], "train.fp8_stats_every"),
        (["fp8.exclude=head"], "fp8.exclude: expected a list of"),
    ],
)
def test_config_errors_name_the_key(sets, message):
    with pytest.raises(ValueError, match=message):
        load_config(REPO / "configs" / "demo.yaml", sets)


def test_summarize_orders_by_error():
    op = dict(format="E4M3", amax=1.0, scale=1.0, saturated=0.0, flushed=0.0)
    recs = [
        {"step": 2, "module": "a", "x": {**op, "fill": 0.5, "rel_err": 0.02}, "fprop": 0.01},
        {"step": 4, "module": "b", "x": {**op, "fill": 1.5, "rel_err": 0.03}, "dgrad": 0.3},
        {"step": 4, "module": "b", "fprop_kernel": 2e-3, "dgrad_kernel": 1e-7},
    ]
    lines = summarize(recs, top=3).splitlines()
    assert lines[2:5] == [
        "| 4 | b | dgrad | 0.3000 |",
        "| 4 | b | x | 0.0300 |",
        "| 2 | a | x | 0.0200 |",
    ]
    assert "- fullest range (fill): 1.5 (b x, step 4, E4M3)" in lines
    assert "- emptiest range (fill): 0.5 (a x, step 2, E4M3)" in lines
    assert "- fp8dp against the emulation, largest: 0.002 (b fprop_kernel, step 4)" in lines


@pytest.mark.parametrize("fp8_head", [False, True])
def test_head_outside_fp8_is_unquantized(fp8_states_released, fp8_head):
    """Inside fp8_autocast the blocks cast and the head does not (fp8.exclude [head]): its output
    is the unquantized norm + projection to FP32 rounding (< 1e-5 relative), while in FP8 it is
    off by FP8's error (> 1e-3)."""
    _, gpt = _tiny_model(exclude=() if fp8_head else ("head",))
    seen = {}
    gpt.head.register_forward_hook(lambda m, args, out: seen.update(h=args[0], y=out))
    with fp8dp.fp8_autocast(enabled=True):
        gpt(torch.randint(0, 256, (16, 2)))
    head = gpt.head
    ref = torch.nn.functional.linear(
        torch.nn.functional.layer_norm(
            seen["h"], (32,), head.layer_norm_weight, head.layer_norm_bias, head.eps
        ),
        head.weight,
        head.bias,
    )
    rel = float((seen["y"] - ref).detach().norm() / ref.detach().norm())
    assert gpt.blocks[0].qkv.get_extra_state() is not None  # the blocks ran in FP8
    if fp8_head:
        assert rel > 1e-3 and head.get_extra_state() is not None
    else:
        assert rel < 1e-5 and head.get_extra_state() is None


@pytest.mark.parametrize("name", ["qkv", "out", "up", "down", "head"])
def test_excluded_projections_get_no_fp8_state(fp8_states_released, name):
    """fp8.exclude [name]: under fp8_autocast every other projection casts (it has a delayed
    scaling state afterwards), the named one in every block does not."""
    _, gpt = _tiny_model(exclude=(name,))
    with fp8dp.fp8_autocast(enabled=True):
        gpt(torch.randint(0, 256, (16, 2))).float().sum().backward()
    for mod_name, m in gpt.named_modules():
        if isinstance(m, (fp8dp.Linear, fp8dp.LayerNormLinear)):
            excluded = mod_name.rsplit(".", 1)[-1] == name
            assert (m.get_extra_state() is None) == excluded, mod_name


def test_pipeline_head_block_runs_outside_fp8(fp8_states_released):
    from fp8dp.train.pipeline_run import pipeline_blocks

    _, gpt = _tiny_model(exclude=("head",))
    last = pipeline_blocks(gpt)[-1]
    assert last.head is gpt.head
    with fp8dp.fp8_autocast(enabled=True):
        last(torch.randn(16, 2, 32))
    assert gpt.head.get_extra_state() is None
    _, gpt = _tiny_model()
    assert pipeline_blocks(gpt)[-1] is gpt.head  # as in checkpoints from before fp8.exclude


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main(*argv):
    from fp8dp.train.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main([str(a) for a in argv] + ["--no-progress"])
    return rc, out.getvalue(), err.getvalue()


def _tiny_config(tmp: Path, name: str) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(
        "model: {n_layer: 1, d_model: 16, n_head: 1, seq_len: 16}\n"
        "train: {steps: 3, global_batch_size: 2, micro_batch_size: 1, warmup_steps: 1,\n"
        "        eval_every: 1, eval_batches: 1}\n"
        f"data: {{path: {REPO / 'data' / 'shakespeare.txt'}}}\n"
        f"out: {{dir: {tmp / name}}}\n"
    )
    return path


@pytest.fixture
def one_rank(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(k, v)

    def port():
        monkeypatch.setenv("MASTER_PORT", str(_free_port()))

    return port


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_training_with_the_probe_is_bit_identical(tmp_path, one_rank, fp8_states_released, recipe):
    runs = {}
    for name, every in (("plain", 0), ("probed", 1)):
        one_rank()
        cfg = _tiny_config(tmp_path, name)
        rc, out, err = _main(
            "--config", cfg, "--device", "cpu", "--set", f"fp8.recipe={recipe}",
            "--set", f"train.fp8_stats_every={every}",
        )  # fmt: skip
        assert rc == 0, err
        recs = [json.loads(line) for line in (tmp_path / name / "fp8" / "metrics.jsonl").open()]
        runs[name] = [(r.get("train_loss"), r.get("val_loss"), r.get("grad_norm")) for r in recs]
    assert runs["plain"] == runs["probed"]
    stats = [json.loads(line) for line in (tmp_path / "probed" / "fp8" / "fp8_stats.jsonl").open()]
    # 5 projections (qkv, out, up, down, head) at steps 1, 2, 3; delayed scaling's states exist
    # from step 2 on (step 1 casts with the scale of its first amax), current scaling's always.
    assert [(r["step"], r["module"]) for r in stats][:5] == [
        (1, m) for m in ("blocks.0.qkv", "blocks.0.out", "blocks.0.up", "blocks.0.down", "head")
    ]
    assert len(stats) == 15
    last = [r for r in stats if r["step"] == 3]
    assert all(r["x"] and r["w"] and r["dy"] and "wgrad" in r for r in last)


def test_checkpoint_from_before_fp8_exclude_resumes(tmp_path, one_rank, fp8_states_released):
    one_rank()
    cfg = _tiny_config(tmp_path, "run")
    rc, out, err = _main("--config", cfg, "--device", "cpu", "--save", tmp_path / "ckpt")
    assert rc == 0, err
    meta_path = tmp_path / "ckpt" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["config"]["fp8"].pop("exclude") == []
    # (and from before fp8.override_linear_precision)
    assert meta["config"]["fp8"].pop("override_linear_precision") == [False, False, False]
    meta_path.write_text(json.dumps(meta))
    one_rank()
    rc, out, err = _main(
        "--config", cfg, "--device", "cpu", "--set", "train.steps=4", "--resume", tmp_path / "ckpt"
    )
    assert rc == 0, err
    one_rank()
    rc, out, err = _main(
        "--config", cfg, "--device", "cpu", "--set", "train.steps=4", "--set", "fp8.exclude=[head]",
        "--resume", tmp_path / "ckpt",
    )  # fmt: skip
    assert rc == 2 and "fp8.exclude: expected []" in err, err
    one_rank()
    rc, out, err = _main(
        "--config", cfg, "--device", "cpu", "--set", "train.steps=4", "--set",
        "fp8.override_linear_precision=[false,false,true]", "--resume", tmp_path / "ckpt",
    )  # fmt: skip
    assert rc == 2 and "fp8.override_linear_precision: expected [False, False, False]" in err, err
