"""The prefetch thread: it tops an epoch up between next() calls (thread.py), and makes a batch
maker's batches where they become ready, outside the epoch's lock (making.py)."""
