"""The worker process: the loop that runs dataset[i] and writes batches into the ring (loop.py), its
rows, its RNG states, and what a forked child does first (inherited_garbage.py)."""
