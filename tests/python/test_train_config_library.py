"""The demo's ddp and fp8 sections build the library's own config objects
(fp8dp.DistributedDataParallelConfig, fp8dp.DelayedScaling / Float8CurrentScaling): one default per
setting, the library's, and the library's checks, with errors that name the key as the YAML writes
it. Exact comparisons (the values are bools, ints, strings and None).

Mutations tried (2026-12-03, then restored):
- DDPSection.check_for_nan_in_grad's default back to a literal True (the demo's old default):
  test_ddp_defaults_are_the_librarys fails ("check_for_nan_in_grad: demo default True, library
  False"); the default-change test does not see this one (its patched default is that same True).
- FP8Section.amax_history_len's default back to a literal 16: test_fp8_defaults_are_the_recipes
  fails ("amax_history_len: demo default 16, DelayedScaling 1024") and the default-change test
  fails for it (7 patched, 16 seen).
- DDPSection.library_config() leaving out grad_reduce_wire: test_every_key_reaches_the_library
  fails (the library config's wire 'buffer', the section's 'bf16'), and so does the wire's error
  test (nothing checks the value any more).
- _library_error without the section prefix: all 7 cases of test_library_errors_name_the_key fail
  (e.g. "bucket_size: expected > 0 elements, got 0" does not match "^ddp.bucket_size: ...").
"""

import dataclasses
import importlib
import sys

import pytest

import fp8dp
import fp8dp.train
from fp8dp.train.config import DDPSection, FP8Section, config_from_dict

# The demo's keys that are not the library's: an option of the demo's modules, and the one DDP
# field whose default the demo must differ on (it refuses False: its loop steps
# fp8dp.DistributedOptimizer).
DEMO_ONLY = {"fuse_wgrad_accumulation"}
DEMO_REQUIRES = {"use_distributed_optimizer": True}
FP8_DEMO_ONLY = {"enabled", "recipe", "exclude"}
FP8_AS_TEXT = {"format": "fp8_format"}  # the YAML's text for the recipe field's enum
RECIPE_CLASSES = {
    "delayed": fp8dp.DelayedScaling,
    "current": fp8dp.Float8CurrentScaling,
    "block": fp8dp.Float8BlockScaling,
}


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def test_ddp_defaults_are_the_librarys():
    lib = _defaults(fp8dp.DistributedDataParallelConfig)
    demo = _defaults(DDPSection)
    for key, value in demo.items():
        if key in DEMO_ONLY:
            continue
        assert key in lib, f"ddp.{key}: not a DistributedDataParallelConfig field"
        want = DEMO_REQUIRES.get(key, lib[key])
        # `is`: the demo's default is the library's object, not an equal copy of it
        assert value is want, f"{key}: demo default {value!r}, library {lib[key]!r}"
    want = fp8dp.DistributedDataParallelConfig(**DEMO_REQUIRES)
    assert DDPSection().library_config() == want


def test_fp8_defaults_are_the_recipes():
    lib = _defaults(fp8dp.DelayedScaling)
    for key, value in _defaults(FP8Section).items():
        if key in FP8_AS_TEXT:
            # null in the section, resolved per recipe when a config is made (each recipe's own)
            assert value is None, f"{key}: demo default {value!r}"
            for recipe, cls in RECIPE_CLASSES.items():
                want = _defaults(cls)[FP8_AS_TEXT[key]].value
                assert getattr(FP8Section(recipe=recipe), key) == want, (recipe, key)
        elif key not in FP8_DEMO_ONLY:
            assert value is lib[key], f"{key}: demo default {value!r}, DelayedScaling {lib[key]!r}"
    assert FP8Section().recipe_object() == fp8dp.DelayedScaling()
    assert FP8Section(recipe="current").recipe_object() == fp8dp.Float8CurrentScaling()
    assert FP8Section(recipe="block").recipe_object() == fp8dp.Float8BlockScaling()


@pytest.mark.parametrize(
    "cls, section, key, changed",
    [
        (fp8dp.DistributedDataParallelConfig, "ddp", "check_for_nan_in_grad", True),
        (fp8dp.DistributedDataParallelConfig, "ddp", "overlap_grad_reduce", True),
        (fp8dp.DistributedDataParallelConfig, "ddp", "bucket_size", 1234),
        (fp8dp.DelayedScaling, "fp8", "amax_history_len", 7),
        (fp8dp.DelayedScaling, "fp8", "split_accumulator_fprop", True),
    ],
)
def test_a_library_default_change_shows_up_in_the_demo(monkeypatch, cls, section, key, changed):
    """Change the library's default (its dataclass field) and import the demo's config afresh:
    a config that does not set the key gets the new default."""
    field = next(f for f in dataclasses.fields(cls) if f.name == key)
    assert field.default != changed
    monkeypatch.setattr(field, "default", changed)
    # a fresh fp8dp.train.config, undone afterwards (the module and the package's attribute)
    monkeypatch.delitem(sys.modules, "fp8dp.train.config")
    monkeypatch.setattr(fp8dp.train, "config", fp8dp.train.config)
    fresh = importlib.import_module("fp8dp.train.config")
    assert fresh.DDPSection is not DDPSection  # really re-imported
    cfg = fresh.config_from_dict({})
    assert getattr(getattr(cfg, section), key) == changed


@pytest.mark.parametrize(
    "values",
    [
        dict(
            overlap_grad_reduce=True,
            grad_reduce_in_fp32=True,
            bucket_size=123,
            delay_wgrad_compute=True,
            average_in_collective=True,
            check_for_nan_in_grad=True,
            grad_reduce_wire="bf16",
        ),
        dict(grad_reduce_in_fp32=False, bucket_size=7, check_for_nan_in_grad=False),
    ],
)
def test_every_key_reaches_the_library(values):
    lib = config_from_dict({"ddp": values}).ddp.library_config()
    for key, value in values.items():
        assert getattr(lib, key) == value, f"ddp.{key}: {getattr(lib, key)!r}, set {value!r}"


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        (
            "ddp",
            "overlap_grad_reduce",
            "yes",
            r"^ddp\.overlap_grad_reduce: expected a bool, got 'yes'",
        ),
        ("ddp", "bucket_size", 0, r"^ddp\.bucket_size: expected > 0 elements, got 0"),
        ("ddp", "grad_reduce_wire", "fp4", r"^ddp\.grad_reduce_wire: expected one of .*got 'fp4'"),
        ("fp8", "amax_history_len", 0, r"^fp8\.amax_history_len: expected an integer >= 1, got 0"),
        ("fp8", "amax_compute_algo", "mean", r"^fp8\.amax_compute_algo: expected one of"),
        ("fp8", "margin", 15, r"^fp8\.margin: expected a finite number >= 0 and <= 14\.807"),
        ("fp8", "margin", "3e-3x", r"^fp8\.margin: expected a finite number"),
    ],
)
def test_library_errors_name_the_key(section, key, value, message):
    with pytest.raises(ValueError, match=message):
        config_from_dict({section: {key: value}})


def test_yaml_number_strings_still_read_as_numbers():
    # YAML 1.1 reads "1e-1" as a string; the demo takes it as the number before the recipe checks.
    assert config_from_dict({"fp8": {"margin": "1e-1"}}).fp8.recipe_object().margin == 0.1
