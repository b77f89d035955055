"""Shrinking a failing configuration of the gradient-accounting property test
(property_worker.py --shrink) to a minimal one that fails alike."""

from __future__ import annotations

import json


def signature(res) -> str:
    """What kind of failure a result is, to keep while shrinking: the status and the mismatch's
    kind or the exception's class and first words."""
    if res["status"] == "fail":
        return "fail: " + res["mismatch"]["what"].replace(" shard", "")
    if res["status"] in ("error", "rejected"):
        msg = res["error"]
        return res["status"] + ": " + " ".join(msg.replace("'", " ").split()[:4])
    return res["status"]


def _drop_fp8(c, i):
    """c without fp8 module i (when nothing refers to it), indices renumbered."""

    def ref(kind, j):
        return kind == "fp8" and j == i

    if any(ref(*op) for op in c["ops"]) or any(ref(*s) for t in c["ties"] for s in t):
        return None
    if any(ref(f[0], f[1]) for f in c["frozen"]):
        return None
    d = json.loads(json.dumps(c))
    del d["fp8_mods"][i]
    fix = lambda s: [s[0], s[1] - 1] + s[2:] if s[0] == "fp8" and s[1] > i else s  # noqa: E731
    d["ops"] = [fix(o) for o in d["ops"]]
    d["ties"] = [[fix(a), fix(b)] for a, b in d["ties"]]
    d["frozen"] = [fix(f) for f in d["frozen"]]
    return d if d["fp8_mods"] else None


def _drop_simple(c, key, kind, i):
    """c without torch.nn.Linear / plain parameter i (when nothing refers to it)."""

    def ref(s):
        return s[0] == kind or (
            kind == "plain" and s[0] in ("plain_linear", "plain_matmul", "embed")
        )

    if any(ref(o) and o[1] == i for o in c["ops"]):
        return None
    if any(s[0] == kind and s[1] == i for t in c["ties"] for s in t):
        return None
    if any(f[0] == kind and f[1] == i for f in c["frozen"]):
        return None
    d = json.loads(json.dumps(c))
    if key == "n_plain":
        d["n_plain"] -= 1
    else:
        del d[key][i]
    fix = lambda s: [s[0], s[1] - 1] + s[2:] if ref(s) and s[1] > i else s  # noqa: E731
    d["ops"] = [fix(o) for o in d["ops"]]
    d["ties"] = [[fix(a), fix(b)] for a, b in d["ties"]]
    d["frozen"] = [fix(f) for f in d["frozen"]]
    return d


def shrink_candidates(c):
    """Simpler variants of c, roughly most simplifying first."""

    def with_(**kw):
        d = json.loads(json.dumps(c))
        d.update(kw)
        return d

    out = []
    if c["fp8"]:
        out.append(with_(fp8=False))
    if c["n_mb"] > 1:
        out.append(with_(n_mb=1))
        out.append(with_(n_mb=c["n_mb"] - 1))
    if c["steps"] > 1:
        out.append(with_(steps=1))
    if c["defer_p"]:
        out.append(with_(defer_p=0.0))
    if c["forget_dw"]:
        out.append(with_(forget_dw=False))
    if c.get("is_first_microbatch", "k==0") != "k==0":
        out.append(with_(is_first_microbatch="k==0"))
    for i in range(len(c["ops"])):
        if len(c["ops"]) > 1:
            d = with_()
            del d["ops"][i]
            del d["residual"][i]
            if "when" in d:
                del d["when"][i]
            out.append(d)
    for i in range(len(c["fp8_mods"])):
        d = _drop_fp8(c, i)
        if d:
            out.append(d)
    for i in range(len(c["tl_mods"])):
        d = _drop_simple(c, "tl_mods", "tl", i)
        if d:
            out.append(d)
    for i in range(c["n_plain"]):
        d = _drop_simple(c, "n_plain", "plain", i)
        if d:
            out.append(d)
    for i in range(len(c["ties"])):
        d = with_()
        del d["ties"][i]
        out.append(d)
    for i in range(len(c["frozen"])):
        d = with_()
        del d["frozen"][i]
        out.append(d)
    for i, w in enumerate(c.get("when", [])):
        if w != "all":
            d = with_()
            d["when"][i] = "all"
            out.append(d)
    for i, r in enumerate(c["residual"]):
        if r:
            d = with_()
            d["residual"][i] = False
            out.append(d)
    for i, m in enumerate(c["fp8_mods"]):
        for key, val in (("kind", "Linear"), ("bias", False), ("fuse", False), ("delay", False)):
            if m[key] != val:
                d = with_()
                d["fp8_mods"][i][key] = val
                if val == "Linear":
                    d["fp8_mods"][i].update(norm=None, ret_ln=False, zcg=False, res_in=False)
                    d["frozen"] = [
                        f
                        for f in d["frozen"]
                        if not (f[0] == "fp8" and f[1] == i and f[2].startswith("layer"))
                    ]
                out.append(d)
    if c.get("input_3d"):
        out.append(with_(input_3d=False))
    for i, m in enumerate(c["fp8_mods"]):
        for key in ("ret_ln", "zcg", "zero_out_wgrad", "res_in", "out_act", "in_act"):
            if m.get(key):
                d = with_()
                d["fp8_mods"][i][key] = False
                out.append(d)
    for i, m in enumerate(c["tl_mods"]):
        if m["bias"]:
            d = with_()
            d["tl_mods"][i]["bias"] = False
            out.append(d)
    if c["ddp"].get("overlap_param_gather"):
        d = with_()
        d["ddp"]["overlap_param_gather"] = False
        out.append(d)
    for key in (
        "overlap_grad_reduce",
        "use_distributed_optimizer",
        "average_in_collective",
        "grad_reduce_in_fp32",
        "grad_ledger",
        "check_for_nan_in_grad",
        "defer_nan_check",
    ):
        if c["ddp"].get(key):
            d = with_()
            d["ddp"][key] = False
            if key == "use_distributed_optimizer":
                d["ddp"]["overlap_param_gather"] = False
            if key in ("use_distributed_optimizer", "check_for_nan_in_grad"):
                d["ddp"]["defer_nan_check"] = False  # it needs both
            out.append(d)
    if c["D"] != 16:
        d = with_(D=16)
        d["ddp"]["bucket_size"] = min(d["ddp"]["bucket_size"], 5 * 256)
        out.append(d)
    return out


def shrink(runner, c, sig, budget=150):
    """Greedy: take the first simpler variant that still fails with signature `sig` on some rank
    (runner: property_run.Runner), until none does (or `budget` runs)."""
    runs = 0
    improved = True
    while improved and runs < budget:
        improved = False
        for d in shrink_candidates(c):
            runs += 1
            if runner.anywhere(signature(runner.run(d)) == sig):
                c, improved = d, True
                break
            if runs >= budget:
                break
    return c
