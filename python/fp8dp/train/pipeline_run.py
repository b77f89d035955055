"""The demo under pipeline parallelism (parallel.pipeline_parallel_size > 1): the GPT split into
fp8dp.pipeline blocks, one training step, validation through the stages, and the per-rank state
that --save / --resume keep. loop.py calls it only when pipeline_parallel_size > 1, so the
data-parallel path never runs any of this.

Blocks (each maps one tensor to one tensor, as fp8dp.pipeline.Pipeline expects): the embedding
(token ids -> hidden), each transformer block, the final norm + head (hidden -> logits). They are
the very modules of the GPT that every rank builds from the same seed, so the initial weights are
those of the data-parallel run; each rank wraps only its stages' blocks. With
model.tie_embeddings the head's weight is the embedding's Parameter object in every process, so
the Pipeline finds the tie itself (the first and the last stage each train a copy, summed and
kept identical: fp8dp/pipeline_shared.py); under zbv both stages are on pipeline rank 0 and the
head's stage runs on a deep copy (its module in the checkpoint is that copy).

Token ids enter batch-first, [micro-batches x micro_batch_size, seq]: torch's schedules split the
batch along dim 0, and the GPT is sequence-first inside. The first block transposes; the loss
transposes the targets alike.

Data: a step's global batch is exactly the data-parallel run's at the same world size. That run
gives rank r (of W) the micro-batches (r, 0 .. m-1); here data-parallel rank d's pipeline runs
pp * m micro-batches, those of the data-parallel ranks d * pp .. d * pp + pp - 1 in order. So
PP 2 x DP 2 and DP 4 train on the same sequences and their losses are comparable step by step
(tests/distributed/test_train_demo_pp.py). Validation reads the same way.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fp8dp
from fp8dp.pipeline import Pipeline, make_groups, stage_ranks

from .config import TrainConfig
from .data import VOCAB_SIZE, ByteCorpus, to_device
from .model import GPT, embed


class _Embedding(torch.nn.Module):
    """Token ids [batch, seq] (batch-first, see the module docstring) -> [seq, batch, hidden]."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.tok, self.pos = gpt.tok, gpt.pos

    def forward(self, tokens):
        return embed(self.tok, self.pos, tokens.t())


class _Block(torch.nn.Module):
    """One transformer block. The stage calls it without is_first_microbatch (None: the FP8
    weight is cast again each micro-batch; with unchanged weights and scales that is the same
    FP8 weight the data-parallel loop caches)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x, None)


class _Head(torch.nn.Module):
    """The norm + head outside FP8 (fp8.exclude names it). With the head in FP8 the
    LayerNormLinear itself is the block, as in checkpoints from before the key."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, x):
        with fp8dp.fp8_autocast(enabled=False):
            return self.head(x)


def pipeline_blocks(gpt: GPT) -> list:
    """The embedding, each transformer block, then the norm + head (a LayerNormLinear already maps
    one tensor to one tensor)."""
    return [
        _Embedding(gpt),
        *(_Block(b) for b in gpt.blocks),
        _Head(gpt.head) if "head" in gpt.exclude else gpt.head,
    ]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The data-parallel loop's loss; logits [seq, batch, vocab], targets batch-first."""
    return F.cross_entropy(logits.float().view(-1, VOCAB_SIZE), targets.t().reshape(-1))


class StageModules(torch.nn.ModuleDict):
    """This rank's stage modules by global stage index ("stage0", "stage3" under zbv): what a
    checkpoint holds of the model (parameters and each fp8dp module's FP8 state)."""


class StageOptimizers:
    """One fp8dp.DistributedOptimizer per local stage (each over the stage's data-parallel group)
    behind the one-optimizer interface that loop.py and checkpoint.py use."""

    def __init__(self, optimizers: dict):
        self.optimizers = optimizers  # "stage<s>" -> DistributedOptimizer

    @property
    def param_groups(self) -> list:
        return [g for o in self.optimizers.values() for g in o.param_groups]

    def step(self) -> None:
        # Each step() updates the FP8 scales over the data-parallel group; the second call of a
        # step changes nothing (fp8dp.update_fp8_scales is idempotent within a step).
        for o in self.optimizers.values():
            o.step()

    def state_dict(self) -> dict:
        return {k: o.state_dict() for k, o in self.optimizers.items()}

    def _check_state_dict(self, sd) -> None:
        if not isinstance(sd, dict) or set(sd) != set(self.optimizers):
            got = sorted(sd) if isinstance(sd, dict) else type(sd).__name__
            raise ValueError(
                f"state_dict: expected the stages {sorted(self.optimizers)} of this pipeline "
                f"rank, got {got}"
            )
        for k, o in self.optimizers.items():
            try:
                o._check_state_dict(sd[k])
            except ValueError as e:
                raise ValueError(f"{k}: {e}") from e

    def load_state_dict(self, sd: dict) -> None:
        self._check_state_dict(sd)
        for k, o in self.optimizers.items():
            o.load_state_dict(sd[k])


class PipelineRun:
    """The pipeline of one training run: stages, optimizers, a step and validation."""

    def __init__(
        self,
        cfg: TrainConfig,
        model: GPT,
        ddp_cfg,
        n_micro: int,
        corpus: ByteCorpus,
        device,
    ):
        par, t, m = cfg.parallel, cfg.train, cfg.model
        self.cfg, self.corpus, self.device, self.n_micro = cfg, corpus, device, n_micro
        # The world group's timeout (loop.setup_distributed): a lost peer ends a step, no hang.
        self.groups = make_groups(par.pipeline_parallel_size, timeout=timedelta(minutes=5))
        g = self.groups
        dtype = getattr(torch, m.params_dtype)
        mb = t.micro_batch_size
        # Every rank built the whole (small) GPT from the seed, so the blocks hold the DP run's
        # initial weights; only this rank's stages are wrapped, trained and saved.
        blocks = pipeline_blocks(model)
        self.pp = Pipeline(
            blocks,
            g,
            schedule=par.schedule,
            n_microbatches=n_micro,
            loss_fn=loss_fn,
            microbatch_input=torch.zeros(mb, m.seq_len, dtype=torch.long),
            activation=torch.empty(m.seq_len, mb, m.d_model, dtype=dtype),
            microbatch_output=torch.empty(m.seq_len, mb, VOCAB_SIZE, dtype=dtype),
            # The targets are batch-first token ids like the input: step() checks both (on every
            # rank, before anything is sent).
            microbatch_target=torch.zeros(mb, m.seq_len, dtype=torch.long),
            virtual_stages=par.virtual_stages,
            ddp_config=ddp_cfg,
            device=device,
        )
        names = [f"stage{s}" for s in self.pp.stage_indices]
        self.modules = StageModules({n: d.module for n, d in zip(names, self.pp.modules)})
        self.optimizer = StageOptimizers(
            {
                n: fp8dp.DistributedOptimizer(
                    torch.optim.AdamW,
                    d,
                    **t.adamw_kwargs(device),
                )
                for n, d in zip(names, self.pp.modules)
            }
        )
        # Validation runs the stages in order, rank to rank (evaluate); who holds which stage.
        owners = stage_ranks(par.schedule, g.pp_size, par.virtual_stages)
        self.n_stages = g.pp_size * par.virtual_stages
        self.owner = {s: r for r, ss in enumerate(owners) for s in ss}
        self.local = dict(zip(self.pp.stage_indices, (d.module for d in self.pp.modules)))
        self.act_shape = (m.seq_len, mb, m.d_model)
        self.dtype = dtype

    def _batch(self, split: str, step: int, per_rank: int) -> tuple:
        """(ids, targets) of this data-parallel rank, batch-first: per_rank micro-batches of each
        of the data-parallel run's ranks d * pp ... d * pp + pp - 1 (module docstring)."""
        g, t = self.groups, self.cfg.train
        xs, ys = [], []
        for j in range(g.pp_size):
            r = g.dp_rank * g.pp_size + j
            for i in range(per_rank):
                x, y = self.corpus.batch(split, t.seed, step, r, i, t.micro_batch_size)
                xs.append(x.t())
                ys.append(y.t())
        return to_device(torch.cat(xs), self.device), to_device(torch.cat(ys), self.device)

    def _mean_over_pipelines(self, value: float) -> float:
        """The mean of the last stages' values over the data-parallel ranks, on every rank (the
        other ranks add 0)."""
        v = torch.tensor(
            [value if self.pp.is_last else 0.0], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(v)
        return v.item() / self.groups.dp_size

    def step(self, step: int, recipe) -> float:
        """One optimizer step; returns the mean training loss over the global batch."""
        x, y = self._batch("train", step, self.n_micro // self.groups.pp_size)
        losses = []
        with fp8dp.fp8_autocast(enabled=self.cfg.fp8.enabled, fp8_recipe=recipe):
            self.pp.step(
                *((x,) if self.pp.is_first else ()),
                target=y if self.pp.is_last else None,
                losses=losses,
            )
        self.optimizer.step()  # steps, all-gathers and updates the FP8 scales per stage
        local = (
            sum(loss.detach().item() for loss in losses) / self.n_micro if self.pp.is_last else 0.0
        )
        return self._mean_over_pipelines(local)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss: every validation micro-batch runs forward through the stages in
        stage order (activations sent rank to rank on the pipeline group), FP8 off as in
        loop.evaluate; the last stage's loss is averaged over the pipelines and returned on
        every rank."""
        n = self.cfg.train.eval_batches
        x, y = self._batch("val", 0, n)
        mb = self.cfg.train.micro_batch_size
        me, group = self.groups.pp_rank, self.groups.pp_group
        total = 0.0
        for k in range(n * self.groups.pp_size):
            h = None
            for s in range(self.n_stages):
                if self.owner[s] != me:
                    continue
                if s == 0:
                    h = x[k * mb : (k + 1) * mb]
                elif self.owner[s - 1] != me:
                    h = torch.empty(self.act_shape, dtype=self.dtype, device=self.device)
                    dist.recv(h, group=group, group_src=self.owner[s - 1])
                h = self.local[s](h)
                if s == self.n_stages - 1:
                    total += loss_fn(h, y[k * mb : (k + 1) * mb]).item()
                elif self.owner[s + 1] != me:
                    dist.send(h.contiguous(), group=group, group_dst=self.owner[s + 1])
        return self._mean_over_pipelines(total / (n * self.groups.pp_size))
