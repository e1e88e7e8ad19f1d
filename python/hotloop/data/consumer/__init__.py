"""The consumer's side: what runs in the main process for next() (the iterators, one epoch's feed,
the worker pool seen from the main process, resume), in the training thread, or in the prefetch
thread under the epoch's lock on next()'s behalf."""
