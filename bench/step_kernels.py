"""Where a profiled training step's GPU time goes: the kernels of a torch.profiler Chrome trace (the trainer's
[profiling] writes one), summed by name and by kind, per profiled step.

Kinds: nsa_triton (the NSA op's own Triton kernels, components/nsa/triton), attention (flash, cuDNN or other
fused attention), matmul (cuBLAS / CUTLASS GEMMs), compiled (inductor's generated Triton kernels, FlexAttention's
and max-autotune's matmul templates among them), communication (NCCL), memory (copies and fills) and other (eager
torch kernels: sorts, scans, elementwise ops).
"""

from __future__ import annotations

import gzip
import importlib
import json
import pkgutil
import re
from collections import defaultdict
from functools import lru_cache

KINDS = ("nsa_triton", "attention", "matmul", "compiled", "communication", "memory", "other")
_ATTENTION = re.compile(r"flash|fmha|cudnn|attention|attn", re.I)
_MATMUL = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|wgmma|splitk", re.I)


@lru_cache(maxsize=1)
def nsa_kernel_names() -> frozenset[str]:
    """The names of the Triton kernels under components/nsa/triton (as a trace names their launches)."""
    import components.nsa.triton as package

    names = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for value in vars(module).values():
            fn = getattr(value, "fn", None)  # a @triton.jit function wraps the Python one
            name = getattr(fn, "__name__", "")
            if callable(fn) and name.endswith("_kernel") and getattr(fn, "__module__", "") == module.__name__:
                names.add(name)
    return frozenset(names)


def kind_of(name: str, category: str) -> str:
    if category in ("gpu_memcpy", "gpu_memset"):
        return "memory"
    if name in nsa_kernel_names():
        return "nsa_triton"
    if "nccl" in name.lower():
        return "communication"
    if name.startswith("triton_"):  # inductor names its kernels triton_poi_ / triton_red_ / triton_per_ ...
        return "compiled"
    if _ATTENTION.search(name):
        return "attention"
    if _MATMUL.search(name):
        return "matmul"
    return "other"


def read_trace(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        data = json.load(fh)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(path: str, top: int = 15) -> dict:
    """Per profiled step: the GPU's kernel time, the step's time on the host (step_ms), the kernel time by kind
    and the `top` kernels (name, kind, ms, calls). A CPU-only trace has no kernels: its gpu_ms is 0."""
    events = read_trace(path)
    # The host's step spans; on CUDA each also has a copy on the GPU's timeline (gpu_user_annotation, one per
    # stream), which is not a step of its own.
    steps = sorted((e for e in events if e.get("cat") == "user_annotation"
                    and str(e.get("name", "")).startswith("ProfilerStep#") and "dur" in e), key=lambda e: e["ts"])
    count = max(1, len(steps))
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    kinds = dict.fromkeys(KINDS, 0.0)
    for e in events:
        category = e.get("cat", "")
        if category not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        name = str(e.get("name", ""))
        kind = kind_of(name, category)
        ms = e["dur"] / 1e3
        kinds[kind] += ms
        entry = by_name[(name, kind)]
        entry[0] += ms
        entry[1] += 1
    gpu_ms = sum(kinds.values())
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return {
        "steps": [int(e["name"].split("#", 1)[1]) for e in steps if e["name"].split("#", 1)[1].isdigit()],
        "step_ms": sum(e["dur"] for e in steps) / 1e3 / count if steps else None,
        "gpu_ms": gpu_ms / count,
        "kinds": {kind: ms / count for kind, ms in kinds.items()},
        "kernels": [{"name": name, "kind": kind, "ms": ms / count, "calls": calls / count}
                    for (name, kind), (ms, calls) in ranked],
    }
