"""LayerNorm / RMSNorm kernels on CUDA tensors (fused FP8 cast, backward) against the CPU kernel and
an FP64 reference; the argument checks and empty inputs on both devices.

Tolerances, u = 2^-24 (FP32 unit roundoff), n = cols:
- mu: a sum of n FP32 values in any order is within (n - 1) u sum|x| of the exact sum, the division
  adds u |mu|: |mu - mu64| <= (n + 1) u mean|x|.
- rsigma: the variance is a sum of n non-negative terms (x - mu)^2, each within 3u relative, so it
  is within (n + 4) u relative (an error d in mu only adds d^2, because sum(x - mu64) = 0); eps,
  sqrt and the division add 2u, and 1/sqrt halves the relative error of its argument:
  |rsigma / rsigma64 - 1| <= (n / 2 + 4) u + d^2 / (2 var).
- z: the two devices differ only through their FP32 statistics (the row sums run in another
  order); with the observed dmu, drsigma of the two kernels, the exact z differ by
  |g| (|dmu| rsigma + |x - mu| |drsigma|), and each device's z carries <= 5u of rounding
  (subtract, 2 multiplies, the 1 + gamma shift, the add), so
  |z_gpu - z_cpu| <= E = |g| (|dmu| rs + |x - mu| |drs|) (1 + 8u) + 10u (|xhat g| + |beta|),
  and after both round to the activation dtype: |out_gpu - out_cpu| <= E + ulp_dtype(|z| + E).
- FP8 bytes: exact. The fused cast must give quantize(out) of its own rounded output, and the CPU
  kernel's bytes wherever the two rounded outputs agree.
- backward: see _bwd_bounds.
"""

import math
import re

import pytest
import torch

import fp8dp

_C = fp8dp._C
OK, REASON = fp8dp.cuda_available(return_reason=True)
_skip_without_gpu = pytest.mark.skipif(not OK, reason=REASON)


def needs_gpu(test):
    """The `gpu` marker (pyproject.toml) and the skip with the reason where there is no GPU."""
    return pytest.mark.gpu(_skip_without_gpu(test))


# Checks and empty inputs run on the CPU (in CI) as well as on the GPU.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _skip_without_gpu])]

U = 2.0**-24
FORMATS = {"E4M3": _C.Format.E4M3, "E5M2": _C.Format.E5M2}
# (mantissa bits, smallest normal exponent) of the activation dtypes, for their ulp.
ULP = {torch.float32: (23, -126), torch.bfloat16: (7, -126), torch.float16: (10, -14)}
# Rows x cols: 1 and primes, cols that are not a multiple of the 16-byte vector (33, 1027),
# rows that need the grid-stride loop (3000), the large hidden sizes (8192, 12288; 12288 fp32 fills
# the 8-vector register kernel and the backward's 6-vector one; 20000 bf16 / fp16 the 8-vector
# one), and rows longer than the register kernels take (40000: three passes from memory; 40001
# also not vectorised). 1536, configs/gpt350m.yaml's width: 3 of the 4-vector kernel's 4 slots per
# thread with several rows per block (4 for 16-bit dtypes, 2 for FP32), which no other width here
# combines.
SHAPES = [
    (1, 1),
    (5, 33),
    (37, 1027),
    (513, 1536),
    (3000, 2048),
    (64, 8192),
    (24, 12288),
    (4, 20000),
    (3, 40000),
    (2, 40001),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def ulp(v, dtype):
    """One unit in the last place of dtype at magnitude |v| (float64 tensor)."""
    mant, emin = ULP[dtype]
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0**emin)))
    return torch.pow(2.0, e.clamp_min(emin) - mant)


def make_inputs(rows, cols, dtype, rms, seed=0):
    g = torch.Generator().manual_seed(seed * 7919 + rows * 131 + cols)
    x = (torch.randn(rows, cols, generator=g) * 3 + 1).to(dtype)
    gamma = (torch.randn(cols, generator=g) * 0.5 + 1).to(dtype)
    beta = None if rms else torch.randn(cols, generator=g).to(dtype)
    return x, gamma, beta


def stats64(x, rms, eps):
    xd = x.double()
    mu = torch.zeros(x.shape[0], dtype=torch.float64) if rms else xd.mean(1)
    xc = xd if rms else xd - mu[:, None]
    var = (xc * xc).mean(1)
    return mu, var, 1.0 / torch.sqrt(var + eps)


def assert_stats(r, x, rms, eps):
    """mu / rsigma of one device against FP64 within the bounds of the module docstring."""
    n = x.shape[1]
    mu64, var64, rs64 = stats64(x, rms, eps)
    mu, rs = r.mu.cpu().double(), r.rsigma.cpu().double()
    mu_bound = (n + 1) * U * x.double().abs().mean(1)
    assert ((mu - mu64).abs() <= mu_bound).all()
    d = (mu - mu64).abs()  # the observed error of this device's mean (bounded just above)
    rel = (n / 2 + 4) * U + d * d / (2 * (var64 + eps))
    assert ((rs / rs64 - 1).abs() <= rel).all()


def run_fwd(x, gamma, beta, rms, zcg, fmt, scale, want_out=True):
    dev = x.device
    return _C.norm_forward(
        x,
        gamma.to(dev),
        None if beta is None else beta.to(dev),
        rms=rms,
        eps=1e-5,
        zero_centered_gamma=zcg,
        want_out=want_out,
        scale=None if fmt is None else scale.to(dev),
        format=FORMATS[fmt or "E4M3"],
    )


def as_bytes(t):
    return t.view(torch.uint8).cpu()


@needs_gpu
@pytest.mark.parametrize("fmt", [None, "E4M3", "E5M2"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("zcg", [False, True], ids=["gamma", "zero_centered"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_forward_matches_cpu_kernel(norm, dtype, zcg, shape, fmt):
    rms = norm == "RMSNorm"
    x, gamma, beta = make_inputs(*shape, dtype, rms)
    scale = torch.tensor([3.5])
    cpu = run_fwd(x, gamma, beta, rms, zcg, fmt, scale)
    gpu = run_fwd(x.cuda(), gamma, beta, rms, zcg, fmt, scale)
    assert gpu.out.is_cuda and gpu.out.dtype == dtype and gpu.out.shape == x.shape

    assert_stats(cpu, x, rms, 1e-5)
    assert_stats(gpu, x, rms, 1e-5)

    # Outputs: within the bound E of the module docstring, from the statistics both kernels saw.
    xd = x.double()
    g = gamma.double() + (1.0 if zcg else 0.0)
    b = torch.zeros_like(g) if beta is None else beta.double()
    mu_c, rs_c = cpu.mu.double()[:, None], cpu.rsigma.double()[:, None]
    dmu = (gpu.mu.cpu().double()[:, None] - mu_c).abs()
    drs = (gpu.rsigma.cpu().double()[:, None] - rs_c).abs()
    xhat = (xd - mu_c) * rs_c
    z = xhat * g + b
    e = g.abs() * (dmu * rs_c + (xd - mu_c).abs() * drs) * (1 + 8 * U)
    e += 10 * U * ((xhat * g).abs() + b.abs())
    out_g, out_c = gpu.out.cpu(), cpu.out
    diff = (out_g.double() - out_c.double()).abs()
    assert (diff <= e + ulp(z.abs() + e, dtype)).all()

    # amax of the rounded output, bit for bit (also without an FP8 output).
    assert torch.equal(gpu.amax.cpu(), out_g.float().abs().amax().reshape(1))

    if fmt is not None:
        f = FORMATS[fmt]
        fp8_g = as_bytes(gpu.out_fp8)
        # The scale_inv the GEMM reads, written by the same launch: 1 / scale, as quantize's.
        assert torch.equal(gpu.scale_inv.cpu(), 1.0 / scale) and torch.equal(
            cpu.scale_inv, 1.0 / scale
        )
        # The fused cast is quantize() of the kernel's own rounded output ...
        assert torch.equal(fp8_g, as_bytes(_C.quantize(out_g, scale, f).data))
        # ... and the CPU kernel's bytes wherever the two rounded outputs are the same.
        same = out_g.view(-1).float() == out_c.view(-1).float()
        assert torch.equal(fp8_g.view(-1)[same], as_bytes(cpu.out_fp8).view(-1)[same])
        # Without the high-precision output: the same bytes, amax and statistics.
        only = run_fwd(x.cuda(), gamma, beta, rms, zcg, fmt, scale, want_out=False)
        assert only.out is None
        assert torch.equal(as_bytes(only.out_fp8), fp8_g)
        assert torch.equal(only.amax, gpu.amax)
        assert torch.equal(only.rsigma, gpu.rsigma)


@needs_gpu
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", [64, 1027, 40000])
def test_forward_nan_row(fmt, dtype, cols):
    """A NaN makes its row (and amax) NaN, with the CPU's canonical NaN bits for amax; the other
    rows are bit for bit what they are without it (rows are independent)."""
    x, gamma, beta = make_inputs(6, cols, dtype, False)
    scale = torch.tensor([2.0])
    clean = run_fwd(x.cuda(), gamma, beta, False, False, fmt, scale)
    x[3, cols // 2] = float("nan")
    gpu = run_fwd(x.cuda(), gamma, beta, False, False, fmt, scale)
    cpu = run_fwd(x, gamma, beta, False, False, fmt, scale)
    assert torch.equal(gpu.amax.cpu().view(torch.int32), cpu.amax.view(torch.int32))
    assert torch.isnan(gpu.out[3]).all()
    keep = torch.tensor([0, 1, 2, 4, 5])
    assert torch.equal(gpu.out.cpu()[keep], clean.out.cpu()[keep])
    assert torch.equal(as_bytes(gpu.out_fp8)[keep], as_bytes(clean.out_fp8)[keep])
    # NaN rows quantize as the CPU quantizes the same values: NaN codes (with the value's sign).
    q = _C.quantize(gpu.out.cpu(), scale, FORMATS[fmt]).data
    assert torch.equal(as_bytes(gpu.out_fp8), as_bytes(q))


def negative_nan(dtype):
    """A quiet NaN with the sign bit set, built from its bits (negating a NaN need not set it)."""
    bits = {
        torch.float32: 0xFFC00000 - 2**32,
        torch.bfloat16: 0xFFC0 - 2**16,
        torch.float16: 0xFE00 - 2**16,
    }
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int16
    v = torch.tensor([bits[dtype]], dtype=int_dtype).view(dtype)
    assert torch.isnan(v).all() and (v.view(int_dtype) < 0).all()
    return v[0]


@needs_gpu
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("want_out", [True, False], ids=["with_out", "fp8_only"])
@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_forward_nonfinite(norm, want_out, dtype, fmt):
    """Negative NaNs and infinities in x, gamma and beta, and a row whose statistics overflow: the
    fused cast still gives quantize() of the kernel's own rounded output (the CPU cast keeps a
    NaN's sign, 0xFF for a negative one, where the hardware conversion writes 0x7F), and the
    FP8-only launch the same bytes and amax."""
    rms = norm == "RMSNorm"
    cols = 1024
    x, gamma, beta = make_inputs(6, cols, dtype, rms)
    neg_nan = negative_nan(dtype)
    big = torch.finfo(dtype).max
    x[1, 5] = neg_nan
    x[2, 7] = -float("inf")
    x[3, :2] = big  # bf16 / fp32: the row's sums overflow
    x[3, 2:4] = -big
    gamma[11] = neg_nan
    gamma[12] = float("inf")
    if beta is not None:
        beta[13] = neg_nan
        beta[14] = -float("inf")
    scale = torch.tensor([4.0])
    both = run_fwd(x.cuda(), gamma, beta, rms, False, fmt, scale)
    assert torch.isnan(both.out[1]).all() and torch.isnan(both.out[:, 11]).all()
    q = _C.quantize(both.out.cpu(), scale, FORMATS[fmt]).data
    assert torch.equal(as_bytes(both.out_fp8), as_bytes(q))
    # A negative NaN on the CPU path stays negative: the bytes above are not trivially 0x7F.
    assert (as_bytes(_C.quantize(neg_nan.view(1, 1), scale, FORMATS[fmt]).data) == 0xFF).all()
    if not want_out:
        only = run_fwd(x.cuda(), gamma, beta, rms, False, fmt, scale, want_out=False)
        assert torch.equal(as_bytes(only.out_fp8), as_bytes(both.out_fp8))
        assert torch.equal(only.amax.view(torch.int32), both.amax.view(torch.int32))


def misaligned_copy(t):
    """t's values in memory that starts one element past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = flat[1:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0
    return out


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_misaligned_rows_give_the_same_bits(norm, dtype):
    """16-byte loads need aligned rows; misaligned tensors take the element-wise path, which keeps
    the same thread / vector assignment and summation order, so every output is bit-identical."""
    rms = norm == "RMSNorm"
    x, gamma, beta = make_inputs(48, 1024, dtype, rms)
    dz = torch.randn(48, 1024).to(dtype).cuda()
    x, gamma = x.cuda(), gamma.cuda()
    beta = None if beta is None else beta.cuda()
    scale = torch.tensor([3.0], device="cuda")
    results = []
    for move in (lambda t: t, misaligned_copy):
        b = None if beta is None else move(beta)
        f = _C.norm_forward(move(x), move(gamma), b, rms=rms, scale=scale)
        bw = _C.norm_backward(
            move(dz), move(x), f.mu, f.rsigma, move(gamma), has_beta=not rms, rms=rms
        )
        results.append([f.out, f.out_fp8.view(torch.uint8), f.amax, f.mu, f.rsigma, *bw])
    for a, b in zip(*results):
        assert (a is None and b is None) or torch.equal(a, b)


@needs_gpu
def test_forward_large_offset_is_stable():
    """Two passes over the row (mean, then squared deviations): a row 1e4 + N(0, 0.01) keeps
    rsigma (~100) within the FP64 bound; E[x^2] - E[x]^2 in FP32 would lose every digit
    (1e8 has an ulp of 8, the variance is 1e-4)."""
    g = torch.Generator().manual_seed(5)
    x = 1e4 + torch.randn(16, 4096, generator=g) * 0.01
    gamma = torch.ones(4096)
    r = _C.norm_forward(x.cuda(), gamma.cuda(), torch.zeros(4096, device="cuda"), eps=1e-12)
    assert_stats(r, x, False, 1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_no_rows(device):
    r = _C.norm_forward(
        torch.empty(0, 64, device=device),
        torch.ones(64, device=device),
        scale=torch.full((1,), 4.0, device=device),
    )
    assert r.out.shape == (0, 64) and r.mu.shape == (0,) and r.out_fp8.shape == (0, 64)
    assert r.amax.item() == 0.0
    assert r.scale_inv.item() == 0.25  # written with no rows too: the GEMM still reads it


def bwd_reference(dz, x, mu, rs, gamma, rms, zcg):
    """FP64 backward from the same saved statistics, plus the magnitudes the bounds need."""
    dzd, xd = dz.double(), x.double()
    mu = torch.zeros_like(mu) if rms else mu
    xhat = (xd - mu[:, None]) * rs[:, None]
    g = gamma.double() + (1.0 if zcg else 0.0)
    dxhat = dzd * g
    n = x.shape[1]
    m1 = torch.zeros(x.shape[0], 1, dtype=torch.float64) if rms else dxhat.mean(1, keepdim=True)
    m2 = (dxhat * xhat).mean(1, keepdim=True)
    dx = rs[:, None] * (dxhat - m1 - xhat * m2)
    return {
        "dx": dx,
        "dgamma": (dzd * xhat).sum(0),
        "dbeta": dzd.sum(0),
        "xhat": xhat,
        "dxhat": dxhat,
        "m1": m1,
        "m2": m2,
        "n": n,
    }


def _bwd_bounds(ref, dz, rs, rows):
    """Error bounds of the FP32 backward against FP64 (before rounding to the dtype):
    - dgamma / dbeta: column sums over the rows in any order, each term dz * xhat within 4u
      (subtract, two multiplies): (rows + 4) u sum_r |dz xhat|, (rows - 1) u sum_r |dz|.
    - dx: the row means m1 = mean(dxhat), m2 = mean(dxhat xhat) are within (n + 2) u mean|dxhat|
      and (n + 6) u mean|dxhat xhat|; dx = rsigma (dxhat - m1 - xhat m2) then adds 6u of each
      term's magnitude: rsigma (dm1 + |xhat| dm2 + 6u (|dxhat| + |m1| + |xhat m2|))."""
    n, xhat, dxhat = ref["n"], ref["xhat"], ref["dxhat"]
    dzd = dz.double()
    b_dg = (rows + 4) * U * (dzd * xhat).abs().sum(0)
    b_db = max(rows - 1, 1) * U * dzd.abs().sum(0)
    dm1 = (n + 2) * U * dxhat.abs().mean(1, keepdim=True)
    dm2 = (n + 6) * U * (dxhat * xhat).abs().mean(1, keepdim=True)
    terms = dxhat.abs() + ref["m1"].abs() + (xhat * ref["m2"]).abs()
    b_dx = rs.double()[:, None] * (dm1 + xhat.abs() * dm2 + 6 * U * terms)
    return b_dx, b_dg, b_db


def assert_close_rounded(got, want, bound, dtype):
    """got is want (FP64) plus an FP32 error <= bound, rounded once to dtype (<= one ulp)."""
    diff = (got.cpu().double() - want).abs()
    assert (diff <= bound + ulp(want.abs() + bound, dtype)).all()


@needs_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("zcg", [False, True], ids=["gamma", "zero_centered"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_backward_matches_fp64(norm, dtype, zcg, shape):
    rms = norm == "RMSNorm"
    rows, cols = shape
    x, gamma, beta = make_inputs(rows, cols, dtype, rms, seed=1)
    dz = torch.randn(rows, cols, generator=torch.Generator().manual_seed(2)).to(dtype)
    fwd = _C.norm_forward(
        x.cuda(),
        gamma.cuda(),
        None if beta is None else beta.cuda(),
        rms=rms,
        zero_centered_gamma=zcg,
    )
    has_beta = beta is not None
    args = (dz.cuda(), x.cuda(), fwd.mu, fwd.rsigma, gamma.cuda())
    dx, dg, db = _C.norm_backward(*args, has_beta=has_beta, rms=rms, zero_centered_gamma=zcg)
    assert dx.is_cuda and dx.dtype == dtype and dg.dtype == dtype and dg.shape == (cols,)
    assert (db is not None) == has_beta

    mu, rs = fwd.mu.cpu().double(), fwd.rsigma.cpu().double()
    ref = bwd_reference(dz, x, mu, rs, gamma, rms, zcg)
    b_dx, b_dg, b_db = _bwd_bounds(ref, dz, rs, rows)
    assert_close_rounded(dx, ref["dx"], b_dx, dtype)
    assert_close_rounded(dg, ref["dgamma"], b_dg, dtype)
    if has_beta:
        assert_close_rounded(db, ref["dbeta"], b_db, dtype)

    # Deterministic: fixed-order partial sums, no atomics.
    dx2, dg2, db2 = _C.norm_backward(*args, has_beta=has_beta, rms=rms, zero_centered_gamma=zcg)
    assert torch.equal(dx2, dx) and torch.equal(dg2, dg)
    if has_beta:
        assert torch.equal(db2, db)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_no_rows(device):
    x = torch.empty(0, 48, device=device, dtype=torch.bfloat16)
    e = torch.empty(0, device=device)
    dx, dg, db = _C.norm_backward(
        x, x, e, e, torch.ones(48, device=device, dtype=torch.bfloat16), has_beta=True
    )
    assert dx.shape == (0, 48) and torch.equal(dg.cpu(), torch.zeros(48, dtype=torch.bfloat16))
    assert torch.equal(db.cpu(), torch.zeros(48, dtype=torch.bfloat16))


@needs_gpu
def test_backward_mixed_dtypes_take_the_aten_path():
    """An FP32 dz with bf16 x is not the kernel's case; the result must still be the FP32 math."""
    x, gamma, _ = make_inputs(8, 256, torch.bfloat16, True)
    dz = torch.randn(8, 256)
    fwd = _C.norm_forward(x.cuda(), gamma.cuda(), rms=True)
    dx, dg, _ = _C.norm_backward(
        dz.cuda(), x.cuda(), fwd.mu, fwd.rsigma, gamma.cuda(), has_beta=False, rms=True
    )
    rs = fwd.rsigma.cpu().double()
    ref = bwd_reference(dz, x, fwd.mu.cpu().double(), rs, gamma, True, False)
    b_dx, b_dg, _ = _bwd_bounds(ref, dz, rs, 8)
    assert_close_rounded(dx, ref["dx"], b_dx, torch.bfloat16)
    assert_close_rounded(dg, ref["dgamma"], b_dg, torch.bfloat16)


def elsewhere(t):
    """The same tensor on another device than the test's inputs (meta for CPU inputs)."""
    return t.cpu() if t.is_cuda else t.to("meta")


BAD_FWD = {
    "gamma elsewhere": (lambda x, g, s: (x, elsewhere(g), s), "gamma must be on the input's"),
    "scale elsewhere": (lambda x, g, s: (x, g, elsewhere(s)), "scale must be on the input's"),
    "gamma dtype": (lambda x, g, s: (x, g.float(), s), "gamma must be [64] of BFloat16"),
    "3-D input": (lambda x, g, s: (x.view(4, 4, 16), g[:16], s), "input must be [rows, cols]"),
    "int input": (lambda x, g, s: (x.int(), g.int(), s), "must be float32, bfloat16 or float16"),
    "no columns": (lambda x, g, s: (x[:, :0], g[:0], s), "at least one column"),
    "two scales": (lambda x, g, s: (x, g, s.repeat(2)), "scale must have one element"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(BAD_FWD))
def test_forward_bad_input(case, device):
    make, msg = BAD_FWD[case]
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
    g = torch.ones(64, device=device, dtype=torch.bfloat16)
    s = torch.ones(1, device=device)
    xx, gg, ss = make(x, g, s)
    with pytest.raises(ValueError, match=re.escape(msg)):
        _C.norm_forward(xx, gg, scale=ss)


BAD_BWD = {
    "dz shape": (lambda d, x, m, r, g: (d[:, :8], x, m, r, g), "dz must have x's shape"),
    "dz elsewhere": (lambda d, x, m, r, g: (elsewhere(d), x, m, r, g), "dz must be on the input's"),
    "rsigma length": (lambda d, x, m, r, g: (d, x, m, r[:2], g), "mu and rsigma must be float32"),
    "mu dtype": (lambda d, x, m, r, g: (d, x, m.double(), r, g), "mu and rsigma must be float32"),
    "gamma length": (lambda d, x, m, r, g: (d, x, m, r, g[:5]), "gamma must have 64 elements"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(BAD_BWD))
def test_backward_bad_input(case, device):
    make, msg = BAD_BWD[case]
    x = torch.randn(4, 64, device=device)
    args = make(
        torch.randn_like(x),
        x,
        torch.zeros(4, device=device),
        torch.ones(4, device=device),
        torch.ones(64, device=device),
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        _C.norm_backward(*args, has_beta=True)


def test_ulp_matches_the_dtypes():
    # The bounds' ulp must be the dtypes' own spacing (a wrong table would loosen every test).
    for dtype in DTYPES:
        v = torch.tensor([1.0, 3.0, 1000.0], dtype=torch.float64)
        assert torch.equal(
            ulp(v, dtype),
            v.new_tensor(
                [torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(a)) for a in v.tolist()]
            ),
        )


@pytest.mark.gpu
@pytest.mark.skipif(not OK or torch.cuda.device_count() < 2, reason="needs two GPUs in one process")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_device_gets_the_same_bytes(dtype):
    """The norms on cuda:0, then on cuda:1 in the same process, every shape: the same output,
    statistics, FP8 bytes and gradients on both. A kernel that needs more than 48 KiB of shared
    memory must be allowed it on each device (cudaFuncSetAttribute acts on the current device);
    with one process-wide flag, the second device's launches failed."""
    scale = torch.full((1,), 2.0)
    for rows, cols in SHAPES:
        x, gamma, beta = make_inputs(rows, cols, dtype, rms=False, seed=3)
        dz = torch.randn(rows, cols, generator=torch.Generator().manual_seed(4)).to(dtype)
        got = []
        for d in range(2):
            with torch.cuda.device(d):
                dev = torch.device("cuda", d)
                f = run_fwd(x.to(dev), gamma, beta, False, False, "E4M3", scale)
                b = _C.norm_backward(
                    dz.to(dev), x.to(dev), f.mu, f.rsigma, gamma.to(dev), has_beta=True, rms=False
                )
                got.append([f.out, f.mu, f.rsigma, f.out_fp8, *b])
        for a, c in zip(*got):
            assert torch.equal(as_bytes(a), as_bytes(c)), (rows, cols)
