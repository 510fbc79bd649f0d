"""Byte sizes: parsed once from "64GiB"-style strings, formatted for people. Pure."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_UNITS = {"": 1, "b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


def parse_size(text: str | int) -> int:
    """Bytes in "64GiB", "1.5GiB", "512MB", "4096"; binary and decimal units; rounds down."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a size")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"{text} is negative; sizes are >= 0")
        return text
    match = _SIZE_RE.fullmatch(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (units: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    if not unit and "." in match.group(1):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    try:
        return int(Decimal(match.group(1)) * _UNITS[unit])
    except InvalidOperation:
        raise ValueError(f"{text!r} is not a size") from None


def format_size(n: int) -> str:
    """"512 B", "64.0 KiB", "1.0 GiB": the largest binary unit that keeps the number >= 1."""
    for name, unit in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= unit:
            return f"{n / unit:.1f} {name}"
    return f"{n} B"
