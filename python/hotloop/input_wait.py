"""How long the training loops of this process waited for their input batches: hotloop.DataLoader
adds to it, the memory report reads it. A published counter, so that neither imports the other."""

_totals = {"wait_seconds": 0.0, "batches": 0, "samples": 0}


def add(seconds: float, samples: int) -> None:
    """One batch handed out after the consumer waited `seconds` for it inside next()."""
    _totals["wait_seconds"] += seconds
    _totals["batches"] += 1
    _totals["samples"] += samples


def snapshot() -> dict:
    """The totals so far: wait_seconds (time consumers spent inside next()), batches and samples."""
    return dict(_totals)
