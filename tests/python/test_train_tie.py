"""model.tie_embeddings (C15 — shared across stages): the demo GPT's head weight IS its token
embedding, every other initial weight as in the untied model, and the pipeline blocks carry the tie
between the first and the last stage for fp8dp.pipeline to find (the training comparison under PP 2
x DP 2 is tests/distributed/test_train_demo_pp.py).

Evidence (tried, then reverted): the tie line in GPT.__init__ removed, the last two tests fail
("assert head.weight is tok.weight"; find_shared finds nothing)."""

from pathlib import Path

import torch

from fp8dp.pipeline import split_blocks
from fp8dp.pipeline_shared import find_shared
from fp8dp.train.config import load_config
from fp8dp.train.model import GPT
from fp8dp.train.pipeline_run import pipeline_blocks

REPO = Path(__file__).resolve().parents[2]


def _gpt(tie: bool) -> GPT:
    cfg = load_config(
        str(REPO / "configs" / "demo.yaml"),
        ["model.n_layer=2", "model.d_model=32", "model.n_head=2", f"model.tie_embeddings={tie}"],
    )
    torch.manual_seed(0)
    return GPT(cfg.model, delay_wgrad_compute=True, fuse_wgrad_accumulation=True, device="cpu")


def test_tie_embeddings_default_off_and_shipped_config_on():
    assert load_config(str(REPO / "configs" / "demo.yaml")).model.tie_embeddings is False
    cfg = load_config(str(REPO / "configs" / "demo_pp_tied.yaml"))
    assert cfg.model.tie_embeddings and cfg.parallel.pipeline_parallel_size == 2
    assert cfg.check_world_size(4) == 4


def test_tied_gpt_shares_one_parameter_and_keeps_the_other_weights():
    tied, untied = _gpt(True), _gpt(False)
    assert tied.head.weight is tied.tok.weight
    assert untied.head.weight is not untied.tok.weight
    names = dict(untied.named_parameters())
    for n, p in tied.named_parameters():  # (head.weight is deduplicated away: tok.weight's)
        assert torch.equal(p, names[n]), n
    assert len(list(tied.parameters())) == len(list(untied.parameters())) - 1


def test_pipeline_blocks_carry_the_tie_between_first_and_last_stage():
    blocks = pipeline_blocks(_gpt(True))  # embedding, 2 blocks, head
    shared = find_shared(blocks, split_blocks(len(blocks), 4))
    assert [t.copies for t in shared] == [[(0, "blocks.0.tok.weight"), (3, "blocks.3.weight")]]
    assert find_shared(pipeline_blocks(_gpt(False)), split_blocks(len(blocks), 4)) == []
