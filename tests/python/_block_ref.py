"""Independent float64 references of Float8BlockScaling's casts and GEMMs (tests only).

Everything is computed in float64 from the float32 values and rounded to float32 where the C++
kernel rounds: fp8_max / amax and x * scale are single float32 operations, and a float32 result
computed in float64 and rounded once is the correctly rounded one (53 >= 2 * 24 + 2 bits for / and
*). The FP8 rounding itself is torch's float32 -> float8 conversion (round to nearest even) after a
clamp to the format's range (the kernel saturates, torch's conversion would give NaN).
"""

import math

import torch

FP8 = {"E4M3": (torch.float8_e4m3fn, 448.0), "E5M2": (torch.float8_e5m2, 57344.0)}
FLT_MAX = torch.finfo(torch.float32).max


def ceil128(n):
    return (n + 127) // 128


def tile_scale(amax, fmax, power_2_scale=True, amax_epsilon=0.0):
    """float32 scale of one tile (block_quantize.h's rule), as a Python float."""
    if math.isnan(amax) or math.isinf(amax):
        return 1.0
    a = max(amax, torch.tensor(amax_epsilon, dtype=torch.float32).item())  # a float32 field
    if not a > 0:
        return 1.0
    s = torch.tensor(fmax / a, dtype=torch.float64).float().item()
    if math.isinf(s):
        s = FLT_MAX
    if power_2_scale:
        s = 2.0 ** math.floor(math.log2(s))
    return s


def fp8_bytes(v32, fmt):
    """FP8 bytes (uint8) of float32 values already multiplied by the scale: saturate(rne(v))."""
    dt, fmax = FP8[fmt]
    return v32.clamp(-fmax, fmax).to(dt).view(torch.uint8)


def quantize_rows(x, fmt, p2=True, eps=0.0):
    """1x128 tiles along each row of 2-D x: (bytes [r, c], scale_inv [r, ceil(c/128)])."""
    x32 = x.float()
    rows, cols = x32.shape
    _, fmax = FP8[fmt]
    out = torch.empty(rows, cols, dtype=torch.uint8)
    sinv = torch.empty(rows, ceil128(cols))
    for r in range(rows):
        for t in range(ceil128(cols)):
            seg = x32[r, t * 128 : (t + 1) * 128]
            s = tile_scale(seg.double().abs().max().item(), fmax, p2, eps)
            out[r, t * 128 : (t + 1) * 128] = fp8_bytes((seg.double() * s).float(), fmt)
            sinv[r, t] = torch.tensor(1.0 / s, dtype=torch.float64).float()
    return out, sinv


def quantize_blocks(x, fmt, p2=True, eps=0.0):
    """128x128 blocks of 2-D x: (bytes [r, c], scale_inv [ceil(r/128), ceil(c/128)])."""
    x32 = x.float()
    rows, cols = x32.shape
    _, fmax = FP8[fmt]
    out = torch.empty(rows, cols, dtype=torch.uint8)
    sinv = torch.empty(ceil128(rows), ceil128(cols))
    for i in range(ceil128(rows)):
        for j in range(ceil128(cols)):
            blk = x32[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            s = tile_scale(blk.double().abs().max().item(), fmax, p2, eps)
            out[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = fp8_bytes(
                (blk.double() * s).float(), fmt
            )
            sinv[i, j] = torch.tensor(1.0 / s, dtype=torch.float64).float()
    return out, sinv


def decode(u8, fmt):
    """float64 values of FP8 bytes."""
    return u8.view(FP8[fmt][0]).double()


def dequant_rows(u8, sinv, fmt):
    """float64 x ≈ bytes * scale_inv of 1x128 tiles."""
    rep = sinv.double().repeat_interleave(128, dim=1)[:, : u8.shape[1]]
    return decode(u8, fmt) * rep


def dequant_blocks(u8, sinv, fmt):
    rep = sinv.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return decode(u8, fmt) * rep[: u8.shape[0], : u8.shape[1]]


def gemm_bound(a64, b64):
    """FP32 GEMM error bound of a · bᵀ (float64 operands that are exact in float32 products):
    gamma_(k+2) * |a| · |b|ᵀ, gamma_j = j u / (1 - j u), u = 2^-24 (summation of k products plus
    the per-tile scaling and the output rounding)."""
    k = a64.shape[1]
    u = 2.0**-24
    g = (k + 2) * u / (1 - (k + 2) * u)
    return g * (a64.abs() @ b64.abs().T)
