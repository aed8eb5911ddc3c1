"""Parsing and printing quantities with units (bytes, seconds, FLOP/s)."""

from __future__ import annotations

import math
import re

from dsauto.errors import DsautoError

GiB = 1024**3
MiB = 1024**2

_BYTE_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "pb": 1000**5,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
}
# A bare K, M, G, T or P (and Kubernetes' Ki, Mi, Gi, Ti, Pi) are binary, as Slurm's --mem and
# Docker's --memory read them; the byte count is printed back, so the reading is never hidden.
_BYTE_UNITS.update({unit[0]: size for unit, size in _BYTE_UNITS.items() if unit.endswith("ib")})
_BYTE_UNITS.update({unit[:2]: size for unit, size in _BYTE_UNITS.items() if unit.endswith("ib")})

MAX_BYTES = 1024**6
"""Largest size :func:`parse_bytes` accepts (1 EiB): anything beyond is a typo, not a device."""


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """Parses ``"60GiB"``, ``"80 GB"``, ``"80G"`` (binary, as Slurm reads it) or ``"512MiB"``; a
    number (not text) is a count of bytes. Text needs its unit: a bare ``80`` is refused rather than
    read as 80 bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if not math.isfinite(text) or not 0 < text <= MAX_BYTES:
            raise DsautoError(f"The {what} must be a positive number of bytes up to {MAX_BYTES} (1 EiB), "
                              f"got {text}.")
        return int(text)
    example = "write a number with a unit such as 60GiB, 80GB (10^9 bytes each) or 80G (binary, as GiB)"
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match:
        raise DsautoError(f"Cannot read the {what} {text!r}: {example}.")
    unit = match.group(2).lower()
    if not unit:
        raise DsautoError(f"The {what} {text!r} has no unit; {example} ({match.group(1)}B if you "
                          f"mean bytes).")
    if unit not in _BYTE_UNITS:
        raise DsautoError(f"Cannot read the {what} {text!r}: unknown unit {match.group(2)!r}; {example}.")
    value = float(match.group(1)) * _BYTE_UNITS[unit]
    if not 1 <= value <= MAX_BYTES:
        size = "less than one byte" if value < 1 else "more than 1 EiB"
        raise DsautoError(f"The {what} {text!r} is {size}; give a size from 1B to 1EiB.")
    return int(value)


def number_problem(value: float, minimum: float | None = None, maximum: float | None = None,
                   above: float | None = None) -> str | None:
    """Why ``value`` is not a finite number in range (``minimum`` <= value <= ``maximum``,
    ``above`` < value), as words to follow a field's name ("must be above 0"); None when it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "must be a finite number"
    if above is not None and not value > above:
        return f"must be above {_number_text(above)}"
    if minimum is not None and value < minimum:
        return f"must be at least {_number_text(minimum)}"
    if maximum is not None and value > maximum:
        return f"must be at most {_number_text(maximum)}"
    return None


def _number_text(value: float) -> str:
    """A bound as people write it: whole numbers in full, others short (``1e+19``, ``0.5``)."""
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e16 else f"{value:g}"


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


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun``, in the plural unless the count is one: "1 device", "2 studies"."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


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
