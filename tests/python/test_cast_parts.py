"""fp8dp.quantize_parts: the FP8 cast of x = cat([p.reshape(d0 * d1, d2 * d3) for p in parts], 1)
read from the parts where they lie (SDPA's dq, dk, dv, each a [s, b, h, hd] view of a
[b, h, s, hd] buffer), instead of autograd stacking them first.

The definition is the cast of the materialized x, so every check is exact equality with
quantize(torch.cat(...)) on the same device: FP8 bytes, transposed bytes, amax and scale_inv bits,
and dbias bits. dbias included: the strided CUDA kernel runs the same grid and the same summation
order as the dense one (only its load addresses differ), so even the FP32 column sums must agree
to the bit. On the CPU quantize_parts materializes x itself, so there the tests hold the argument
checks and the plumbing (options, amax_into); on CUDA they hold the strided kernel.

Cases come from a generator (seed printed): shapes with 1, primes and sizes around the vector
width, layouts as attention leaves them, permuted and padded strides, one packed buffer shared by
the parts, and layouts the strided kernel does not take (dim 3 not contiguous, misaligned
pointers, parts with different strides, d3 not a multiple of the 16-byte vector). On CUDA every
case also checks which way it went against the kernel's documented conditions
(quantize_cuda_strided_supported), so removing or narrowing the strided kernel fails the tests
instead of silently falling back to the copy.
"""

import random

import pytest
import torch

import fp8dp

_C = fp8dp._C
CUDA_OK, CUDA_REASON = fp8dp.cuda_available(return_reason=True)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON)]
    ),
]
FORMATS = {"E4M3": _C.Format.E4M3, "E5M2": _C.Format.E5M2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# quantize()'s option sets: the flat path (data / amax only), the tiled one (transpose, dbias).
OPTS = {
    "data": dict(data=True),
    "amax_only": dict(data=False),
    "transpose": dict(data=True, transpose=True),
    "transpose_only": dict(data=False, transpose=True),
    "dbias_fp32": dict(data=True, transpose=True, dbias=True),
    "dbias_bf16": dict(data=True, dbias=True, dbias_dtype=torch.bfloat16),
}
LAYOUTS = [
    "contiguous",
    "attention",
    "permuted",
    "padded",
    "packed",
    "inner_strided",
    "misaligned",
    "mixed",
]


def reference(parts):
    """x itself: the parts' 2-D views side by side."""
    return torch.cat(
        [p.reshape(p.shape[0] * p.shape[1], p.shape[2] * p.shape[3]) for p in parts], 1
    )


def strided_expected(parts):
    """The strided kernel's conditions (quantize.h, quantize_cuda_strided_supported), restated: one
    set of strides, dim 3 contiguous, 16-byte vectors that never leave a row of d3 elements, every
    part 16-byte aligned; an empty x is materialized (nothing to read)."""
    p0 = parts[0]
    kv = 16 // p0.element_size()
    return (
        p0.is_cuda
        and p0.numel() > 0
        and p0.stride(3) == 1
        and all(t.stride() == p0.stride() for t in parts)
        and p0.shape[3] % kv == 0
        and all(s % kv == 0 for s in p0.stride()[:3])
        and all(t.data_ptr() % 16 == 0 for t in parts)
    )


def fill(shape, rng, dtype, device, special):
    """Values of the parts: normal, with a large tail that saturates (|x| * scale beyond both
    formats' max), and optionally NaN / Inf at random places."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    x = torch.randn(shape, generator=g) * rng.choice([0.5, 3.0, 40.0])
    if x.numel() and special in ("large", "nan", "inf"):
        flat = x.view(-1)
        idx = torch.randint(0, x.numel(), (max(1, x.numel() // 50),), generator=g)
        big = 6.0e4 if dtype == torch.float16 else 3.0e5
        flat[idx] = big * torch.sign(torch.randn(idx.shape, generator=g))
        if special == "nan":
            flat[rng.randrange(x.numel())] = float("nan")
            flat[rng.randrange(x.numel())] = -float("nan")
        elif special == "inf":
            flat[rng.randrange(x.numel())] = float("inf")
            flat[rng.randrange(x.numel())] = -float("inf")
    return x.to(dtype).to(device)


def make_parts(layout, shape, n, dtype, device, rng, special):
    """n tensors of logical shape [d0, d1, d2, d3] in the given memory layout."""
    d0, d1, d2, d3 = shape
    if layout == "contiguous":
        return [fill(shape, rng, dtype, device, special) for _ in range(n)]
    if layout == "attention":  # contiguous [b, h, s, hd] buffers seen as [s, b, h, hd]
        return [
            fill((d1, d2, d0, d3), rng, dtype, device, special).permute(2, 0, 1, 3)
            for _ in range(n)
        ]
    if layout == "permuted":  # dims 0..2 in a random memory order, dim 3 innermost
        order = rng.sample(range(3), 3)
        inv = [order.index(i) for i in range(3)]
        mem = tuple(shape[i] for i in order) + (d3,)
        return [fill(mem, rng, dtype, device, special).permute(*inv, 3) for _ in range(n)]
    if layout == "padded":  # a slice of a larger buffer: every stride padded
        pad = rng.choice([8, 16, 3])
        big = (d0 + 1, d1 + 2, d2 + 1, d3 + pad)
        return [fill(big, rng, dtype, device, special)[:d0, :d1, :d2, :d3] for _ in range(n)]
    if layout == "packed":  # one [d0, d1, n, d2, d3] buffer (the projection's output split)
        buf = fill((d0, d1, n, d2, d3), rng, dtype, device, special)
        return [buf[:, :, i] for i in range(n)]
    if layout == "inner_strided":  # dim 3 not contiguous: never the strided kernel
        return [
            fill(shape[:3] + (2 * d3,), rng, dtype, device, special)[..., ::2] for _ in range(n)
        ]
    if layout == "misaligned":  # storage offset of one element: pointers off the 16-byte grid
        numel = d0 * d1 * d2 * d3
        return [fill((numel + 1,), rng, dtype, device, special)[1:].view(shape) for _ in range(n)]
    if layout == "mixed":  # a different layout per part: no common strides
        first = make_parts("attention", shape, 1, dtype, device, rng, special)
        return first + make_parts("contiguous", shape, n - 1, dtype, device, rng, special)
    raise AssertionError(layout)


def gen_case(seed, device, dtype):
    """One generated case: (parts, description)."""
    rng = random.Random(seed)
    layout = rng.choice(LAYOUTS)
    n = rng.randint(1, 4)
    d0 = rng.choice([1, 2, 3, 7, 16, 37])
    d1 = rng.choice([1, 2, 3, 5, 16])
    d2 = rng.choice([1, 2, 3, 12])
    d3 = rng.choice([8, 16, 24, 64, 128, 4, 5, 1])
    if layout == "mixed":
        n = max(n, 2)
    special = rng.choice(["none", "large", "nan", "inf"])
    parts = make_parts(layout, (d0, d1, d2, d3), n, dtype, device, rng, special)
    desc = f"seed={seed} layout={layout} n={n} shape={(d0, d1, d2, d3)} special={special}"
    return parts, desc


def assert_same(got, want, msg):
    for key in ("data", "data_t"):
        g, w = getattr(got, key), getattr(want, key)
        assert (g is None) == (w is None), f"{msg}: {key}"
        if w is not None:
            assert g.shape == w.shape and g.dtype == w.dtype, f"{msg}: {key} {g.shape} {w.shape}"
            assert torch.equal(
                g.view(torch.uint8).cpu(), w.view(torch.uint8).cpu()
            ), f"{msg}: {key}"
    for key in ("amax", "scale_inv", "dbias"):
        g, w = getattr(got, key), getattr(want, key)
        assert (g is None) == (w is None), f"{msg}: {key}"
        if w is not None:
            assert g.shape == w.shape and g.dtype == w.dtype, f"{msg}: {key}"
            bits = torch.int32 if w.element_size() == 4 else torch.int16
            assert torch.equal(
                g.cpu().view(bits), w.cpu().view(bits)
            ), f"{msg}: {key} {g.cpu()} vs {w.cpu()}"


def check_case(parts, desc, fmt, opts, device, scale_value=3.0, amax_start=None):
    print(desc)
    scale = torch.tensor([scale_value], device=device)
    kw = dict(OPTS[opts])
    kw_ref = dict(kw)
    if amax_start is not None:
        kw["amax_into"] = torch.tensor([amax_start], device=device)
        kw_ref["amax_into"] = torch.tensor([amax_start], device=device)
    got = _C.quantize_parts(parts, scale, FORMATS[fmt], **kw)
    want = _C.quantize(reference(parts), scale, FORMATS[fmt], **kw_ref)
    assert_same(got, want, f"{desc} fmt={fmt} opts={opts}")
    if amax_start is not None:  # merged into the slot itself
        assert got.amax.data_ptr() == kw["amax_into"].data_ptr()
    strided = _C.quantize_parts_strided(parts)
    assert strided == strided_expected(parts), f"{desc}: strided kernel taken = {strided}"
    return strided


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(8))
def test_generated_cases_match_the_materialized_cast(device, fmt, dtype, seed):
    seed = seed * 100 + DTYPES.index(dtype) * 10 + list(FORMATS).index(fmt)
    parts, desc = gen_case(seed, device, dtype)
    rng = random.Random(seed + 1)
    for opts in rng.sample(list(OPTS), 3):
        check_case(parts, desc, fmt, opts, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("start", [0.0, 0.25, 1e9, float("nan")])
def test_amax_into_merges_as_quantize_does(device, start):
    parts, desc = gen_case(7, device, torch.bfloat16)
    check_case(parts, desc, "E5M2", "dbias_fp32", device, amax_start=start)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["attention", "contiguous", "misaligned"])
@pytest.mark.parametrize("special", ["none", "nan", "inf"])
def test_amax_parts_is_the_amax_of_x(device, layout, special):
    rng = random.Random(11)
    parts = make_parts(layout, (5, 3, 2, 16), 3, torch.bfloat16, device, rng, special)
    got = _C.amax_parts(parts)
    want = _C.amax(reference(parts))
    assert torch.equal(got.cpu().view(torch.int32), want.cpu().view(torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_parts_cast_like_an_empty_x(device):
    parts = [torch.zeros(0, 4, 2, 16, device=device) for _ in range(3)]
    check_case(parts, "empty", "E4M3", "dbias_fp32", device)
    slot = torch.tensor([1.25], device=device)
    _C.quantize_parts(parts, torch.ones(1, device=device), FORMATS["E4M3"], amax_into=slot)
    assert slot.item() == 1.25


# ---------------------------------------------------------------- argument checks


def _ones(*shape, **kw):
    return torch.ones(*shape, **kw)


BAD = {
    "empty_list": (lambda: [], r"argument 'parts' must hold 1 to 4 tensors, got 0"),
    "five_parts": (
        lambda: [_ones(2, 2, 2, 8) for _ in range(5)],
        r"argument 'parts' must hold 1 to 4 tensors, got 5",
    ),
    "not_4d": (lambda: [_ones(4, 16)], r"argument 'parts\[0\]' must be 4-D .* got 2-D"),
    "shape": (
        lambda: [_ones(2, 2, 2, 8), _ones(2, 2, 2, 16)],
        r"argument 'parts\[1\]' must have the shape of parts\[0\], \[2, 2, 2, 8\], got "
        r"\[2, 2, 2, 16\]",
    ),
    "dtype": (
        lambda: [_ones(2, 2, 2, 8), _ones(2, 2, 2, 8, dtype=torch.bfloat16)],
        r"argument 'parts\[1\]' must have the dtype of parts\[0\], Float, got BFloat16",
    ),
    "fp8_dtype": (
        lambda: [_ones(2, 2, 2, 8).to(torch.float8_e4m3fn)],
        r"argument 'parts\[0\]'",
    ),
    "int_dtype": (lambda: [_ones(2, 2, 2, 8, dtype=torch.int32)], r"argument 'parts\[0\]'"),
    "meta_device": (
        lambda: [_ones(2, 2, 2, 8), _ones(2, 2, 2, 8, device="meta")],
        r"argument 'parts\[1\]' must be on the device of parts\[0\], cpu, got meta",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("fn", ["quantize_parts", "quantize_parts_strided", "amax_parts"])
def test_bad_parts_are_named(case, fn):
    make, match = BAD[case]
    parts = make()
    scale = torch.ones(1)
    call = {
        "quantize_parts": lambda: _C.quantize_parts(parts, scale, FORMATS["E4M3"]),
        "quantize_parts_strided": lambda: _C.quantize_parts_strided(parts),
        "amax_parts": lambda: _C.amax_parts(parts),
    }[fn]
    with pytest.raises(ValueError, match=f"fp8dp.{fn}: {match}"):
        call()


@pytest.mark.parametrize(
    "scale, match",
    [
        (torch.ones(1, dtype=torch.float64), "argument 'scale' must be float32"),
        (torch.ones(2), "argument 'scale' must have one element"),
        (torch.zeros(1), "argument 'scale' must be finite and > 0"),
        (torch.ones(1, device="meta"), "argument 'scale' is on meta but the input is on cpu"),
    ],
)
def test_bad_scale_is_named(scale, match):
    parts = [torch.ones(2, 2, 2, 8)]
    with pytest.raises(ValueError, match=f"fp8dp.quantize_parts: {match}"):
        _C.quantize_parts(parts, scale, FORMATS["E4M3"])


def test_bad_amax_into_and_dbias_dtype_are_named():
    parts = [torch.ones(2, 2, 2, 8)]
    with pytest.raises(ValueError, match="fp8dp.quantize_parts: 'amax_into' must be a contiguous"):
        _C.quantize_parts(parts, torch.ones(1), FORMATS["E4M3"], amax_into=torch.zeros(2))
    with pytest.raises(ValueError, match="fp8dp.quantize_parts: dbias_dtype"):
        _C.quantize_parts(
            parts, torch.ones(1), FORMATS["E4M3"], dbias=True, dbias_dtype=torch.float64
        )


def test_cpu_never_takes_the_strided_kernel():
    """The CPU kernel refuses strided input (quantize_cpu); the tensor layer materializes."""
    parts = make_parts(
        "attention", (4, 2, 2, 64), 3, torch.bfloat16, "cpu", random.Random(1), "none"
    )
    assert not _C.quantize_parts_strided(parts)


# ---------------------------------------------------------------- CUDA: the strided kernel

SB = [(37, 3), (64, 4), (129, 2)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("special", ["none", "large", "nan", "inf"])
@pytest.mark.parametrize("sb", SB, ids=lambda sb: f"s{sb[0]}b{sb[1]}")
def test_cuda_attention_layout_takes_the_strided_kernel(fmt, dtype, hd, special, sb):
    """dq, dk, dv as attention leaves them: three contiguous [b, h, s, hd] buffers seen as
    [s, b, h, hd], every option set. s * b = 111, 256, 258 rows: not, exactly, and just past a
    multiple of the tile rows (64 fp32 / 128 bf16 and fp16)."""
    s, b = sb
    h = 3
    seed = SB.index(sb) * 1000 + hd + 10 * DTYPES.index(dtype) + 100 * list(FORMATS).index(fmt)
    rng = random.Random(seed)
    parts = make_parts("attention", (s, b, h, hd), 3, dtype, "cuda", rng, special)
    desc = f"seed={seed} attention s={s} b={b} h={h} hd={hd} {dtype} special={special}"
    for opts in OPTS:
        assert check_case(parts, desc, fmt, opts, "cuda"), "attention layout not read in place"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON)
@pytest.mark.parametrize("d3", [5, 12, 3])
def test_cuda_unsupported_layout_falls_back_to_the_same_bytes(d3):
    """d3 not a multiple of the 8-element bf16 vector: the strided kernel is not taken, and the
    materialized cast gives the same bytes."""
    rng = random.Random(d3)
    parts = make_parts("attention", (33, 2, 4, d3), 3, torch.bfloat16, "cuda", rng, "nan")
    assert not check_case(parts, f"attention d3={d3}", "E5M2", "dbias_bf16", "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON)
def test_cuda_model_shape_with_several_tiles_per_block():
    """A 342M-GPT-like micro-batch (s=1024, b=4, h=12, hd=128, bf16, E5M2, transpose + dbias): a
    grid where dbias makes each block walk several tiles down its strip (auto_strip_tiles), which
    the small shapes above do not reach."""
    rng = random.Random(5)
    parts = make_parts("attention", (1024, 4, 12, 128), 3, torch.bfloat16, "cuda", rng, "large")
    assert check_case(parts, "model shape", "E5M2", "dbias_fp32", "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason=CUDA_REASON)
def test_cuda_runs_on_the_current_stream():
    """The cast is ordered with the torch work around it: parts written on a side stream and cast
    there give the bytes of the same cast on the default stream."""
    rng = random.Random(9)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        parts = make_parts("attention", (256, 2, 4, 64), 3, torch.bfloat16, "cuda", rng, "none")
        got = _C.quantize_parts(parts, torch.ones(1, device="cuda"), FORMATS["E4M3"], True, True)
    side.synchronize()
    want = _C.quantize(reference(parts), torch.ones(1, device="cuda"), FORMATS["E4M3"], True, True)
    assert_same(got, want, "side stream")
