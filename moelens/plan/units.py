"""Sizes in words, for the printout and for the placement's messages."""

from __future__ import annotations


def human(n: float) -> str:
    """Bytes in decimal units, as disks and GPU spec sheets print them."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def human_count(n: int) -> str:
    """A count for people: 102.65B, 2.05M, 3.20k, or the number itself under a thousand."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)
