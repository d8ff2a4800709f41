"""Sizes on the benchmark's command line and in its tables: ``parse_size("16M")`` and ``fmt_bytes``. Every op module
and the driver import them from here (the op modules import nothing of the driver)."""
from __future__ import annotations

__all__ = ["parse_size", "fmt_bytes"]

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"16M"`` -> 16 MiB in bytes (suffixes K, M, G, with an optional ``iB`` / ``B``; plain numbers are bytes)."""
    text = text.strip().upper().rstrip("IB")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def fmt_bytes(nbytes: int) -> str:
    """``16777216`` -> ``"16 MiB"`` (the largest unit that divides it exactly, else bytes)."""
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]} {unit}iB"
    return f"{nbytes} B"
