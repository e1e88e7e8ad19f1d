/* The C reference's worker threads (csrc/thread_pool.c): a parallel for over a pass's chunks. */
#ifndef HOTLOOP_THREAD_POOL_H
#define HOTLOOP_THREAD_POOL_H

#include <stdint.h>

/* does items [first, end) of a pass */
typedef void (*hl_range_fn)(void *ctx, int64_t first, int64_t end);

/* fn over items [0, n), in runs of consecutive items taken in turn by up to `threads` threads (the
   caller's included, never more than one per `min_per_thread` items): fn must give the same result
   whichever thread runs an item, and however the items are cut into runs. Returns when every item
   is done. Threads come from one process-wide pool, started on first use and woken per call; a
   caller that finds the pool busy (another thread's pass) does its items alone. Runs without the
   GIL. */
void hl_parallel_for(int64_t n, int threads, int64_t min_per_thread, hl_range_fn fn, void *ctx);

#endif
