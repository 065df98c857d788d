"""What this CPU is and can do, read from Linux's /proc/cpuinfo (empty answers elsewhere).

Two choices depend on it: which library computes the training products (nn/linear.py: oneDNN
on AMD, MKL elsewhere, each the faster one where measured), and whether bf16 autocast can be
fast: without bf16 matrix instructions PyTorch emulates its bf16 products (a bert-small
pretraining step ran about 4x slower than in fp32), so attnlab computes them with the fp32
kernel instead (nn/linear.py) and the trainer notes that bf16 is no faster than fp32 there.
"""

from __future__ import annotations

import functools

CPUINFO = "/proc/cpuinfo"
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # instructions that multiply bf16 matrices natively


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
def has_bf16_matmul(cpuinfo: str = CPUINFO) -> bool | None:
    """Whether the CPU multiplies bf16 natively (avx512_bf16 or amx_bf16); None where unknown."""
    flags = cpu_field("flags", cpuinfo).split()
    if not flags:
        return None
    return any(flag in flags for flag in BF16_FLAGS)
