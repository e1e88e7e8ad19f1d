/* A ring of fixed-size records for the samplers (monitor.c, host_sampler.c): the oldest is overwritten
   when full and counted as dropped. Its memory comes from
   malloc (the limited API offers no PyMem_Raw* before 3.13), safe without the GIL. */
#ifndef HOTLOOP_SAMPLE_RING_H
#define HOTLOOP_SAMPLE_RING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    char *data;
    size_t item, capacity, head, count; /* head: where the next item goes */
    uint64_t dropped;
} sample_ring;

static inline int ring_init(sample_ring *r, size_t item, size_t capacity) {
    r->data = calloc(capacity, item);
    r->item = item;
    r->capacity = capacity;
    r->head = r->count = 0;
    r->dropped = 0;
    return r->data == NULL ? -1 : 0;
}

static inline void ring_free(sample_ring *r) {
    free(r->data);
    r->data = NULL;
}

static inline void ring_clear(sample_ring *r) {
    r->head = r->count = 0;
    r->dropped = 0;
}

static inline void ring_push(sample_ring *r, const void *sample) {
    memcpy(r->data + r->head * r->item, sample, r->item);
    r->head = (r->head + 1) % r->capacity;
    if (r->count < r->capacity)
        r->count++;
    else
        r->dropped++;
}

/* the kept items, oldest first, into `out` (count * item bytes) */
static inline void ring_copy(const sample_ring *r, char *out) {
    size_t start = (r->head + r->capacity - r->count) % r->capacity;
    size_t first = r->capacity - start < r->count ? r->capacity - start : r->count;
    memcpy(out, r->data + start * r->item, first * r->item);
    memcpy(out + first * r->item, r->data, (r->count - first) * r->item);
}

/* The logical index (0: the oldest kept) of the first item whose leading double (every sampler record opens
   with its time) is at least `t`; `count` when none is. The items are in time order. */
static inline size_t ring_index_at(const sample_ring *r, double t) {
    size_t start = (r->head + r->capacity - r->count) % r->capacity, lo = 0, hi = r->count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        double tm;
        memcpy(&tm, r->data + ((start + mid) % r->capacity) * r->item, sizeof(tm));
        if (tm < t)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* `n` kept items from logical index `from` on, into `out` */
static inline void ring_copy_range(const sample_ring *r, char *out, size_t from, size_t n) {
    size_t start = (r->head + r->capacity - r->count + from) % r->capacity;
    size_t first = r->capacity - start < n ? r->capacity - start : n;
    memcpy(out, r->data + start * r->item, first * r->item);
    memcpy(out + first * r->item, r->data, (n - first) * r->item);
}

#endif
