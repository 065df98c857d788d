"""attnlab.cpu: fields of /proc/cpuinfo, read from files written the way Linux writes them."""

from __future__ import annotations

from pathlib import Path

from attnlab.cpu import cpu_field, cpu_vendor, has_bf16_matmul

INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni

processor\t: 1
vendor_id\t: GenuineIntel
"""


def test_fields_of_the_first_processor(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(INTEL)
    assert cpu_vendor(str(info)) == "GenuineIntel"
    assert cpu_field("model", str(info)) == "207"
    assert cpu_field("cpu family", str(info)) == "6"
    assert cpu_field("microcode", str(info)) == ""
    assert cpu_vendor(str(tmp_path / "missing")) == ""


def test_bf16_matmul_from_the_flags(tmp_path: Path) -> None:
    without = tmp_path / "without"
    without.write_text(INTEL)  # AVX-512 but neither avx512_bf16 nor amx_bf16
    assert has_bf16_matmul(str(without)) is False
    amd = tmp_path / "amd"
    amd.write_text("vendor_id\t: AuthenticAMD\nflags\t\t: avx2 avx512f avx512_bf16\n")
    assert has_bf16_matmul(str(amd)) is True
    amx = tmp_path / "amx"
    amx.write_text("flags\t\t: avx512f amx_tile amx_bf16 amx_int8\n")
    assert has_bf16_matmul(str(amx)) is True
    assert has_bf16_matmul(str(tmp_path / "missing")) is None  # not Linux: unknown
