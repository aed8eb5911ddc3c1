"""Parsing and printing quantities with units (bytes, seconds, FLOP/s)."""

from __future__ import annotations

import re

from dsauto.errors import DsautoError

GiB = 1024**3
MiB = 1024**2

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """Parses ``"60GiB"``, ``"80 GB"``, ``"512MiB"`` or a plain number of bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text <= 0:
            raise DsautoError(f"The {what} must be positive, got {text}.")
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _BYTE_UNITS:
        raise DsautoError(
            f"Cannot read the {what} {text!r}: write a number with a unit such as 60GiB, 80GB or 512MiB."
        )
    value = float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()]
    if value <= 0:
        raise DsautoError(f"The {what} must be positive, got {text!r}.")
    return int(value)


def format_bytes(num_bytes: float) -> str:
    """Formats bytes in binary units, e.g. ``"61.3 GiB"``."""
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def format_seconds(seconds: float) -> str:
    """Formats a duration with a unit that keeps three significant figures readable."""
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def format_count(count: float) -> str:
    """Formats a large count with a metric suffix, e.g. ``"174.6B"``."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(count) >= size:
            return f"{count / size:.1f}{unit}"
    return f"{count:.0f}"


def format_flops(flops_per_second: float) -> str:
    """Formats a FLOP rate, e.g. ``"189.0 TFLOP/s"`` or ``"31.3 GFLOP/s"``."""
    for unit, size in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if flops_per_second >= size:
            return f"{flops_per_second / size:.1f} {unit}"
    return f"{flops_per_second / 1e6:.1f} MFLOP/s"
