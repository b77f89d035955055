"""The demo's config: YAML -> validated dataclasses; every bad value fails at start with a message
that names the key as written in the YAML."""

from pathlib import Path

import pytest
import yaml

from fp8dp.train.config import config_from_dict, load_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["demo.yaml", "gpu.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(str(REPO / "configs" / name))
    for world in (1, 2, 4, 8):  # `make demo` runs them on 2 CPU ranks or on every GPU
        assert cfg.check_world_size(world) >= 1


def _demo():
    return yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("model", "n_layers", 2, r"model.n_layers: unknown key; expected one of \['n_layer'"),
        ("model", "d_model", 72, "model.d_model: expected a multiple of 16 .*got 72"),
        ("model", "n_head", 5, "model.n_head: expected a divisor of model.d_model=128, got 5"),
        ("model", "d_model", 0, "model.d_model: expected an integer >= 1, got 0"),
        ("model", "normalization", "BatchNorm", "model.normalization: expected one of"),
        ("model", "params_dtype", "float16", "model.params_dtype: expected one of"),
        ("model", "bias", "yes", "model.bias: expected true or false, got 'yes'"),
        (
            "train",
            "micro_batch_size",
            3,
            "train.global_batch_size: expected a multiple of " "train.micro_batch_size=3, got 16",
        ),
        ("train", "lr", -1.0, "train.lr: expected a finite number > 0"),
        ("train", "steps", 2.5, "train.steps: expected an integer >= 1, got 2.5"),
        ("fp8", "recipe", "mxfp8", "fp8.recipe: expected one of"),
        ("fp8", "format", "E5M2", "fp8.format: expected one of \\['HYBRID', 'E4M3'\\], got 'E5M2'"),
        ("fp8", "exclude", ["head", "mlp"], "fp8.exclude: expected a list of"),
        ("fp8", "exclude", "head", "fp8.exclude: expected a list of"),
        (
            "fp8",
            "split_accumulator_wgrad",
            "no",
            "fp8.split_accumulator_wgrad: expected True or False, got 'no'",
        ),
        (
            "fp8",
            "override_linear_precision",
            ["yes", False, False],
            "fp8.override_linear_precision: expected a tuple of three bools",
        ),
        ("ddp", "bucket_size", 0, "ddp.bucket_size: expected > 0 elements, got 0"),
        (
            "ddp",
            "use_distributed_optimizer",
            False,
            "ddp.use_distributed_optimizer: the demo trains",
        ),
        (
            "data",
            "val_fraction",
            0.9,
            "data.val_fraction: expected a finite number > 0.0 and <= 0.5",
        ),
    ],
)
def test_bad_values_name_the_key(section, key, value, message):
    raw = _demo()
    raw[section][key] = value
    with pytest.raises(ValueError, match=message):
        config_from_dict(raw)


def test_unknown_section():
    raw = _demo()
    raw["optimizer"] = {"lr": 1}
    with pytest.raises(ValueError, match=r"optimizer: unknown section"):
        config_from_dict(raw)


def test_tokens_per_gemm_must_be_multiple_of_16():
    raw = _demo()
    raw["model"]["seq_len"] = 63
    raw["train"]["micro_batch_size"] = 2
    with pytest.raises(ValueError, match=r"train.micro_batch_size: .* 2 \* 63 = 126"):
        config_from_dict(raw)


@pytest.mark.parametrize("world, ok", [(1, True), (2, True), (8, True), (3, False), (16, False)])
def test_world_size_must_divide_the_batch(world, ok):
    cfg = config_from_dict(_demo())  # global batch 16, micro-batch 2
    if ok:
        assert cfg.check_world_size(world) == 16 // (2 * world)
    else:
        msg = (
            rf"train.global_batch_size: expected a multiple of "
            rf"train.micro_batch_size \* world size = 2 \* {world}"
        )
        with pytest.raises(ValueError, match=msg):
            cfg.check_world_size(world)


def test_overrides_are_checked_too(tmp_path):
    cfg = load_config(str(REPO / "configs" / "demo.yaml"), ["train.steps=7", "fp8.recipe=current"])
    assert cfg.train.steps == 7 and cfg.fp8.recipe == "current"
    with pytest.raises(ValueError, match="train.step: unknown key"):
        load_config(str(REPO / "configs" / "demo.yaml"), ["train.step=7"])
    with pytest.raises(ValueError, match="--set: expected section.key=value"):
        load_config(str(REPO / "configs" / "demo.yaml"), ["steps=7"])


def test_configuration_reference_documents_every_key():
    """docs/configuration.md (the README links it) names every config key."""
    import dataclasses

    from fp8dp.train.config import _SECTIONS

    reference = (REPO / "docs" / "configuration.md").read_text()
    missing = [
        f"{s}.{f.name}"
        for s, cls in _SECTIONS.items()
        for f in dataclasses.fields(cls)
        if f"`{s}.{f.name}`" not in reference
    ]
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_demo_pp_loads_as_pp2_on_four_ranks():
    cfg = load_config(str(REPO / "configs" / "demo_pp.yaml"))
    assert (cfg.parallel.pipeline_parallel_size, cfg.parallel.schedule) == (2, "zbv")
    # 16 sequences / (micro-batch 2 x DP 2) = 4 micro-batches per pipeline
    assert cfg.check_world_size(4) == 4


@pytest.mark.parametrize(
    "values, message",
    [
        ({"schedule": "gpipe"}, r"parallel.schedule: expected one of \['1f1b'.*got 'gpipe'"),
        (
            {"schedule": "zbv", "virtual_stages": 1},
            r"parallel.virtual_stages: schedule 'zbv' expected 2, got 1",
        ),
        (
            {"schedule": "1f1b", "virtual_stages": 2},
            r"parallel.virtual_stages: schedule '1f1b' expected 1, got 2",
        ),
        ({"pipeline_parallel_size": 0}, r"parallel.pipeline_parallel_size: .*>= 1, got 0"),
        (
            # 4 pipeline ranks x 2 stages = 8 stages, 3 layers + embedding + head = 5 blocks
            {"pipeline_parallel_size": 4, "schedule": "zbv", "virtual_stages": 2},
            r"model.n_layer: expected at least .* = 6 .*got 3",
        ),
    ],
)
def test_bad_parallel_values_name_the_key(values, message):
    raw = _demo()
    raw["parallel"] = values
    with pytest.raises(ValueError, match=message):
        config_from_dict(raw)


@pytest.mark.parametrize(
    "world, message",
    [
        (3, r"parallel.pipeline_parallel_size: expected a divisor of the world size 3, got 2"),
        # 16 sequences do not split into micro-batches of 2 over the 16 ranks of the DP run
        (16, r"train.global_batch_size: expected a multiple of .* 2 \* 16 = 32 \(the pipelines"),
    ],
)
def test_pipeline_world_size_errors_name_the_key(world, message):
    raw = _demo()
    raw["parallel"] = {"pipeline_parallel_size": 2}
    cfg = config_from_dict(raw)
    assert cfg.check_world_size(2) == 8  # DP 1: one pipeline runs all 16 / 2 micro-batches
    with pytest.raises(ValueError, match=message):
        cfg.check_world_size(world)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_accumulation_keys_reach_the_recipe(recipe):
    """fp8.split_accumulator_* go into the run's recipe, each to its own field (defaults: the
    recipes' own, False / True / True)."""
    from fp8dp.train.loop import make_recipe

    fields = ("split_accumulator_fprop", "split_accumulator_dgrad", "split_accumulator_wgrad")
    cfg = load_config(str(REPO / "configs" / "demo.yaml"), [f"fp8.recipe={recipe}"])
    assert tuple(getattr(make_recipe(cfg), f) for f in fields) == (False, True, True)
    sets = [
        f"fp8.recipe={recipe}",
        "fp8.split_accumulator_fprop=true",
        "fp8.split_accumulator_wgrad=false",
    ]
    cfg = load_config(str(REPO / "configs" / "demo.yaml"), sets)
    assert tuple(getattr(make_recipe(cfg), f) for f in fields) == (True, True, False)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_override_linear_precision_reaches_the_recipe(recipe):
    from fp8dp.train.loop import make_recipe

    cfg = load_config(str(REPO / "configs" / "demo.yaml"), [f"fp8.recipe={recipe}"])
    assert make_recipe(cfg).override_linear_precision == (False, False, False)
    sets = [f"fp8.recipe={recipe}", "fp8.override_linear_precision=[false,false,true]"]
    cfg = load_config(str(REPO / "configs" / "demo.yaml"), sets)
    assert make_recipe(cfg).override_linear_precision == (False, False, True)


def test_override_linear_precision_is_refused_with_block_scaling():
    sets = ["fp8.recipe=block", "fp8.override_linear_precision=[false,false,true]"]
    with pytest.raises(ValueError, match="^fp8.override_linear_precision: expected .* block"):
        load_config(str(REPO / "configs" / "demo.yaml"), sets)


@pytest.mark.parametrize(
    "recipe, default, other",
    [("delayed", "HYBRID", "E4M3"), ("current", "HYBRID", "E4M3"), ("block", "E4M3", "HYBRID")],
)
def test_format_key_reaches_the_recipe(recipe, default, other):
    """fp8.format picks the recipe's fp8_format, for every recipe; unset, the recipe's own default
    (HYBRID, E5M2 gradients; E4M3 for block scaling), written into the run's config by name.
    Until 2026-12-04 block scaling ignored the key and ran E4M3 whatever it said."""
    from fp8dp.recipe import Format
    from fp8dp.train.loop import make_recipe

    cfg = load_config(str(REPO / "configs" / "demo.yaml"), [f"fp8.recipe={recipe}"])
    assert cfg.fp8.format == default and make_recipe(cfg).fp8_format is Format[default]
    cfg = load_config(
        str(REPO / "configs" / "demo.yaml"), [f"fp8.recipe={recipe}", f"fp8.format={other}"]
    )
    assert cfg.fp8.format == other and make_recipe(cfg).fp8_format is Format[other]


def test_keys_the_recipe_does_not_read_are_named():
    """fp8.* keys set away from their defaults that the chosen recipe ignores are listed (the
    trainer prints them): configs/demo.yaml's amax_history_len 16 under current and block scaling,
    margin and split_accumulator_* under block scaling; nothing under delayed scaling or with FP8
    off."""
    demo = str(REPO / "configs" / "demo.yaml")
    assert load_config(demo).fp8.unused_keys() == []
    assert load_config(demo, ["fp8.enabled=false"]).fp8.unused_keys() == []
    assert load_config(demo, ["fp8.recipe=current"]).fp8.unused_keys() == [
        "fp8.amax_history_len=16"
    ]
    sets = ["fp8.recipe=block", "fp8.margin=1", "fp8.split_accumulator_fprop=true"]
    assert load_config(demo, sets).fp8.unused_keys() == [
        "fp8.amax_history_len=16",
        "fp8.margin=1",
        "fp8.split_accumulator_fprop=True",
    ]


def test_fp8_gap_cpu_config_loads():
    """configs/fp8_gap_cpu.yaml: the CPU reproduction of the 342M runs' FP8 lag, one rank."""
    cfg = load_config(str(REPO / "configs" / "fp8_gap_cpu.yaml"))
    assert cfg.check_world_size(1) == 1
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.train.steps) == (4, 128, 1500)
    assert cfg.fp8.recipe == "delayed" and cfg.fp8.amax_history_len == 1024
