"""Byte sizes: parsed once from "64GiB"-style strings, formatted for people. Pure."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

#: Binary units (and bytes), read in any case: "64GiB", "64gib", "4096", "4096B".
_BINARY = {"": 1, "b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}
#: Decimal units, read only as written here (the SI spellings, "kB" included): "256MB" is
#: 256,000,000 bytes, as df -H, disk vendors and the SI read it.
_DECIMAL = {"kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


class AmbiguousSize(ValueError):
    """A decimal unit in another case ("256mb", "1Gb"), which other tools read otherwise:
    Redis reads "256mb" (in any case) as 256 MiB, and "Mb" is commonly megabits. Rather than
    guess (a 4.6% difference at MiB, 7% at GiB), parse_size refuses it and names both
    spellings it would take."""


def parse_size(text: str | int) -> int:
    """Bytes in "64GiB", "1.5GiB", "512MB", "4096"; binary units (KiB, MiB, GiB, TiB) in any
    case, decimal ones (kB/KB, MB, GB, TB) only so spelled (AmbiguousSize otherwise: "256mb");
    rounds down."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a size")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"{text} is negative; sizes are >= 0")
        return text
    match = _SIZE_RE.fullmatch(str(text))
    written = match.group(2) if match else ""
    if match and written not in _DECIMAL and written.lower() in ("kb", "mb", "gb", "tb"):
        number, prefix = match.group(1), written[0].upper()
        power = " KMGT".index(prefix)
        raise AmbiguousSize(f"{text!r} is ambiguous: write {number}{prefix}B (decimal, "
                            f"10^{3 * power} bytes a {prefix}B) or {number}{prefix}iB (binary, "
                            f"2^{10 * power}: what Redis reads {written!r} as)")
    unit = _DECIMAL.get(written) or _BINARY.get(written.lower())
    if not match or unit is None:
        raise ValueError(f"{text!r} is not a size (units: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    if not written and "." in match.group(1):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    try:
        return int(Decimal(match.group(1)) * unit)
    except InvalidOperation:
        raise ValueError(f"{text!r} is not a size") from None


def format_size(n: int) -> str:
    """"512 B", "64.0 KiB", "1.0 GiB": the largest binary unit that keeps the number >= 1."""
    for name, unit in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= unit:
            return f"{n / unit:.1f} {name}"
    return f"{n} B"
