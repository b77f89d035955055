"""Which memory layout SDPA's backward gives dq / dk / dv when q, k, v are views of one packed
[seq, batch, 3, heads, head_dim] projection (the GPT model's split_qkv), per backend.

If the gradients arrive token-major ([seq, batch, heads, head_dim] in memory), the QKV projection's
gradient cast could read them in place instead of autograd stacking them into one [tokens, 3 * hidden]
tensor first. Prints each backend's strides and the stacking kernels' time. Needs a GPU.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def probe(backend, s=1024, b=16, h=12, hd=128):
    qkv = torch.randn(s, b, 3 * h * hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    parts = qkv.view(s, b, 3, h, hd).unbind(2)
    q, k, v = (t.permute(1, 2, 0, 3) for t in parts)
    seen = {}
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        t.register_hook(lambda g, name=name: seen.__setitem__(name, (tuple(g.shape), g.stride())))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    seen["o"] = (tuple(out.shape), out.stride())
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    return seen


if __name__ == "__main__":
    for backend in (
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
    ):
        try:
            print(backend, probe(backend), flush=True)
        except RuntimeError as e:
            print(backend, "unavailable:", str(e).splitlines()[0])
