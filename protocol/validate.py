"""The checks every protocol message runs on its fields, written once for the engine protocol (``messages``), the
control lines (``control``) and the cluster state (``cluster``).

A failed check raises ``ProtocolError``: readers log the frame or line and drop it, and a process never acts on a
malformed value. The ``is_*`` predicates only answer; ``check`` turns a false answer into the error.
"""

from __future__ import annotations

from collections.abc import Callable


class ProtocolError(ValueError):
    """A frame or field that does not follow the protocol. ``request_id`` is set when known."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


def check(cond: bool, what: str) -> None:
    """Raise ``ProtocolError(what)`` unless ``cond`` holds."""
    if not cond:
        raise ProtocolError(what)


def is_int(v: object, lo: int | None = None, hi: int | None = None) -> bool:
    """An int (a bool is not one) in ``lo <= v < hi``, each bound only where given."""
    return isinstance(v, int) and not isinstance(v, bool) and (lo is None or lo <= v) and (hi is None or v < hi)


def is_uint(v: object, hi: int = 1 << 31) -> bool:
    """A non-negative int below ``hi``: a count, an index, a pid (below 2**31 unless said otherwise)."""
    return is_int(v, 0, hi)


def is_num(v: object) -> bool:
    """An int or a float (a bool is not one); NaN passes, so range checks after it must reject it (they do:
    every comparison with NaN is false)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_nonneg(v: object) -> bool:
    """A number of at least zero: seconds, a fraction (NaN fails)."""
    return is_num(v) and v >= 0  # type: ignore[operator]


def is_str(v: object, limit: int = 4096, empty: bool = False) -> bool:
    """A str of at most ``limit`` characters, and not empty unless ``empty``."""
    return isinstance(v, str) and (empty or len(v) > 0) and len(v) <= limit


def optional(v: object, test: Callable[[object], bool]) -> bool:
    """``None`` (a field left off the wire), or a value that passes ``test``."""
    return v is None or test(v)
