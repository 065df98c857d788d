"""attnlab.fast.route: fields of /proc/cpuinfo, read from files written the way Linux writes them."""

from __future__ import annotations

from pathlib import Path

from attnlab.fast.route import cpu_field, cpu_vendor, describe_route, fast_bf16_matmul, route_line

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


def cpuinfo(tmp_path: Path, vendor: str, flags: str) -> str:
    """A one-processor /proc/cpuinfo with that vendor and those flags; returns its path."""
    path = tmp_path / f"{vendor}-{len(list(tmp_path.iterdir()))}"
    path.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: {flags}\n")
    return str(path)


def test_fast_bf16_products_from_vendor_and_flags(tmp_path: Path) -> None:
    # Fast where measured faster than fp32: AMX, and AMD's avx512_bf16 (Zen 4).
    assert fast_bf16_matmul(cpuinfo(tmp_path, "GenuineIntel", "avx512f amx_bf16 amx_tile"))
    assert fast_bf16_matmul(cpuinfo(tmp_path, "AuthenticAMD", "avx2 avx512f avx512_bf16"))
    # Not fast: no bf16 instructions (emulated), and Intel's avx512_bf16 without AMX (slower
    # than fp32 on the 2-core Xeon of bench/RESULTS.md, whose flags these are).
    assert fast_bf16_matmul(cpuinfo(tmp_path, "GenuineIntel", "avx2 avx512f avx512_vnni")) is False
    assert fast_bf16_matmul(cpuinfo(tmp_path, "AuthenticAMD", "avx2 avx512f")) is False
    intel_bf16 = "avx512f avx512_bf16 avx512_fp16 avx512_vnni"
    assert fast_bf16_matmul(cpuinfo(tmp_path, "GenuineIntel", intel_bf16)) is False
    without = tmp_path / "without"
    without.write_text(INTEL)  # AVX-512 but neither avx512_bf16 nor amx_bf16
    assert fast_bf16_matmul(str(without)) is False
    assert fast_bf16_matmul(str(tmp_path / "missing")) is None  # not Linux: unknown


def test_the_route_is_described_in_named_facts() -> None:
    route = describe_route()
    assert set(route) == {"cpu", "bf16", "products", "onednn", "device"}
    assert route["products"] in ("oneDNN", "MKL") and route_line().startswith("route: cpu ")
