"""C9 — one FP8 registry, saved: the FP8 scaling state travels in state_dict() as extra state; a
round trip restores identical FP8 outputs, and a state dict without it (torch.nn.Linear's) loads
too. Every test runs on each device (conftest.py `device`): a checkpoint's FP8 state is saved as CPU
tensors and must work in a module on any device."""

import io

import pytest
import torch
from _linear_cases import IN, KINDS, OUT, autocast, batches, make_module, randomize_

import fp8dp

RECIPE = fp8dp.DelayedScaling(amax_history_len=3)


def train_steps(m, n):
    for step, (x, dy) in enumerate(batches(n, torch.float32, seed=41, device=m.weight.device)):
        with autocast(RECIPE):
            y = m(x * (step + 1))  # growing amaxes, so the history and scales change every step
        y.backward(dy)
        fp8dp.update_fp8_scales()


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_restores_fp8_outputs(kind, device):
    m = make_module(kind, device=device)
    randomize_(m, seed=40)
    train_steps(m, 4)
    sd = m.state_dict()
    state = sd["_extra_state"]
    assert state is not None and state["amax_history"].shape == (3, 3)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = make_module(kind, device=device)
    loaded.load_state_dict(torch.load(buf, weights_only=False))
    torch.testing.assert_close(
        loaded._core.amax_history.cpu(), m._core.amax_history.cpu(), rtol=0, atol=0
    )
    torch.testing.assert_close(loaded._core.scale.cpu(), m._core.scale.cpu(), rtol=0, atol=0)

    ((x, _),) = batches(1, torch.float32, seed=42, device=device)
    x = x * 5  # a different amax: a fresh module's first-cast scale would differ from the saved one
    fresh = make_module(kind, device=device)
    fresh.load_state_dict({k: v for k, v in sd.items() if k != "_extra_state"})
    with torch.no_grad(), autocast(RECIPE):
        y_m, y_loaded, y_fresh = m(x), loaded(x), fresh(x)
    torch.testing.assert_close(y_loaded, y_m, rtol=0, atol=0)
    assert not torch.equal(y_fresh, y_m), "without the extra state the scales differ"


def test_load_without_extra_state(device):
    """A torch.nn.Linear state dict loads with strict=True; the FP8 state starts afresh."""
    m = fp8dp.Linear(IN, OUT, device=device)
    train_steps(m, 1)
    assert m.get_extra_state() is not None
    ref = torch.nn.Linear(IN, OUT, device=device)
    m.load_state_dict(ref.state_dict(), strict=True)
    assert m.get_extra_state() is None
    assert torch.equal(m.weight, ref.weight) and torch.equal(m.bias, ref.bias)
    ((x, _),) = batches(1, torch.float32, seed=43, device=device)
    # Both are FP32 GEMMs with FP32 accumulation, possibly in different orders: each errs by at
    # most IN 2^-24 |x|·|W|ᵀ (plus the bias add, 2^-24 |y|), so they differ by at most twice that.
    with torch.no_grad():
        y, y_ref = m(x), ref(x)
        bound = 2 * IN * 2.0**-24 * (x.abs() @ m.weight.abs().t()) + 2.0**-23 * y_ref.abs()
    assert ((y - y_ref).abs() <= bound).all()


def test_state_before_first_fp8_forward_is_none(device):
    m = fp8dp.Linear(IN, OUT, device=device)
    assert m.state_dict()["_extra_state"] is None
    other = fp8dp.Linear(IN, OUT, device=device)
    other.load_state_dict(m.state_dict())
    assert other.get_extra_state() is None


def test_update_fp8_scales_rolls_history(device):
    """update_fp8_scales: scale = fp8_max / max(history) per role, history rolled by one row."""
    m = fp8dp.Linear(IN, OUT, device=device)
    data = batches(2, torch.float32, seed=44, device=device)
    amax_in = []
    for x, dy in data:
        with autocast(RECIPE):
            m(x).backward(dy)
        amax_in.append(float(x.abs().max()))
        hist_before = m._core.amax_history.clone()
        fp8dp.update_fp8_scales()
        torch.testing.assert_close(m._core.amax_history[1:], hist_before[:2], rtol=0, atol=0)
        assert torch.count_nonzero(m._core.amax_history[0]) == 0
    # After two steps the input scale comes from the larger of the two amaxes.
    expected = torch.tensor(448.0) / torch.tensor(max(amax_in))
    torch.testing.assert_close(m._core.scale[0].cpu(), expected, rtol=0, atol=0)
    grad_amax = max(float(dy.abs().max()) for _, dy in data)
    torch.testing.assert_close(
        m._core.scale[2].cpu(), torch.tensor(57344.0) / torch.tensor(grad_amax), rtol=0, atol=0
    )


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("margin", -1.0, "'margin' must be finite, >= 0 and <= 14.8"),
        ("margin", float("nan"), "'margin' must be finite, >= 0 and <= 14.8"),
        # Accepted before, then every forward cast underflowed to zero (now refused at load).
        ("margin", 2000.0, "'margin' must be finite, >= 0 and <= 14.8"),
        ("amax_compute_algo", 7, "'amax_compute_algo' must be 0 (max) or 1 (most_recent), got 7"),
    ],
)
def test_corrupt_extra_state_is_refused(key, value, message, device):
    """update_fp8_scales may run on a restored state before any forward sets algo and margin from
    the recipe, so a checkpoint with impossible values fails at load, naming the key."""
    m = fp8dp.Linear(IN, OUT, device=device)
    train_steps(m, 1)
    sd = m.state_dict()
    before = m._core.scale.cpu().clone()
    sd["_extra_state"][key] = value
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        m.load_state_dict(sd)
    # nothing half-loaded: the module keeps its own state
    torch.testing.assert_close(m._core.scale.cpu(), before, rtol=0, atol=0)


def test_update_right_after_load_uses_the_saved_state(device):
    """A checkpoint loaded, then update_fp8_scales before any forward: the update runs on the
    restored history with the saved algorithm and margin, exactly as in the saved module."""
    m = fp8dp.Linear(IN, OUT, device=device)
    train_steps(m, 2)
    with torch.no_grad(), autocast(RECIPE):  # amaxes in row 0, not yet reduced into a scale
        m(batches(1, torch.float32, seed=43, device=device)[0][0] * 3)
    loaded = fp8dp.Linear(IN, OUT, device=device)
    loaded.load_state_dict(m.state_dict())
    fp8dp.update_fp8_scales()  # updates both modules' states, one batch
    torch.testing.assert_close(loaded._core.scale.cpu(), m._core.scale.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(
        loaded._core.amax_history.cpu(), m._core.amax_history.cpu(), rtol=0, atol=0
    )
