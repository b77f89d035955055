"""The FP8 scaling state in one process: empty casts (C9), inference mode, malformed extra state,
update_fp8_scales twice in one step, and the identities that order the registry (C9 — one FP8
registry; the cross-rank half is in test_fp8_registry_dist.py). Every test that casts runs on each
device (conftest.py `device`).

Evidence that these tests catch the defects (run on 2026-12-01, then restored) is in each test's
docstring.
"""

import gc
import io

import pytest
import torch
from _linear_cases import IN, KINDS, OUT, make_module, randomize_

import fp8dp

RECIPE = fp8dp.DelayedScaling(amax_history_len=4)


def twins(kind, device, seed=3):
    a = make_module(kind, device=device)
    randomize_(a, seed)
    b = make_module(kind, device=device)
    b.load_state_dict(a.state_dict())
    return a, b


def data(tokens, seed, device, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, IN, generator=g) * scale).to(device)
    dy = torch.randn(tokens, OUT, generator=g).to(device)
    return x, dy


def train(m, x, dy, first=None):
    with fp8dp.fp8_autocast(fp8_recipe=RECIPE):
        y = m(x.clone().requires_grad_(True), is_first_microbatch=first)
    y.backward(dy)
    return y


def state(m):
    s = m.get_extra_state()
    if s is None:
        return None
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}


def assert_same_state(a, b):
    sa, sb = state(a), state(b)
    assert (sa is None) == (sb is None)
    if sa is not None:
        for k in sa:
            if torch.is_tensor(sa[k]):
                assert torch.equal(sa[k], sb[k]), f"{k}: {sa[k].tolist()} != {sb[k].tolist()}"
            else:
                assert sa[k] == sb[k], k


@pytest.fixture(autouse=True)
def _clean_registry(fp8_states_released):
    # An earlier test's amaxes left in the registry would make the first update of a test roll
    # states it does not expect; clear the flag with one update of whatever is left.
    fp8dp.update_fp8_scales()
    yield


# ---- item 8: an empty cast is not an amax observation ------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_empty_first_microbatch_is_no_observation(kind, device):
    """A 0-token micro-batch first, then a real one, in the same step: the scales, histories and
    outputs are exactly those of a twin that never saw the empty micro-batch, this step and the
    next (the empty input and grad_output casts neither fix a first scale nor record an amax; the
    weight, which is not empty, is cast as in any micro-batch).

    Mutation tried: `&& device_like.numel() > 0` removed from ScalingState::prepare_scale (the
    empty cast takes the first scale, from amax 0: scale 1, as before the fix). All 3 (CPU) fail
    at the first comparison, `assert torch.equal(ya, yb)`: the real micro-batch was cast at scale
    1 (e.g. 2.3955 vs 2.5629 in the first output element).
    (The same guard in ScalingState::amax_slot (then record_amax) is checked by the C++ test
    Fp8Registry.EmptyCastIsNoObservation: removed, `registry_signature().observed` turns true.)"""
    a, b = twins(kind, device)
    x, dy = data(32, 11, device)
    empty_x, empty_dy = data(0, 12, device)
    train(a, empty_x, empty_dy)
    row0 = a._core.amax_history[0]
    assert row0[0] == 0 and row0[2] == 0 and row0[1] == a.weight.detach().abs().max()
    ya = train(a, x, dy)
    yb = train(b, x, dy)
    assert torch.equal(ya, yb)
    assert_same_state(a, b)
    fp8dp.update_fp8_scales()
    assert_same_state(a, b)
    x2, dy2 = data(32, 13, device, scale=3.0)
    assert torch.equal(train(a, x2, dy2), train(b, x2, dy2))
    fp8dp.update_fp8_scales()
    assert_same_state(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_empty_microbatch_alone_leaves_first_scale_to_the_next(kind, device):
    """A step whose only micro-batch is empty: after update_fp8_scales the input and grad_output
    roles have no scale yet, so the next step starts with their own amaxes, exactly as a fresh
    twin does (same outputs, same scales).

    Mutation tried: as in test_empty_first_microbatch_is_no_observation (prepare_scale's empty
    guard removed): all 3 (CPU) fail at the output comparison, the next step cast at scale 1."""
    a, b = twins(kind, device)
    train(a, *data(0, 12, device))
    fp8dp.update_fp8_scales()
    x, dy = data(32, 14, device, scale=5.0)
    assert torch.equal(train(a, x, dy), train(b, x, dy))
    assert torch.equal(
        a._core.scale, b._core.scale
    ), f"scales {a._core.scale.tolist()} != {b._core.scale.tolist()}"


# ---- item 6: inference never poisons training state -------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_first_fp8_forward_in_inference_mode_leaves_module_trainable(kind, device):
    """The very first FP8 forward inside torch.inference_mode(): it casts with its own amaxes (the
    same output as a twin's first forward), allocates and records nothing, and training
    afterwards is bit-for-bit that of a twin that never ran inference.

    Mutations tried:
    - every inference rule removed (prepare_scale's inference branch, the inference test of
      amax_slot, then named record_amax, LinearCore::weight_fp8's inference return,
      NormalTensorMode made empty), as before the fix: all 3 (CPU) fail at "AssertionError:
      inference allocated or recorded FP8 state" (input amax recorded, first scales set); past that assert, the first training forward
      raises "RuntimeError: Inplace update to inference tensor outside InferenceMode is not
      allowed" (checked by hand), the issue's defect;
    - only prepare_scale's inference branch removed: the same assert fails (state allocated as
      normal tensors, first scales set, no amax recorded);
    - only amax_slot's (then record_amax's) inference test removed: "IndexError: select(): index 0
      out of range" (it records into a state that inference did not allocate)."""
    a, b = twins(kind, device)
    x0, _ = data(32, 21, device, scale=7.0)
    with torch.inference_mode(), fp8dp.fp8_autocast(fp8_recipe=RECIPE):
        y_inf = a(x0)
    assert a.get_extra_state() is None, "inference allocated or recorded FP8 state"
    with torch.no_grad(), fp8dp.fp8_autocast(fp8_recipe=RECIPE):
        y_first = b(x0)  # b's first cast: its own amaxes, as inference used them
    assert torch.equal(y_inf, y_first)
    b.load_state_dict({k: v for k, v in a.state_dict().items()})  # forget b's first cast too
    for step in range(2):
        x, dy = data(32, 30 + step, device, scale=step + 1.0)
        ya, yb = train(a, x, dy), train(b, x, dy)
        assert torch.equal(ya, yb)
        assert torch.equal(a.weight.grad, b.weight.grad)
        fp8dp.update_fp8_scales()
    assert_same_state(a, b)
    for t in (a._core.amax_history, a._core.scale, a._core.scale_inv):
        assert not t.is_inference()


@pytest.mark.parametrize("kind", KINDS)
def test_inference_after_training_uses_training_scales_and_changes_nothing(kind, device):
    """After a training step, an inference forward (a different amax, and is_first_microbatch=None
    which would refresh the weight cache) uses training's scales, records no amax and keeps the
    cached FP8 weight: the next micro-batch that reuses the cache (is_first_microbatch=False)
    trains exactly as in a twin without the inference forward.

    Mutation tried: `if (numel == 0 || c10::InferenceMode::is_enabled()) return;` in
    ScalingState::amax_slot (then record_amax) without the inference test: all 3 (CPU) fail with
        AssertionError: amax_history: [[31.016..., 1.923..., 3.215...], ...] != [[3.805..., ...
    (inference recorded its 10x input amax into training's step).
    (The inference early return in LinearCore::weight_fp8 removed is not caught here: the
    refilled cache holds the same bytes, cast with training's scale; see
    test_inference_does_not_fill_the_weight_cache.)"""
    a, b = twins(kind, device)
    x, dy = data(32, 41, device)
    train(a, x, dy, first=True)
    train(b, x, dy, first=True)
    x_inf, _ = data(32, 42, device, scale=10.0)
    with torch.inference_mode(), fp8dp.fp8_autocast(fp8_recipe=RECIPE):
        y_inf = a(x_inf, is_first_microbatch=None)
    assert not y_inf.requires_grad
    assert_same_state(a, b)
    with torch.no_grad(), fp8dp.fp8_autocast(fp8_recipe=RECIPE):
        assert torch.equal(y_inf, b(x_inf, is_first_microbatch=False))  # b: same scales
    b.load_state_dict(a.state_dict())  # undo b's amax of x_inf
    x2, dy2 = data(32, 43, device)
    a.weight.grad = b.weight.grad = None
    assert torch.equal(train(a, x2, dy2, first=False), train(b, x2, dy2, first=False))
    assert torch.equal(a.weight.grad, b.weight.grad)
    assert_same_state(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_inference_does_not_fill_the_weight_cache(kind, device):
    """An inference forward before any training, with its own recipe (margin 12: the weight is
    cast at 448 / amax / 2^12, which puts most of it among E4M3's subnormals; a power-of-two
    margin alone would change no mantissa), must not leave its FP8 weight in the cache: a first
    training micro-batch with is_first_microbatch=False casts the weight itself, as a twin
    without the inference does.

    Mutation tried: the inference early return in LinearCore::weight_fp8 removed (the cache is
    filled in inference mode): all 3 (CPU) fail with
        AssertionError: the training micro-batch reused the weight that inference cast
    (with margin=2 instead of 12 the mutation went unnoticed: same mantissas)."""
    a, b = twins(kind, device)
    x0, _ = data(32, 44, device)
    with (
        torch.inference_mode(),
        fp8dp.fp8_autocast(fp8_recipe=fp8dp.DelayedScaling(amax_history_len=4, margin=12)),
    ):
        a(x0)
    x, dy = data(32, 45, device)
    assert torch.equal(
        train(a, x, dy, first=False), train(b, x, dy, first=False)
    ), "the training micro-batch reused the weight that inference cast"
    assert torch.equal(a.weight.grad, b.weight.grad)


def test_load_state_dict_in_inference_mode_then_train(device):
    """State restored inside torch.inference_mode() is still training state: normal tensors.

    Mutation tried: NormalTensorMode removed from ScalingState::restore: fails (CPU) at the
    training forward after the load with
        RuntimeError: Inplace update to inference tensor outside InferenceMode is not allowed."""
    src = fp8dp.Linear(IN, OUT, device=device)
    train(src, *data(32, 51, device))
    fp8dp.update_fp8_scales()
    m = fp8dp.Linear(IN, OUT, device=device)
    with torch.inference_mode():
        m.load_state_dict(src.state_dict())
    train(m, *data(32, 52, device))
    fp8dp.update_fp8_scales()
    assert not m._core.amax_history.is_inference()


# ---- item 9: malformed extra state -------------------------------------------------------------
def _malformed_cases():
    nan, inf = float("nan"), float("inf")

    def setk(k, v):
        def f(s):
            s[k] = v
            return s

        return f

    def delk(k):
        def f(s):
            del s[k]
            return s

        return f

    def scale(v):
        return setk("scale", torch.tensor([v, 1.0, 1.0]))

    expected_keys = (
        "amax_history, scale, scale_inv, fp8_max, initialized, amax_compute_algo, margin"
    )
    k = "fc._extra_state: "
    finite = "must hold finite values > 0, got"
    return [
        (
            "not_a_dict",
            lambda s: [1, 2],
            f"{k}expected None or a dict with keys {expected_keys}, got list",
        ),
        ("missing_key", delk("scale"), f"{k}missing key 'scale' (expected keys: {expected_keys})"),
        ("unknown_key", setk("bogus", 1), f"{k}unexpected key 'bogus'"),
        (
            "scale_not_tensor",
            setk("scale", [1.0, 1.0, 1.0]),
            f"{k}'scale' must be a tensor, got list",
        ),
        ("scale_nan", scale(nan), f"{k}'scale' {finite} [nan, 1, 1]"),
        ("scale_negative", scale(-2.0), f"{k}'scale' {finite} [-2, 1, 1]"),
        ("scale_zero", scale(0.0), f"{k}'scale' {finite} [0, 1, 1]"),
        ("scale_inf", scale(inf), f"{k}'scale' {finite} [inf, 1, 1]"),
        (
            "scale_inv_nan",
            setk("scale_inv", torch.tensor([1.0, nan, 1.0])),
            f"{k}'scale_inv' {finite} [1, nan, 1]",
        ),
        (
            "scale_short",
            setk("scale", torch.ones(2)),
            f"{k}'scale' must have 3 elements (input, weight, grad_output), got [2]",
        ),
        (
            "fp8_max_wrong",
            setk("fp8_max", torch.tensor([448.0, 448.0, 100.0])),
            f"{k}'fp8_max' must be the format maxima [f, f, g] of input, weight and grad_output, "
            "each 448 (E4M3) or 57344 (E5M2), got [448, 448, 100]",
        ),
        (
            "history_negative",
            setk("amax_history", torch.tensor([[1.0, 2.0, 3.0], [0.0, -4.0, 0.0]])),
            f"{k}'amax_history' must hold amaxes >= 0 (NaN and Inf allowed), got -4 at row 1",
        ),
        (
            "history_shape",
            setk("amax_history", torch.ones(4)),
            f"{k}'amax_history' must be [L, 3] with L >= 1, got [4]",
        ),
        (
            "history_int",
            setk("amax_history", torch.ones(2, 3, dtype=torch.int32)),
            f"{k}'amax_history' must be a floating-point tensor, got Int",
        ),
        (
            "algo_str",
            setk("amax_compute_algo", "max"),
            f"{k}'amax_compute_algo' must be an int, got str",
        ),
        ("margin_none", setk("margin", None), f"{k}'margin' must be a number, got NoneType"),
    ]


@pytest.mark.parametrize(
    "case,mutate,message", _malformed_cases(), ids=[c[0] for c in _malformed_cases()]
)
def test_malformed_extra_state_is_a_value_error_naming_the_key(case, mutate, message):
    """Each malformed `_extra_state` is a ValueError naming the state-dict key, the key inside it,
    what was expected and what came; the module keeps its state.

    Mutation tried: set_extra_state of bind_modules.cpp as before the fix (d["scale"] read with
    no checks) and ScalingState::restore without the new value checks: 13 of 16 fail —
    missing_key with a bare `KeyError: 'scale'`, not_a_dict with `TypeError: cannot convert
    dictionary update sequence element #0 to a sequence`, scale_not_tensor / algo_str /
    margin_none with `RuntimeError: Unable to cast Python instance of type <class 'list'> to C++
    type '?'`, and unknown_key, scale_nan, scale_negative, scale_zero, scale_inf, scale_inv_nan,
    fp8_max_wrong, history_negative load without error (`Failed: DID NOT RAISE`). scale_short,
    history_shape and history_int pass (restore checked those before)."""
    model = torch.nn.ModuleDict({"fc": fp8dp.Linear(IN, OUT)})
    train(model["fc"], *data(32, 61, "cpu"))
    fp8dp.update_fp8_scales()
    sd = model.state_dict()
    before = state(model["fc"])
    sd["fc._extra_state"] = mutate(dict(sd["fc._extra_state"]))
    with pytest.raises(ValueError) as err:
        model.load_state_dict(sd)
    assert message in str(err.value), str(err.value)
    after = state(model["fc"])
    for k in before:
        assert (
            torch.equal(before[k], after[k])
            if torch.is_tensor(before[k])
            else before[k] == after[k]
        ), k


def test_extra_state_round_trip_through_bytes_keeps_initialized():
    """A state whose scale an update set (not a cast of this process) saves initialized=True, so
    a resumed module does not take a first scale of its own again."""
    m = fp8dp.Linear(IN, OUT)
    train(m, *data(32, 71, "cpu"))
    fp8dp.update_fp8_scales()
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    assert sd["_extra_state"]["initialized"].tolist() == [True, True, True]


# ---- item 10: update_fp8_scales twice in one step ----------------------------------------------
def test_update_twice_in_one_step_rolls_once(device):
    """A second update_fp8_scales() with no FP8 cast since the first is a no-op: the histories
    rolled once and the scales are those of the first update.

    Mutation tried: the `if not observed: return` of update_fp8_scales removed (the
    registry_update runs again): fails with
        AssertionError: the second update rolled the history again"""
    m = fp8dp.Linear(IN, OUT, device=device)
    train(m, *data(32, 81, device))
    fp8dp.update_fp8_scales()
    hist, scale = m._core.amax_history.clone(), m._core.scale.clone()
    assert hist[1].gt(0).all()
    fp8dp.update_fp8_scales()
    assert torch.equal(m._core.amax_history, hist), "the second update rolled the history again"
    assert torch.equal(m._core.scale, scale)
    train(m, *data(32, 82, device))  # the next step's update rolls again
    fp8dp.update_fp8_scales()
    assert torch.equal(m._core.amax_history[2], hist[1])


# ---- C9: identities ----------------------------------------------------------------------------
def _ours(descriptions, names):
    return [d for d in descriptions if d.split(":")[0] in names]


def test_identities_order_the_registry_and_the_signature():
    """set_fp8_identities names each fp8dp module after its path; the registry orders by that
    name (not by creation or first cast), and its signature changes with a name, a recipe or the
    set of states, and only then."""
    zeta = fp8dp.Linear(IN, OUT)  # created first, cast first
    alpha = fp8dp.LayerNormLinear(IN, OUT)
    assert zeta._core.fp8_identity.startswith("unnamed #")
    assert zeta._core.fp8_identity.endswith(" Linear(in_features=32, out_features=48)")
    model = torch.nn.ModuleDict({"zeta": zeta, "inner": torch.nn.ModuleDict({"alpha": alpha})})
    fp8dp.scaling.set_fp8_identities(model)
    assert zeta._core.fp8_identity == "zeta: Linear(in_features=32, out_features=48)"
    assert (
        alpha._core.fp8_identity == "inner.alpha: LayerNormLinear(in_features=32, out_features=48)"
    )
    x, dy = data(32, 91, "cpu")
    train(zeta, x, dy)
    h0 = fp8dp._C.fp8_registry_signature()[0]
    train(alpha, x, dy)
    h1, observed, size, recipes_hash = fp8dp._C.fp8_registry_signature()
    assert h1 != h0 and observed and size >= 2 and recipes_hash == -1  # delayed: no note
    names = {"zeta", "inner.alpha"}
    assert _ours(fp8dp._C.fp8_registry_descriptions(), names) == [
        "inner.alpha: LayerNormLinear(in_features=32, out_features=48) "
        "[E4M3/E5M2 history=4 max margin=0]",
        "zeta: Linear(in_features=32, out_features=48) [E4M3/E5M2 history=4 max margin=0]",
    ]
    train(zeta, x, dy)
    assert fp8dp._C.fp8_registry_signature()[0] == h1, "nothing changed: same signature"
    with fp8dp.fp8_autocast(fp8_recipe=fp8dp.DelayedScaling(amax_history_len=4, margin=1)):
        zeta(x)
    h2 = fp8dp._C.fp8_registry_signature()[0]
    assert h2 != h1, "another recipe: another signature"
    zeta._core.fp8_identity = "renamed: Linear"
    assert fp8dp._C.fp8_registry_signature()[0] != h2
    root = fp8dp.Linear(IN, OUT)
    fp8dp.scaling.set_fp8_identities(root)
    assert root._core.fp8_identity == "(root): Linear(in_features=32, out_features=48)"
    with pytest.raises(ValueError, match="module: expected a torch.nn.Module, got int"):
        fp8dp.scaling.set_fp8_identities(3)


# ---- the update of one process: no gather ------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_local_update_equals_the_gathered_one(kind, device, monkeypatch):
    """Without ranks to reduce across, update_fp8_scales() updates every state from its own row 0
    (registry_update_local) instead of gathering the amaxes into one tensor and writing them back.
    Both must leave the same histories, scales and first-scale flags, from the first step (no
    scale yet) on, with amaxes that grow and shrink."""
    ends = {}
    for path in ("local", "gathered"):
        m = make_module(kind, device=device)  # a fresh module: no FP8 state, no scale yet
        randomize_(m, 5)
        for step, scale in enumerate((1.0, 8.0, 0.25, 2.0)):
            train(m, *data(32, 90 + step, device, scale=scale))
            _update(path, monkeypatch)
        ends[path + "_state"] = state(m)
        del m
        gc.collect()  # its state leaves the registry before the other path's module casts
    sa, sb = ends["local_state"], ends["gathered_state"]
    assert sa is not None and sa.keys() == sb.keys()
    for k in sa:
        if torch.is_tensor(sa[k]):
            assert torch.equal(sa[k], sb[k]), f"{k}: {sa[k].tolist()} != {sb[k].tolist()}"
        else:
            assert sa[k] == sb[k], k


@pytest.mark.parametrize("path", ["local", "gathered"])
def test_update_marks_checkpointed_amaxes_seen(path, device, monkeypatch):
    """A checkpoint taken mid-step brings row-0 amaxes for roles without a scale of their own
    (`initialized` False). The update that follows must count them as observed, so the roles
    start from the history's scale instead of computing a first one at their next cast: for the
    local update too, which reads row 0 in place and must do so before it rolls.

    Mutation tried: registry_update_local's note_reduced moved after the batched update (row 0 is
    then already rolled to zero): the local case fails with `initialized` [False, False, False]."""
    src = fp8dp.Linear(IN, OUT, device=device)
    train(src, *data(32, 95, device))
    ckpt = src.get_extra_state()
    del src
    gc.collect()
    ckpt["initialized"] = torch.zeros(3, dtype=torch.bool)
    m = fp8dp.Linear(IN, OUT, device=device)
    m.set_extra_state(ckpt)
    _update(path, monkeypatch)
    after = m.get_extra_state()
    assert after["initialized"].tolist() == [True, True, True]
    expected = ckpt["fp8_max"] / ckpt["amax_history"][0]
    assert torch.equal(after["scale"], expected.to(after["scale"].dtype))


def _update(path, monkeypatch):
    """One update of every state: update_fp8_scales() in this process ("local"; gathering the
    amaxes fails the test), or the gather-and-write-back that a reduction across ranks uses."""
    if path == "gathered":
        fp8dp._C.fp8_registry_update(fp8dp._C.fp8_registry_amaxes())
        return
    with monkeypatch.context() as mp:
        mp.setattr(fp8dp._C, "fp8_registry_amaxes", _no_gather)
        fp8dp.update_fp8_scales()


def _no_gather():
    raise AssertionError("update_fp8_scales gathered the amaxes with nothing to reduce")
