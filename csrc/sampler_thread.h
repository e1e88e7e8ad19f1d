/* The thread skeleton both samplers share (monitor.c's NVML sampler, host_sampler.c's /proc sampler): a lock,
   a C thread woken on a monotonic clock, fork handlers, and the tick that keeps its rate. */
#ifndef HOTLOOP_SAMPLER_THREAD_H
#define HOTLOOP_SAMPLER_THREAD_H

#include <pthread.h>
#include <stdint.h>

typedef struct hl_sampler_thread {
    pthread_mutex_t lock; /* guards the owner's rings and statistics, and `stopping` */
    pthread_cond_t wake;  /* signalled by stop(): a sleeping thread ends at once, not at its next tick */
    pthread_t thread;
    int running;  /* the thread exists (0 in a forked child, which has none of the parent's threads) */
    int stopping; /* guarded by lock */
    int registered;
    int idles;  /* set by the owner: the thread sleeps while no window is open (`windows` is 0) */
    int windows; /* open windows, guarded by lock */
    struct hl_sampler_thread *prev, *next; /* every live sampler, for the fork handlers */
} hl_sampler_thread;

int64_t hl_now_ns(void); /* CLOCK_MONOTONIC: time.monotonic() on Linux, so Python places its events on the same axis */
double hl_seconds(int64_t ns);

/* Ready `t` (its lock, its condition on the monotonic clock) and register it for the fork handlers. 0 or -1. */
int hl_sampler_init(hl_sampler_thread *t);
/* Stop it if running and unregister it. Without the GIL. */
void hl_sampler_destroy(hl_sampler_thread *t);
/* Start the thread on `body(arg)`. 0, or an errno value. */
int hl_sampler_start(hl_sampler_thread *t, void *(*body)(void *), void *arg);
/* Ask the thread to end, wake it and join it; nothing when not running. Without the GIL. */
void hl_sampler_stop(hl_sampler_thread *t);
/* Whether stop() asked (the thread's loop condition). */
int hl_sampler_stopping(hl_sampler_thread *t);
/* Sleep until `deadline` (hl_now_ns()) or until stop() asks, whichever comes first; with `idles`, for as long as
   no window is open too. 1 when it waited for a window (the caller starts its deadlines afresh), else 0. */
int hl_sampler_sleep_until(hl_sampler_thread *t, int64_t deadline);
/* A window opens or closes (under the lock): an idle thread wakes for the first. */
void hl_sampler_window_opened(hl_sampler_thread *t);
void hl_sampler_window_closed(hl_sampler_thread *t);
/* The tick after `next` on the grid of `interval` that is still ahead of now: absolute deadlines keep the rate,
   and the ticks that could not be kept are skipped and added to `*missed` (under the lock). */
int64_t hl_sampler_next_tick(hl_sampler_thread *t, int64_t next, int64_t interval, uint64_t *missed);

#endif
