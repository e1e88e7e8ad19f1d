"""How long the training loops of this process waited for their input batches, and how much host
shared memory the DataLoaders' rings hold: hotloop.DataLoader adds to it, the memory report reads it.
Published counters, so that neither imports the other."""

_totals = {"wait_seconds": 0.0, "batches": 0, "samples": 0}
_ring_bytes = [0]  # of the rings alive now
_windows = {}  # token -> the most ring bytes alive at once while that window was open


def add(seconds: float, samples: int) -> None:
    """One batch handed out after the consumer waited `seconds` for it inside next()."""
    _totals["wait_seconds"] += seconds
    _totals["batches"] += 1
    _totals["samples"] += samples


def snapshot() -> dict:
    """The totals so far: wait_seconds (time consumers spent inside next()), batches and samples."""
    return dict(_totals)


def ring_made(nbytes: int) -> None:
    """A loader's ring of `nbytes` of shared memory now exists."""
    _ring_bytes[0] += nbytes
    for token, peak in _windows.items():
        _windows[token] = max(peak, _ring_bytes[0])


def ring_gone(nbytes: int) -> None:
    _ring_bytes[0] -= nbytes


def open_window() -> object:
    """Start watching the rings' size: close_window(token) says the most they held meanwhile."""
    token = object()
    _windows[token] = _ring_bytes[0]
    return token


def close_window(token) -> int:
    return _windows.pop(token, 0)
