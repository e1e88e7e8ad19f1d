/* The record layouts host_sampler.c's thread writes (and snapshot() hands to Python as packed records). */
#ifndef HOTLOOP_HOST_SAMPLER_H
#define HOTLOOP_HOST_SAMPLER_H

#include <stdint.h>

#define HL_HOST_MAX_GIVEN 1024     /* pids set_pids() may name */
#define HL_HOST_PROCS_PER_TICK 16 /* the process ring's size, in ticks' worth of this many processes */

/* One tick: the process tree's sums and the machine. Bytes; CLOCK_MONOTONIC seconds. */
typedef struct {
    double t;
    uint64_t tree_pss, tree_rss, tree_uss, tree_swap; /* over this process and every watched one */
    uint64_t main_pss, main_rss, main_locked;         /* this process alone */
    uint64_t available, swap_used;                    /* the machine: MemAvailable, SwapTotal - SwapFree */
    uint32_t processes;                               /* how many were read this tick */
    uint16_t unreadable;                              /* how many were there and could not be read */
    uint16_t whole;                                   /* 1: every process's PSS read at this tick (a peak may be
                                                         one); 0: RSS read, PSS carried from an earlier tick */
} hl_host_sample;

/* One process in one tick. */
typedef struct {
    double t;
    int32_t pid, ppid;
    uint64_t rss, pss, uss, swap;
} hl_proc_sample;

#endif
