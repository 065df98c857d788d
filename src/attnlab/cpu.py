"""What this CPU is and can do, read from Linux's /proc/cpuinfo (empty answers elsewhere).

Two choices depend on it: which library computes the training products (nn/linear.py:
oneDNN on AMD with AVX-512, MKL elsewhere, each the faster one where measured), and whether
bf16 autocast can be fast. PyTorch's bf16 products beat its fp32 ones only where the CPU
multiplies bf16 faster than fp32: with AMX, and with AMD's avx512_bf16 (a bert-small step
1.7-2.2x faster than fp32 on a Zen 4 host). Without the instructions PyTorch emulates them
(about 4x slower than fp32), and Intel's avx512_bf16 without AMX was slower than fp32 too
(bert-small's products forward and backward at 0.65-0.68x the fp32 kernel's speed, a 2-core
Xeon, bench/RESULTS.md). There attnlab computes the bf16 products with the fp32 kernel
(nn/linear.py) and the trainer notes that bf16 is no faster than fp32.
"""

from __future__ import annotations

import functools

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
