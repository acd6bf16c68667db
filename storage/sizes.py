"""Sizes in bytes: the one syntax every storage URL takes (``memory:SIZE``,
``file:DIR?capacity_bytes=SIZE``, Mooncake's ``segment``, ``buffer`` and ``bounce``).

A size is an int number of bytes (``8589934592``) or a number with a unit: ``B``; ``KB``,
``MB``, ``GB``, ``TB``, powers of 1000; ``KiB``, ``MiB``, ``GiB``, ``TiB``, powers of 1024. Units
are read in any case (``8gb`` is ``8GB``), a space may stand between number and unit, and a
number with a unit may have a fraction when the size is a whole number of bytes
(``1.5GiB``). A bare ``K``, ``M``, ``G`` or ``T`` is refused: tools disagree on whether it is
decimal or binary, and the difference (7% at G) is a store's capacity.
"""

from __future__ import annotations

import re
from fractions import Fraction

from kvstage.errors import InvalidArgumentError, is_int

__all__ = ["SIZE_RULE", "parse_size"]

SIZE_RULE = (
    "a size is bytes (e.g. 8589934592) or a number with a unit: B, KB, MB, GB, TB (powers of 1000) "
    "or KiB, MiB, GiB, TiB (powers of 1024), in any case (e.g. 8GB, 8GiB, 1.5GiB)"
)

_PREFIXES = "kmgt"
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b|[kmgt])?\s*", re.IGNORECASE)


def _multiplier(unit: str) -> int:
    """Bytes of one ``unit`` (lowercase, one of the units above)."""
    if unit == "b":
        return 1
    power = _PREFIXES.index(unit[0]) + 1
    return 1024**power if unit[1] == "i" else 1000**power


def parse_size(value: int | str, argument: str) -> int:
    """Bytes from an int or a size string (see the module doc for the rule).

    Args:
        value: an int >= 0 (bytes) or a string such as ``"4096"``, ``"8GB"``, ``"512MiB"``.
        argument: what the error names, e.g. ``"url: segment"`` or
            ``"storage: 'memory:8XB' capacity"``.

    Returns:
        The size in bytes, an int >= 0 (callers that need more, e.g. one page, check that).

    Raises:
        InvalidArgumentError: ``"<argument>: ..."``: a bool, float or other type; a negative
            int; a string that is no size (the message ends with :data:`SIZE_RULE`); a bare
            ``K``/``M``/``G``/``T`` (naming both spellings it may mean); a size that is not a
            whole number of bytes.
    """
    if is_int(value):
        if value < 0:
            raise InvalidArgumentError(f"{argument}: must be a size >= 0, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise InvalidArgumentError(
            f"{argument}: must be an int number of bytes or a size string, got {type(value).__name__}"
        )
    match = _SIZE.fullmatch(value)
    if match is None:
        raise InvalidArgumentError(f"{argument}: must be a size, got {value!r}; {SIZE_RULE}")
    number, unit = match.group(1), (match.group(2) or "").lower()
    if unit in ("k", "m", "g", "t"):
        power = _PREFIXES.index(unit) + 1
        upper = unit.upper()
        raise InvalidArgumentError(
            f"{argument}: {value!r} is ambiguous: write {number + upper + 'B'!r} ({number} * 1000**{power}) "
            f"or {number + upper + 'iB'!r} ({number} * 1024**{power}); {SIZE_RULE}"
        )
    if not unit and "." in number:
        raise InvalidArgumentError(f"{argument}: must be a size, got {value!r}; {SIZE_RULE}")
    size = Fraction(number) * _multiplier(unit or "b")
    if size.denominator != 1:
        raise InvalidArgumentError(f"{argument}: {value!r} is not a whole number of bytes ({float(size)!r})")
    return int(size)
