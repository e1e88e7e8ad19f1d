/* The Ring object's layout, shared by ring.c (the ring) and ring_lease.c (slots lent as tensors). */
#ifndef HOTLOOP_RING_OBJECT_H
#define HOTLOOP_RING_OBJECT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#include "ring.h"

#define HL_RING_MAGIC 0x676e69726c746f68ull /* "hotlring" */
#define HL_RING_VERSION 1u
#define HL_PAGE 4096ull

/* The first page(s) of the shared memory: sizes, the completion counter (the futex word every
   waiter sleeps on) and one control block per slot, each on its own cache line. */
typedef struct {
    uint64_t magic;
    uint32_t nslots;
    uint32_t version;
    uint64_t slot_bytes;
    uint64_t data_offset;
    _Atomic uint32_t completions; /* bumped after every state change a waiter may care about */
    uint32_t pad[7];
} hl_ring_header;

typedef struct {
    _Atomic uint32_t state; /* enum hl_slot_state */
    uint32_t flags;
    int64_t task;      /* the task id the slot was filled for, set by the worker before READY */
    uint64_t meta_len; /* bytes of metadata at the start of the slot */
    int32_t worker;
    _Atomic uint32_t faulted; /* 1 once some process faulted the slot's pages in */
    uint32_t pad[8];
} hl_slot_ctl;

_Static_assert(sizeof(hl_ring_header) == 64, "header is one cache line");
_Static_assert(sizeof(hl_slot_ctl) == 64, "a slot's control block is one cache line");

typedef struct {
    PyObject_HEAD
    int fd;
    char *base;  /* the whole mapping: header, control blocks, then the slots */
    size_t nbytes;
    uint32_t nslots;
    uint64_t slot_bytes;
    uint64_t data_offset;
    int owner;             /* 1 in the process that created the memfd */
    pid_t pid;             /* the process that made this object: a forked copy must not unregister */
    /* page-locking (ring_pin.c), in this process only */
    int registered_device;            /* device of the cuMemHostRegister calls, -1 before the first */
    uint32_t chunks_per_slot;         /* registration chunks of a slot */
    _Atomic unsigned char *chunk_state; /* per slot and chunk: registered or not (malloc'd) */
    pthread_mutex_t pin_lock;         /* one cuMemHostRegister at a time: background or main thread */
    int pin_lock_ready;
    /* the background threads of populate_all: allocate pages, then page-lock them, in `order` */
    pthread_t populater;
    int populater_running;
    pthread_t pinner;
    int pinner_running;
    _Atomic int bg_stop;
    uint32_t *order;
    uint32_t order_count;
} RingObject;

static inline hl_ring_header *header_of(RingObject *r) { return (hl_ring_header *)r->base; }
static inline hl_slot_ctl *ctl_of(RingObject *r, uint32_t slot) {
    return (hl_slot_ctl *)(r->base + sizeof(hl_ring_header)) + slot;
}
static inline char *slot_data(RingObject *r, uint32_t slot) { return r->base + r->data_offset + slot * r->slot_bytes; }

/* ValueError/IndexError unless the ring is open and the slot, or the byte range of a slot, exists */
int hl_ring_check_open(RingObject *r);
int hl_ring_check_slot(RingObject *r, long long slot);
int hl_ring_check_range(RingObject *r, int64_t offset, int64_t nbytes);
/* unpin, unmap and close: what close() does */
void hl_ring_release(RingObject *r);
/* fault pages in (writable), without the GIL: a range, or a whole slot (then marked faulted) */
void hl_ring_fault_range(char *p, uint64_t nbytes);
void hl_ring_fault_in(RingObject *r, uint32_t slot);
/* packed int64 triples from Python (array('q').tobytes()): 0, or -1 with TypeError/ValueError */
int hl_ring_parse_triples(PyObject *packed, const char *argname, const int64_t **out, Py_ssize_t *count);

/* ring_pin.c: page-locking for DMA. init after the sizes are known (-1: out of memory); release
   stops the background threads and unregisters, in the process that registered only. */
int hl_pin_init(RingObject *r);
void hl_pin_release(RingObject *r);
PyObject *hl_ring_populate_all(PyObject *self, PyObject *args);
PyObject *hl_ring_cuda_register_slot(PyObject *self, PyObject *args);
PyObject *hl_ring_copy_to_device(PyObject *self, PyObject *args);
PyObject *hl_ring_get_registered(PyObject *self, void *closure);
PyObject *hl_ring_slot_pinned(PyObject *self, PyObject *arg);
extern const char hl_ring_populate_all_doc[], hl_ring_cuda_register_slot_doc[], hl_ring_copy_to_device_doc[],
    hl_ring_slot_pinned_doc[];

int hl_ring_leases_exec(PyObject *module); /* ring_lease.c: the RingLeases type */

#endif
