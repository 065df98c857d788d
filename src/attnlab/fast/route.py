"""The route the fast twins take on this machine: CPU vendor and flags, bf16 units, oneDNN.

Read once from Linux's /proc/cpuinfo (empty answers elsewhere) and from the PyTorch build.
Two choices follow from it. Which library computes the training products (fast/linear.py):
oneDNN on AMD CPUs with AVX-512, MKL elsewhere, each the faster one where measured. And
whether bf16 autocast can be fast: PyTorch's bf16 products beat its fp32 ones only where the
CPU multiplies bf16 faster than fp32, with AMX or with AMD's avx512_bf16; elsewhere (no bf16
instructions, or Intel's avx512_bf16 without AMX) the fast twins compute autocast's bf16
products with the fp32 kernel. The choice follows the CPU, not a timing, so every run on a
machine computes the same floats (resume stays bit-exact).
"""

from __future__ import annotations

import functools

import torch

CPUINFO = "/proc/cpuinfo"
AMX_BF16, AVX512_BF16 = "amx_bf16", "avx512_bf16"  # bf16 matrix instructions


def cpu_field(name: str, cpuinfo: str = CPUINFO) -> str:
    """The first processor's value of a /proc/cpuinfo field (e.g. "vendor_id"), or "" if unknown."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_vendor(cpuinfo: str = CPUINFO) -> str:
    """The CPU's vendor id (e.g. "AuthenticAMD", "GenuineIntel"), or "" where unknown."""
    return cpu_field("vendor_id", cpuinfo)


@functools.cache
def fast_bf16_matmul(cpuinfo: str = CPUINFO) -> bool | None:
    """Whether PyTorch's bf16 products beat fp32 here (AMX; avx512_bf16 on AMD); None if unknown."""
    flags = cpu_field("flags", cpuinfo).split()
    if not flags:
        return None
    if AMX_BF16 in flags:
        return True
    return AVX512_BF16 in flags and cpu_vendor(cpuinfo) == "AuthenticAMD"


@functools.cache
def onednn_trains_faster() -> bool:
    """Whether training products take oneDNN here: on AMD CPUs with AVX-512, where it beat MKL."""
    return cpu_vendor() == "AuthenticAMD" and "avx512f" in cpu_field("flags").split()


@functools.cache
def has_onednn() -> bool:
    """Whether this PyTorch build has oneDNN's linear product (the training twin's route)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def describe_route() -> dict[str, str]:
    """The route as named facts: CPU vendor, bf16 units, training products' library, device."""
    fast_bf16 = fast_bf16_matmul()
    bf16 = {
        True: "fast bf16 products (AMX or AMD avx512_bf16)",
        False: "no fast bf16 products: bf16 autocast's products by the fp32 kernel",
        None: "unknown (no /proc/cpuinfo)",
    }[fast_bf16]
    return {
        "cpu": cpu_vendor() or "unknown",
        "bf16": bf16,
        "products": "oneDNN" if onednn_trains_faster() else "MKL",
        "onednn": "yes" if has_onednn() else "no",
        "device": "cuda (plain path there)" if torch.cuda.is_available() else "cpu",
    }


def route_line() -> str:
    """describe_route() as one log line."""
    return "route: " + ", ".join(f"{k} {v}" for k, v in describe_route().items())
