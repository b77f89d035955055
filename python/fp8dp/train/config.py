"""Training configuration: YAML -> validated dataclasses.

Every field is checked when the dataclass is built (``__post_init__``) and every error is a
ValueError that names the key as it is written in the YAML (``model.d_model``), what was expected
and what was given. The ``ddp`` and ``fp8`` sections build the library's own config objects
(fp8dp.DistributedDataParallelConfig, the recipes): their defaults and checks are the library's,
so each setting has one default. Checks that need the world size (the global batch must split evenly over the
ranks) run in ``TrainConfig.check_world_size`` right after torch.distributed starts, before any
model is built.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import yaml

from fp8dp.ddp_config import DistributedDataParallelConfig
from fp8dp.pipeline import _VIRTUAL as _SCHEDULES  # schedule -> its stages per pipeline rank
from fp8dp.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format

_DTYPES = ("float32", "bfloat16")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _as_float(v):
    # YAML 1.1 reads "3e-3" (no dot) as a string; take it as the number it obviously is.
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def _int(key: str, v, lo: int = 1) -> None:
    if not _is_int(v) or v < lo:
        raise ValueError(f"{key}: expected an integer >= {lo}, got {v!r}")


def _short(x: float) -> str:
    # 3 decimals, rounded down: the bound printed is one the check accepts (log2(448 / 2**-6)).
    return f"{math.floor(x * 1000) / 1000:.3f}".rstrip("0").rstrip(".")


def _num(key: str, v, lo: float, hi: Optional[float] = None, lo_open: bool = False) -> None:
    # inf passes any lower bound and NaN fails every comparison, so "finite" is checked as such.
    ok = (
        _is_num(v)
        and math.isfinite(v)
        and (v > lo if lo_open else v >= lo)
        and (hi is None or v <= hi)
    )
    if not ok:
        rng = f"{'>' if lo_open else '>='} {lo}"
        if hi is not None:
            rng += f" and <= {_short(hi)}"
        raise ValueError(f"{key}: expected a finite number {rng}, got {v!r}")


def _bool(key: str, v) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"{key}: expected true or false, got {v!r}")


def _choice(key: str, v, choices) -> None:
    if v not in choices:
        raise ValueError(f"{key}: expected one of {list(choices)}, got {v!r}")


def _mult16(key: str, v) -> None:
    # FP8 GEMMs need both inner dimensions to be multiples of 16 (on GPUs, and on the CPU so that
    # behaviour does not depend on the device).
    if v % 16 != 0:
        raise ValueError(f"{key}: expected a multiple of 16 (FP8 GEMM dimensions), got {v}")


@dataclass
class ModelConfig:
    """A GPT whose every projection is an fp8dp.LayerNormLinear or fp8dp.Linear."""

    n_layer: int = 2
    """Transformer blocks. Default 2: learns character statistics within a CPU minute."""
    d_model: int = 64
    """Hidden width; a multiple of 16 and of n_head. Default 64."""
    n_head: int = 4
    """Attention heads; d_model / n_head is the head width. Default 4."""
    ffn_mult: int = 4
    """MLP width = ffn_mult * d_model (the usual 4)."""
    seq_len: int = 64
    """Tokens (bytes) per sequence. Default 64."""
    normalization: str = "LayerNorm"
    """"LayerNorm" or "RMSNorm", fused into each LayerNormLinear."""
    bias: bool = True
    """Biases on every projection. Default true: exercises the bias-gradient path (contract C4)."""
    params_dtype: str = "float32"
    """"float32" or "bfloat16". Default float32: the CPU emulation is fastest in FP32."""
    tie_embeddings: bool = False
    """The head's weight IS the token embedding (GPT-2's tie; Megatron's
    share_embeddings_and_output_weights). Default false, as before. Under pipeline parallelism
    the embedding (first stage) and the head (last stage) each hold a copy, summed and kept
    identical by fp8dp.pipeline (contract C15)."""
    fused_mlp: bool = False
    """Each block's MLP as one fp8dp.LayerNormMLP (norm + fc1 + GELU + fc2; the GELU fused with
    fc2's input cast in the forward and with fc1's output-gradient cast in the backward) instead
    of LayerNormLinear, torch's GELU and Linear. The same parameters, initialised from the same
    random stream, under the names blocks.N.mlp.fc1 / .fc2 instead of blocks.N.up / .down (so a
    checkpoint does not carry over). Default false."""
    fused_residual: bool = False
    """Each block's two residual adds done in the epilogue of the GEMM before them (the out
    projection's, and the MLP's down projection's or LayerNormMLP fc2's): ``out(a, residual=x)``
    instead of ``x + out(a)``, so no separate add kernel runs (48 per step of the 342M model,
    2.3 ms of 107 ms on an H100). The sum is rounded once instead of twice, so the loss differs
    from the unfused run's by rounding only; parameters and checkpoints are the same. Not with the
    FP8 probe (it compares each projection's output with x · Wᵀ + bias). Default false: to be
    measured on the GPU first."""
    fused_activation: Any = False
    """Which projection of the separate MLP applies its GELU instead of torch's GELU between them:
    false (neither), true or "up" (``LayerNormLinear(activation="gelu")``: under FP8 the GELU's
    derivative is applied inside the cast of up's output gradient, so the backward writes no
    high-precision gradient of size tokens × ffn for the cast to read again), or "down"
    (``Linear(input_activation="gelu")``: under FP8 the GELU is applied inside the cast of down's
    input, so the forward writes no high-precision activation of that size for the cast to read
    again). Same parameters and names; fp8dp's GELU (the exact erf form, activation_math.h)
    differs from torch's by rounding only. Not with model.fused_mlp (LayerNormMLP fuses its GELU
    itself, both halves) or the FP8 probe (it compares each projection's output with
    x · Wᵀ + bias). Default false."""

    def activation_place(self) -> str:
        """Where the separate MLP's GELU runs: "torch", "up" or "down" (model.fused_activation)."""
        if self.fused_activation is True:
            return "up"
        return self.fused_activation or "torch"

    def __post_init__(self):
        for k in ("n_layer", "d_model", "n_head", "ffn_mult", "seq_len"):
            _int(f"model.{k}", getattr(self, k))
        _mult16("model.d_model", self.d_model)
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"model.n_head: expected a divisor of model.d_model={self.d_model}, "
                f"got {self.n_head}"
            )
        _choice("model.normalization", self.normalization, ("LayerNorm", "RMSNorm"))
        _bool("model.bias", self.bias)
        _bool("model.tie_embeddings", self.tie_embeddings)
        _bool("model.fused_mlp", self.fused_mlp)
        _bool("model.fused_residual", self.fused_residual)
        if not (isinstance(self.fused_activation, bool) or self.fused_activation in ("up", "down")):
            raise ValueError(
                "model.fused_activation: expected false, true, 'up' or 'down', "
                f"got {self.fused_activation!r}"
            )
        if self.fused_activation and self.fused_mlp:
            raise ValueError(
                "model.fused_activation: expected false with model.fused_mlp (LayerNormMLP fuses "
                f"its GELU itself), got {self.fused_activation!r}"
            )
        _choice("model.params_dtype", self.params_dtype, _DTYPES)


@dataclass
class TrainSection:
    """Steps, batch sizes and the optimizer."""

    steps: int = 300
    """Optimizer steps. Default 300."""
    global_batch_size: int = 16
    """Sequences per step over all ranks = micro_batch_size * micro-batches * world size."""
    micro_batch_size: int = 4
    """Sequences per forward/backward. micro_batch_size * model.seq_len must be a multiple of 16."""
    lr: float = 3e-3
    """Peak AdamW learning rate. Default 3e-3 (small model, few steps)."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio. Default 0.1."""
    warmup_steps: int = 20
    """Linear warm-up steps. Default 20."""
    weight_decay: float = 0.1
    """AdamW weight decay. Default 0.1."""
    beta1: float = 0.9
    """AdamW beta1. Default 0.9."""
    beta2: float = 0.95
    """AdamW beta2. Default 0.95, as is usual for transformers."""
    eval_every: int = 25
    """Validation loss every this many steps (and at the last step). Default 25."""
    eval_batches: int = 4
    """Micro-batches per rank in one validation pass. Default 4."""
    save_every: int = 0
    """With --save DIR: also checkpoint into DIR/step_NNNNNN every this many steps; 0 = only the
    final checkpoint (into DIR)."""
    seed: int = 1234
    """Seed of the initial weights and of the data order. Default 1234."""
    # -- what a run of a real model needs (the 342M runs, configs/gpt350m.yaml) --
    clip_grad: float = 0.0
    """Clip the global gradient norm (over all ranks' shards, after the reduction) to this before
    the optimizer step; 0 = no clipping. Default 0 (the demo's small runs need none; 1.0 is usual
    for large models)."""
    fp8_stats_every: int = 0
    """Every this many steps (and at step 1), probe one micro-batch: per fp8dp projection, what
    the FP8 casts do to its GEMM operands and GEMMs (fill of the format's range, saturated and
    flushed shares, relative errors; fp8dp/train/fp8_stats.py), appended to
    <out.dir>/<run>/fp8_stats.jsonl by rank 0. 0 = never. Delayed and current scaling, data
    parallel only; it reads and changes nothing."""
    peak_tflops: Optional[float] = None
    """Peak dense TFLOP/s of one device, for the model FLOPs utilisation in the metrics (fp8dp/
    train/flops.py says how FLOPs are counted); null = no MFU. E.g. 989 for an H200's BF16."""
    cuda_graphs: bool = False
    """Capture the model's forward and backward in CUDA graphs (fp8dp.make_graphed_callables)
    after the first step of each launch, and replay them for every later micro-batch: the same
    numbers, less host time. CUDA only, data parallel only, without train.fp8_stats_every.
    The capture's seconds go into that step's metrics as graph_capture_s (not into its
    step_time_s); summary.json's cuda_graphs says whether it happened. Default false."""

    def __post_init__(self):
        self.clip_grad = _as_float(self.clip_grad)
        _num("train.clip_grad", self.clip_grad, 0.0)
        if self.peak_tflops is not None:
            self.peak_tflops = _as_float(self.peak_tflops)
            _num("train.peak_tflops", self.peak_tflops, 0.0, lo_open=True)
        for k in ("steps", "global_batch_size", "micro_batch_size", "eval_every", "eval_batches"):
            _int(f"train.{k}", getattr(self, k))
        _int("train.warmup_steps", self.warmup_steps, lo=0)
        _int("train.save_every", self.save_every, lo=0)
        _int("train.fp8_stats_every", self.fp8_stats_every, lo=0)
        _int("train.seed", self.seed, lo=0)
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"train.cuda_graphs: expected true or false, got {self.cuda_graphs!r}")
        for k in ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2"):
            setattr(self, k, _as_float(getattr(self, k)))
        _num("train.lr", self.lr, 0.0, lo_open=True)
        _num("train.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _num("train.weight_decay", self.weight_decay, 0.0)
        _num("train.beta1", self.beta1, 0.0, 1.0)
        _num("train.beta2", self.beta2, 0.0, 1.0)
        if self.global_batch_size % self.micro_batch_size != 0:
            raise ValueError(
                f"train.global_batch_size: expected a multiple of train.micro_batch_size="
                f"{self.micro_batch_size}, got {self.global_batch_size}"
            )

    def adamw_kwargs(self, device, found_inf: bool = False) -> dict:
        """The keyword arguments of torch.optim.AdamW for the run's DistributedOptimizers. On
        CUDA, torch's fused kernel: one pass over masters, gradients and both moments where the
        default foreach kernels make several (10.6 ms of the 342M step's 126 ms of kernels on an
        H100, 12-05). Its rounding differs from foreach's in the last bits, so a run does not
        switch kernels across a resume: loading a checkpoint restores the saved groups' `fused`
        with the rest of their settings. found_inf (ddp.defer_nan_check): the fused kernel on the
        CPU too, the one that can skip its step on the device."""
        kw = dict(lr=self.lr, betas=(self.beta1, self.beta2), weight_decay=self.weight_decay)
        if torch.device(device).type == "cuda" or found_inf:
            kw["fused"] = True
        return kw


def _library_default(cls, name: str):
    """The default of field `name` of the library's config class `cls`: the demo's sections take
    every default of a library setting from there, so that each setting has one default."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _library_error(section: str, e: ValueError) -> ValueError:
    """The library's ValueError (it starts with the field's name) with the key as the YAML writes
    it: "bucket_size: ..." -> "ddp.bucket_size: ..."."""
    return ValueError(f"{section}.{e}")


PROJECTIONS = ("qkv", "out", "up", "down", "head")  # what fp8.exclude may name (model.py)

ACCUMULATION_KEYS = (
    "split_accumulator_fprop",
    "split_accumulator_dgrad",
    "split_accumulator_wgrad",
)


@dataclass
class FP8Section:
    """FP8 recipe of the run (contract C7): fp8dp.DelayedScaling or fp8dp.Float8CurrentScaling,
    built by recipe_object(). The recipe fields' defaults and checks are the recipes' own."""

    enabled: bool = True
    """Run every fp8dp projection in FP8. false gives the params_dtype baseline."""
    recipe: str = "delayed"
    """"delayed" (DelayedScaling), "current" (Float8CurrentScaling) or "block"
    (Float8BlockScaling: 1x128 tiles, 128x128 weight blocks, with the recipe's own defaults: the
    delayed-scaling keys and split_accumulator_* do not apply, it splits every accumulator)."""
    format: Optional[str] = None
    """Every recipe: "HYBRID" (E4M3 forward, E5M2 gradients) or "E4M3" (gradients in E4M3 too:
    one more mantissa bit, less range). Default null: the recipe's own default, HYBRID for
    delayed and current scaling, E4M3 for block scaling (resolved when the config loads, so a
    run's config.json and checkpoints name the format it ran)."""
    exclude: list = field(default_factory=list)
    """Projections kept out of FP8 (they run in params_dtype under fp8_autocast), by name: "qkv",
    "out", "up", "down" (in every block) and "head" (final norm + logits). Default none.
    Megatron-core and DeepSeek-V3 keep the head out of FP8 (at 256 outputs it is a small share of
    the FLOPs); the others are for finding where FP8 costs accuracy."""
    amax_history_len: int = _library_default(DelayedScaling, "amax_history_len")
    """Delayed scaling: steps of amax history (DelayedScaling's default; the shipped configs set
    16, which reacts within a few steps in a short run)."""
    amax_compute_algo: str = _library_default(DelayedScaling, "amax_compute_algo")
    """Delayed scaling: "max" or "most_recent"."""
    margin: float = _library_default(DelayedScaling, "margin")
    """Headroom in powers of two; at most log2(448 / 2**-6) = 14.807 (see
    fp8dp.recipe.MAX_MARGIN)."""
    split_accumulator_fprop: bool = _library_default(DelayedScaling, "split_accumulator_fprop")
    """CUDA FP8 GEMMs: FP32-promoted (true) or fast (false) accumulation in the forward GEMM, as
    the recipes' field of that name (default: theirs, TransformerEngine's)."""
    split_accumulator_dgrad: bool = _library_default(DelayedScaling, "split_accumulator_dgrad")
    """The same for the input-gradient GEMM."""
    split_accumulator_wgrad: bool = _library_default(DelayedScaling, "split_accumulator_wgrad")
    """The same for the weight-gradient GEMM."""
    override_linear_precision: tuple = _library_default(DelayedScaling, "override_linear_precision")
    """Delayed and current scaling: [fprop, dgrad, wgrad], the GEMMs that run in params_dtype
    instead of FP8, as the recipes' field of that name (default [false, false, false]; e.g.
    [true, false, false] for the forward GEMMs in high precision). The YAML's list is kept as a
    tuple, the recipes' form."""

    def accumulation(self) -> dict:
        """The three split_accumulator_* fields and override_linear_precision, as keyword
        arguments of either per-tensor recipe."""
        kw = {k: getattr(self, k) for k in ACCUMULATION_KEYS}
        kw["override_linear_precision"] = self.override_linear_precision
        return kw

    def unused_keys(self) -> list:
        """The keys set away from their default that the run's recipe does not read: the
        delayed-scaling keys under current scaling, those and margin and split_accumulator_*
        under block scaling (none with FP8 off, where no recipe key is read and that is plain).
        Not an error (a shipped config sets amax_history_len for its delayed runs and is also
        trained with the other recipes); the trainer prints them, so that a setting that does
        nothing is not taken for one that does."""
        if not self.enabled:
            return []
        delayed_only = ("amax_history_len", "amax_compute_algo")
        unused = {
            "delayed": (),
            "current": delayed_only,
            "block": delayed_only + ("margin",) + ACCUMULATION_KEYS,
        }[self.recipe]
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [
            f"fp8.{k}={getattr(self, k)!r}"
            for k in unused
            if defaults[k] is not None and getattr(self, k) != defaults[k]
        ]

    def recipe_object(self):
        """The run's recipe: fp8dp.Float8CurrentScaling, fp8dp.Float8BlockScaling or fp8dp.DelayedScaling."""
        if self.recipe == "current":
            return Float8CurrentScaling(
                fp8_format=Format[self.format], margin=self.margin, **self.accumulation()
            )
        if self.recipe == "block":
            return Float8BlockScaling(fp8_format=Format[self.format])
        return self._delayed()

    def _delayed(self) -> DelayedScaling:
        return DelayedScaling(
            fp8_format=Format[self.format],
            amax_history_len=self.amax_history_len,
            amax_compute_algo=self.amax_compute_algo,
            margin=self.margin,
            **self.accumulation(),
        )

    def __post_init__(self):
        self.margin = _as_float(self.margin)
        _bool("fp8.enabled", self.enabled)
        if not isinstance(self.exclude, list) or not all(p in PROJECTIONS for p in self.exclude):
            raise ValueError(
                f"fp8.exclude: expected a list of {list(PROJECTIONS)}, got {self.exclude!r}"
            )
        if isinstance(self.override_linear_precision, list):
            self.override_linear_precision = tuple(self.override_linear_precision)
        _choice("fp8.recipe", self.recipe, ("delayed", "current", "block"))
        if self.format is None:
            # The recipe's own default (one default per setting: the library's).
            cls = {"block": Float8BlockScaling, "current": Float8CurrentScaling}.get(
                self.recipe, DelayedScaling
            )
            self.format = _library_default(cls, "fp8_format").value
        _choice("fp8.format", self.format, ("HYBRID", "E4M3"))
        if self.recipe == "block" and self.override_linear_precision != (False,) * 3:
            raise ValueError(
                "fp8.override_linear_precision: expected [false, false, false] with fp8.recipe "
                f"block (per-tensor recipes only), got {self.override_linear_precision!r}"
            )
        try:
            # Every field, whichever recipe runs (Float8CurrentScaling checks its margin and
            # accumulation fields as DelayedScaling does).
            self._delayed()
        except ValueError as e:
            raise _library_error("fp8", e) from None


@dataclass
class DDPSection:
    """fp8dp.DistributedDataParallel (built by library_config()) and the modules' gradient routes
    (contracts C1-C6). Each key but fuse_wgrad_accumulation is the DistributedDataParallelConfig
    field of that name, with its default and its checks (its docstring says what each does)."""

    overlap_grad_reduce: bool = _library_default(
        DistributedDataParallelConfig, "overlap_grad_reduce"
    )
    """Launch each bucket's collective as soon as it is complete, during backward / backward_dw."""
    use_distributed_optimizer: bool = True
    """ZeRO-1: reduce-scatter the gradients and step an FP32 master shard per rank. Default true,
    not the library's false: the only value the demo runs (it steps fp8dp.DistributedOptimizer)."""
    grad_reduce_in_fp32: bool = _library_default(
        DistributedDataParallelConfig, "grad_reduce_in_fp32"
    )
    """main_grad (and the collective) in FP32 even for bfloat16 parameters."""
    bucket_size: Optional[int] = _library_default(DistributedDataParallelConfig, "bucket_size")
    """Elements per bucket; null = fp8dp's default. A small value gives several buckets."""
    delay_wgrad_compute: bool = _library_default(
        DistributedDataParallelConfig, "delay_wgrad_compute"
    )
    """Backward computes input gradients only; backward_dw() runs the weight gradients afterwards
    (as a zero-bubble pipeline schedule would)."""
    fuse_wgrad_accumulation: bool = True
    """The weight-gradient GEMM accumulates straight into main_grad (contract C2 b): an option of
    the demo's fp8dp modules, not of DistributedDataParallelConfig."""
    average_in_collective: bool = _library_default(
        DistributedDataParallelConfig, "average_in_collective"
    )
    """Average with the collective's AVG instead of a 1/dp pre-scale."""
    check_for_nan_in_grad: bool = _library_default(
        DistributedDataParallelConfig, "check_for_nan_in_grad"
    )
    """Fail (naming the parameters) when a reduced gradient holds a NaN."""
    defer_nan_check: bool = _library_default(DistributedDataParallelConfig, "defer_nan_check")
    """The NaN check without the host's wait: a step with NaN is skipped on the device and the
    next step raises (DistributedDataParallelConfig.defer_nan_check); AdamW runs fused then, on
    the CPU too. Data-parallel runs only."""
    grad_reduce_wire: str = _library_default(DistributedDataParallelConfig, "grad_reduce_wire")
    """What the gradient reduction sends (DistributedDataParallelConfig.grad_reduce_wire: its
    values and default)."""

    def library_config(self) -> DistributedDataParallelConfig:
        """The fp8dp.DistributedDataParallelConfig of these keys (ValueError naming the key)."""
        keys = [f.name for f in dataclasses.fields(self) if f.name != "fuse_wgrad_accumulation"]
        try:
            return DistributedDataParallelConfig(**{k: getattr(self, k) for k in keys})
        except ValueError as e:
            raise _library_error("ddp", e) from None

    def __post_init__(self):
        _bool("ddp.fuse_wgrad_accumulation", self.fuse_wgrad_accumulation)
        self.library_config()
        if not self.use_distributed_optimizer:
            raise ValueError(
                "ddp.use_distributed_optimizer: the demo trains with fp8dp.DistributedOptimizer, "
                "which needs true, got false"
            )


@dataclass
class ParallelSection:
    """Pipeline parallelism (fp8dp.pipeline, contract C10). The world splits into
    pipeline_parallel_size pipeline ranks x world / pipeline_parallel_size data-parallel ranks
    (Megatron's rank order); with 1 the demo is plain data-parallel and never touches the pipeline
    code."""

    pipeline_parallel_size: int = 1
    """Pipeline ranks; a divisor of the world size. Default 1: data-parallel only."""
    virtual_stages: int = 1
    """Stages per pipeline rank: 1 for 1f1b, 1 or 2 for interleaved_1f1b and zero_bubble, 2 for
    zbv (its V). Default 1."""
    schedule: str = "1f1b"
    """torch.distributed.pipelining schedule: "1f1b", "interleaved_1f1b", "zero_bubble" or "zbv";
    the last two run fp8dp's deferred weight gradients as their W steps. Default 1f1b."""

    def __post_init__(self):
        _int("parallel.pipeline_parallel_size", self.pipeline_parallel_size)
        _int("parallel.virtual_stages", self.virtual_stages)
        _choice("parallel.schedule", self.schedule, _SCHEDULES)
        allowed = _SCHEDULES[self.schedule]
        if self.virtual_stages not in allowed:
            raise ValueError(
                f"parallel.virtual_stages: schedule {self.schedule!r} expected "
                f"{' or '.join(map(str, allowed))}, got {self.virtual_stages}"
            )


@dataclass
class DataSection:
    """The byte-level text corpus."""

    path: str = "data/shakespeare.txt"
    """Text file (relative paths are taken from the current directory). Default: the shipped one."""
    val_fraction: float = 0.1
    """Last fraction of the file held out for the validation loss. Default 0.1."""

    # -- the corpus: which one, and where the Python-source corpus is cached --
    corpus: str = "text"
    """"text": data.path, its last val_fraction held out (default: small, for CPU tests).
    "python": the Python sources of this interpreter's standard library (+ data.packages), byte
    level, split by file (val_fraction of the files), cached as uint8 .bin files and memory-mapped
    (fp8dp/train/corpus.py). The manifest (files, splits, SHA-256) goes into the run's
    corpus.json."""
    packages: list = field(default_factory=list)
    """corpus python: installed packages whose .py files join the standard library's, e.g.
    [torch] (about 46 MB more). Default none: the standard library alone (about 31 MB)."""
    cache_dir: str = "runs/corpus"
    """corpus python: where the concatenated .bin files are built, once per listing of files.
    Default runs/corpus, shared by every run started from the same directory."""

    def __post_init__(self):
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"data.path: expected a file path, got {self.path!r}")
        self.val_fraction = _as_float(self.val_fraction)
        _num("data.val_fraction", self.val_fraction, 0.0, 0.5, lo_open=True)
        _choice("data.corpus", self.corpus, ("text", "python"))
        if not isinstance(self.packages, list) or not all(
            isinstance(p, str) and p for p in self.packages
        ):
            raise ValueError(
                f"data.packages: expected a list of package names, got {self.packages!r}"
            )
        if not isinstance(self.cache_dir, str) or not self.cache_dir:
            raise ValueError(f"data.cache_dir: expected a directory path, got {self.cache_dir!r}")


@dataclass
class OutputSection:
    """Where metrics, plot and checkpoints go."""

    dir: str = "runs/demo"
    """Run directory: <dir>/fp8/ and <dir>/nofp8/ hold each run's metrics, <dir>/loss.png the
    plot."""

    def __post_init__(self):
        if not isinstance(self.dir, str) or not self.dir:
            raise ValueError(f"out.dir: expected a directory path, got {self.dir!r}")


@dataclass
class RunSection:
    """Where the ranks run. The demo decides once, before torch.distributed starts
    (fp8dp/train/device.py, choose_device), so that a job that cannot run stops with one line on
    every rank instead of failing inside CUDA or hanging in init_process_group."""

    device: str = "auto"
    """"auto", "cpu" or "cuda". auto: cuda (one GPU per rank, cuda:LOCAL_RANK) when this fp8dp
    build has CUDA and torch sees a GPU, else cpu; with run.backend set, the device that backend
    runs on. cuda with more ranks per node than visible GPUs is an error that says what to run
    instead. CLI: --device."""
    backend: str = "auto"
    """"auto", "gloo" or "nccl": the torch.distributed backend. auto: nccl on cuda, gloo on cpu;
    the demo runs gloo on the CPU and NCCL on GPUs only (the two pairs fp8dp's tests run).
    CLI: --backend."""

    def __post_init__(self):
        _choice("run.device", self.device, ("auto", "cpu", "cuda"))
        _choice("run.backend", self.backend, ("auto", "gloo", "nccl"))
        # The pairs that cannot run whatever the machine has fail here, before any work starts.
        if self.device == "cpu" and self.backend == "nccl":
            raise ValueError(
                "run.backend: expected gloo or auto with run.device cpu (NCCL reduces CUDA tensors "
                "only), got 'nccl'; use --device cuda for NCCL"
            )
        if self.device == "cuda" and self.backend == "gloo":
            raise ValueError(
                "run.backend: expected nccl or auto with run.device cuda (the demo runs gloo on "
                "CPU ranks only), got 'gloo'; use --device cpu for gloo"
            )


_SECTIONS = {
    "model": ModelConfig,
    "train": TrainSection,
    "fp8": FP8Section,
    "ddp": DDPSection,
    "parallel": ParallelSection,
    "data": DataSection,
    "out": OutputSection,
    "run": RunSection,
}


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainSection = field(default_factory=TrainSection)
    fp8: FP8Section = field(default_factory=FP8Section)
    ddp: DDPSection = field(default_factory=DDPSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    data: DataSection = field(default_factory=DataSection)
    out: OutputSection = field(default_factory=OutputSection)
    run: RunSection = field(default_factory=RunSection)

    def __post_init__(self):
        tokens = self.train.micro_batch_size * self.model.seq_len
        if tokens % 16 != 0:
            raise ValueError(
                f"train.micro_batch_size: micro_batch_size * model.seq_len (tokens per FP8 GEMM) "
                f"must be a multiple of 16, got {self.train.micro_batch_size} * "
                f"{self.model.seq_len} = {tokens}"
            )
        par = self.parallel
        if self.train.fp8_stats_every > 0 and self.fp8.enabled:
            if par.pipeline_parallel_size > 1:
                raise ValueError(
                    "train.fp8_stats_every: expected 0 with parallel.pipeline_parallel_size > 1 "
                    f"(the probe runs on the data-parallel path), got {self.train.fp8_stats_every}"
                )
        if self.model.fused_mlp and self.train.fp8_stats_every > 0 and self.fp8.enabled:
            raise ValueError(
                "model.fused_mlp: expected false with train.fp8_stats_every > 0 (the probe "
                "watches each projection's own forward, which LayerNormMLP does not call), got true"
            )
        if self.model.fused_residual and self.train.fp8_stats_every > 0 and self.fp8.enabled:
            raise ValueError(
                "model.fused_residual: expected false with train.fp8_stats_every > 0 (the probe "
                "compares each projection's output with x · Wᵀ + bias, which the residual added "
                "in the GEMM would offset), got true"
            )
        if self.model.fused_activation and self.train.fp8_stats_every > 0 and self.fp8.enabled:
            raise ValueError(
                "model.fused_activation: expected false with train.fp8_stats_every > 0 (the probe "
                "compares each projection's output with x · Wᵀ + bias, which a GELU inside up or "
                f"down would change), got {self.model.fused_activation!r}"
            )
        if self.model.fused_mlp and ("up" in self.fp8.exclude) != ("down" in self.fp8.exclude):
            raise ValueError(
                "model.fused_mlp: expected fp8.exclude to name both or neither of 'up' and 'down' "
                f"(one LayerNormMLP runs both GEMMs), got fp8.exclude={self.fp8.exclude}"
            )
        if self.train.cuda_graphs and par.pipeline_parallel_size > 1:
            raise ValueError(
                "train.cuda_graphs: expected false with parallel.pipeline_parallel_size > 1 (the "
                "pipeline schedules run several forwards before their backwards; a graphed "
                "callable runs one at a time), got true"
            )
        if self.train.cuda_graphs and self.train.fp8_stats_every > 0:
            raise ValueError(
                "train.cuda_graphs: expected false with train.fp8_stats_every > 0 (the probe "
                "watches eager casts, which a replay does not run), got true"
            )
        if par.pipeline_parallel_size > 1:
            # fp8dp.pipeline's blocks: the embedding, each transformer block, the norm + head.
            blocks, stages = self.model.n_layer + 2, par.pipeline_parallel_size * par.virtual_stages
            if blocks < stages:
                raise ValueError(
                    f"model.n_layer: expected at least parallel.pipeline_parallel_size * "
                    f"parallel.virtual_stages - 2 = {stages - 2} (one block per stage; the "
                    f"embedding and the head are blocks too), got {self.model.n_layer}"
                )

    def check_world_size(self, world_size: int) -> int:
        """Micro-batches per data-parallel rank per step; error naming train.global_batch_size when
        the global batch does not split into whole micro-batches on every data-parallel rank, or
        the parallel.* key that the world size or the schedule cannot take."""
        pp = self.parallel.pipeline_parallel_size
        if pp > 1:
            return self._check_pipeline(world_size)
        per_step = self.train.micro_batch_size * world_size
        if self.train.global_batch_size % per_step != 0:
            raise ValueError(
                f"train.global_batch_size: expected a multiple of train.micro_batch_size * world "
                f"size = {self.train.micro_batch_size} * {world_size} = {per_step}, "
                f"got {self.train.global_batch_size}"
            )
        return self.train.global_batch_size // per_step

    def _check_pipeline(self, world_size: int) -> int:
        pp = self.parallel.pipeline_parallel_size
        if world_size % pp != 0:
            raise ValueError(
                f"parallel.pipeline_parallel_size: expected a divisor of the world size "
                f"{world_size}, got {pp}"
            )
        dp = world_size // pp
        # The pipelines read the global batch exactly as the data-parallel run of the same world
        # size does (train/pipeline.py), so it must split the same way: whole micro-batches per
        # rank of that run.
        per_step = self.train.micro_batch_size * world_size
        if self.train.global_batch_size % per_step != 0:
            raise ValueError(
                f"train.global_batch_size: expected a multiple of train.micro_batch_size * world "
                f"size = {self.train.micro_batch_size} * {world_size} = {per_step} (the "
                f"pipelines read the batches of the data-parallel run of the same world size), "
                f"got {self.train.global_batch_size}"
            )
        # So every pipeline runs pp * k micro-batches: at least pp, and whole rounds of pp, which
        # is all that fp8dp.pipeline.check_layout asks of the micro-batch count.
        return self.train.global_batch_size // (self.train.micro_batch_size * dp)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def config_from_dict(raw: Any) -> TrainConfig:
    """Build a TrainConfig from a nested dict; unknown sections or keys are errors naming them."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"config: expected a mapping of sections, got {type(raw).__name__}")
    sections = {}
    for name, value in raw.items():
        if name not in _SECTIONS:
            raise ValueError(f"{name}: unknown section; expected one of {sorted(_SECTIONS)}")
        cls = _SECTIONS[name]
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ValueError(f"{name}: expected a mapping of keys, got {value!r}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in value:
            if key not in known:
                raise ValueError(f"{name}.{key}: unknown key; expected one of {known}")
        sections[name] = cls(**value)
    return TrainConfig(**sections)


def load_config(path: str, overrides: Optional[list] = None) -> TrainConfig:
    """Read a YAML config; ``overrides`` are "section.key=value" strings (value parsed as YAML)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"{path}: expected a readable YAML file, got {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: expected UTF-8 YAML text, got byte {e.object[e.start]:#04x} "
            f"at offset {e.start}"
        ) from e
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: expected YAML, got {_yaml_problem(e)}") from e
    if raw is None:
        raw = {}
    for item in overrides or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ValueError(f"--set: expected section.key=value, got {item!r}")
        dotted, value = item.split("=", 1)
        section, key = dotted.split(".", 1)
        if not isinstance(raw, dict):
            break  # config_from_dict reports the malformed file
        raw.setdefault(section, {})
        if isinstance(raw[section], dict):
            try:
                raw[section][key] = yaml.safe_load(value)
            except yaml.YAMLError as e:
                raise ValueError(
                    f"--set {dotted}: expected a YAML value, got {value!r} " f"({_yaml_problem(e)})"
                ) from e
    return config_from_dict(raw)


def _yaml_problem(e: "yaml.YAMLError") -> str:
    """The parser's complaint on one line, with its place: "mapping values are not allowed here
    (line 3, column 9)"; PyYAML's own message spans several lines and quotes the source."""
    problem = getattr(e, "problem", None) or str(e)
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return " ".join(f"{problem}{where}".split())
