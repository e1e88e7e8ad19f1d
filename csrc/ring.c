/* hotloop._C.Ring: the batch ring shared by DataLoader workers and the main process (memfd, atomics, futex, pinned copies). */
#include "ring.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cuda.h"

#ifndef PyBUF_WRITE
#define PyBUF_WRITE 0x200 /* the limited API names it only from 3.11; the value is CPython's */
#endif

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
    int registered_device; /* device of the cudaHostRegister calls, -1 before the first */
    unsigned char *registered; /* per slot: 1 once cudaHostRegister'ed (malloc'd, nslots bytes) */
    int owner;             /* 1 in the process that created the memfd */
    pid_t pid;             /* the process that made this object: a forked copy must not unregister */
    /* the populating thread (populate_all): faults every slot's pages in, ahead of their first use */
    pthread_t populater;
    int populater_running; /* joinable */
    _Atomic int populater_stop;
    uint32_t *populate_order;
    uint32_t populate_count;
} RingObject;

static hl_ring_header *header_of(RingObject *r) { return (hl_ring_header *)r->base; }
static hl_slot_ctl *ctl_of(RingObject *r, uint32_t slot) {
    return (hl_slot_ctl *)(r->base + sizeof(hl_ring_header)) + slot;
}
static char *slot_data(RingObject *r, uint32_t slot) { return r->base + r->data_offset + slot * r->slot_bytes; }

static uint64_t round_up(uint64_t x, uint64_t to) { return (x + to - 1) / to * to; }

static long futex(_Atomic uint32_t *word, int op, uint32_t value, const struct timespec *timeout) {
    /* not FUTEX_PRIVATE: the word lives in memory shared between processes */
    return syscall(SYS_futex, (uint32_t *)word, op, value, timeout, NULL, 0);
}

static void bump_completions(RingObject *r) {
    atomic_fetch_add_explicit(&header_of(r)->completions, 1, memory_order_acq_rel);
    futex(&header_of(r)->completions, FUTEX_WAKE, INT_MAX, NULL);
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int check_open(RingObject *r) {
    if (r->base == NULL) {
        PyErr_SetString(PyExc_ValueError, "the ring is closed");
        return -1;
    }
    return 0;
}

static int check_slot(RingObject *r, long long slot) {
    if (check_open(r) < 0)
        return -1;
    if (slot < 0 || slot >= (long long)r->nslots) {
        PyErr_Format(PyExc_IndexError, "slot %lld out of range: the ring has %u slots", slot, r->nslots);
        return -1;
    }
    return 0;
}

/* Fault in (writable) every page of the slot: one madvise(MADV_POPULATE_WRITE), or a touch per page
   on older kernels. Without the GIL. */
static void fault_in(RingObject *r, uint32_t slot) {
    char *p = slot_data(r, slot);
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
    if (madvise(p, r->slot_bytes, MADV_POPULATE_WRITE) != 0) {
        /* a read-modify-write of one byte per page: no writer of the slot can lose a byte to it, as
           the pages read here were either zero (never written) or written by this same process */
        for (uint64_t off = 0; off < r->slot_bytes; off += HL_PAGE)
            ((volatile char *)p)[off] = ((volatile char *)p)[off];
    }
    atomic_store(&ctl_of(r, slot)->faulted, 1);
}

/* The populating thread. Faulting a fresh 38 MB slot in (allocating and zeroing its pages) takes
   ~15 ms on an H200 host; a worker that does it before writing its batch delays that batch, and
   cudaHostRegister that does it holds a driver lock meanwhile, which stalls every CUDA call of the
   training loop (measured: 15 ms per fresh slot against 2 ms for a faulted one). This thread does it
   ahead of use, in the order slots are handed out, without the GIL and without any CUDA call. */
static void *populater_main(void *arg) {
    RingObject *r = (RingObject *)arg;
    for (uint32_t i = 0; i < r->populate_count && !atomic_load(&r->populater_stop); i++)
        if (!atomic_load(&ctl_of(r, r->populate_order[i])->faulted))
            fault_in(r, r->populate_order[i]);
    return NULL;
}

static void stop_populater(RingObject *r) {
    if (r->populater_running && r->pid == getpid()) { /* a forked copy has no such thread */
        atomic_store(&r->populater_stop, 1);
        pthread_join(r->populater, NULL);
    }
    r->populater_running = 0;
}

static void unregister_pinned(RingObject *r) {
#ifdef HOTLOOP_WITH_CUDA
    if (r->registered_device >= 0 && r->base != NULL && r->registered != NULL && r->pid == getpid()) {
        hl_cuda_status status = {0};
        hl_device_guard guard;
        hl_device_enter(&guard, r->registered_device, &status);
        for (uint32_t i = 0; i < r->nslots; i++)
            if (r->registered[i])
                (void)cudaHostUnregister(slot_data(r, i)); /* best effort: nothing to raise in dealloc */
        hl_device_leave(&guard, &status);
    }
#endif
    if (r->registered != NULL)
        memset(r->registered, 0, r->nslots);
    r->registered_device = -1;
}

static void release_ring(RingObject *r) {
    stop_populater(r);
    unregister_pinned(r);
    if (r->base != NULL)
        munmap(r->base, r->nbytes);
    r->base = NULL;
    free(r->registered);
    r->registered = NULL;
    free(r->populate_order);
    r->populate_order = NULL;
    if (r->fd >= 0)
        close(r->fd);
    r->fd = -1;
}

/* Ring(nslots, slot_bytes, path=None, populate=False): a new memfd ring, or (path given:
   /proc/PID/fd/N of the creator) the same ring mapped into this process. */
static PyObject *ring_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"nslots", "slot_bytes", "path", "populate", NULL};
    long long nslots = 0, slot_bytes = 0;
    const char *path = NULL;
    int populate = 0;
    RingObject *r = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LL|zp:Ring", kwlist, &nslots, &slot_bytes, &path, &populate))
        return NULL;
    if (nslots < 1 || nslots > 4096) {
        PyErr_Format(PyExc_ValueError, "nslots: expected 1 to 4096, got %lld", nslots);
        return NULL;
    }
    if (slot_bytes < 1) {
        PyErr_Format(PyExc_ValueError, "slot_bytes: expected a positive size, got %lld", slot_bytes);
        return NULL;
    }
    r = (RingObject *)PyType_GenericAlloc(type, 0);
    if (r == NULL)
        return NULL;
    r->fd = -1;
    r->registered_device = -1;
    r->pid = getpid();
    r->nslots = (uint32_t)nslots;
    r->slot_bytes = round_up((uint64_t)slot_bytes, HL_PAGE);
    r->data_offset = round_up(sizeof(hl_ring_header) + (uint64_t)nslots * sizeof(hl_slot_ctl), HL_PAGE);
    r->nbytes = (size_t)(r->data_offset + r->nslots * r->slot_bytes);
    r->owner = path == NULL;
    r->registered = (unsigned char *)calloc(r->nslots, 1);
    if (r->registered == NULL) {
        PyErr_NoMemory();
        goto error;
    }

    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    if (path == NULL) {
        /* memfd, not a /dev/shm file: no name to leak, no 64 MB Docker /dev/shm limit */
        r->fd = memfd_create("hotloop-ring", MFD_CLOEXEC);
        if (r->fd < 0 || ftruncate(r->fd, (off_t)r->nbytes) < 0)
            err = errno;
    } else {
        r->fd = open(path, O_RDWR | O_CLOEXEC);
        if (r->fd < 0)
            err = errno;
    }
    if (err == 0) {
        /* with populate every page is faulted in now; without, prefault(slot) does it slot by slot
           where it is cheapest (in the worker that first fills the slot, in parallel with others) */
        void *base = mmap(NULL, r->nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | (populate ? MAP_POPULATE : 0),
                          r->fd, 0);
        if (base == MAP_FAILED)
            err = errno;
        else
            r->base = (char *)base;
    }
    Py_END_ALLOW_THREADS
    if (err != 0) {
        PyErr_Format(PyExc_OSError, "Ring: %s of %zu bytes failed: %s",
                     path == NULL ? "memfd_create/mmap" : "attach", r->nbytes, strerror(err));
        goto error;
    }
    hl_ring_header *h = header_of(r);
    if (r->owner) {
        h->magic = HL_RING_MAGIC;
        h->nslots = r->nslots;
        h->version = HL_RING_VERSION;
        h->slot_bytes = r->slot_bytes;
        h->data_offset = r->data_offset;
        atomic_store(&h->completions, 0);
        for (uint32_t i = 0; i < r->nslots; i++)
            atomic_store(&ctl_of(r, i)->state, HL_SLOT_FREE);
    } else if (h->magic != HL_RING_MAGIC || h->nslots != r->nslots || h->slot_bytes != r->slot_bytes) {
        PyErr_Format(PyExc_ValueError, "Ring: %s is not a ring of %u slots of %llu bytes", path, r->nslots,
                     (unsigned long long)r->slot_bytes);
        goto error;
    }
    return (PyObject *)r;
error:
    Py_DECREF(r);
    return NULL;
}

static void ring_dealloc(PyObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    release_ring((RingObject *)self);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(self);
    Py_DECREF(type);
}

PyDoc_STRVAR(close_doc, "close()\n\nUnregister pinned memory, unmap and close the memfd. Idempotent. Any view\n"
             "taken with view() must be gone before.");
static PyObject *ring_close(PyObject *self, PyObject *Py_UNUSED(a)) {
    RingObject *r = (RingObject *)self;
    Py_BEGIN_ALLOW_THREADS
    release_ring(r);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(view_doc, "view(slot) -> memoryview\n\nThe slot's bytes, writable. The ring must outlive the view:"
             " the caller keeps it.");
static PyObject *ring_view(PyObject *self, PyObject *args) {
    RingObject *r = (RingObject *)self;
    long long slot;
    if (!PyArg_ParseTuple(args, "L:view", &slot) || check_slot(r, slot) < 0)
        return NULL;
    return PyMemoryView_FromMemory(slot_data(r, (uint32_t)slot), (Py_ssize_t)r->slot_bytes, PyBUF_WRITE);
}

PyDoc_STRVAR(slot_address_doc, "slot_address(slot) -> int\n\nAddress of the slot's first byte in this process.");
static PyObject *ring_slot_address(PyObject *self, PyObject *args) {
    RingObject *r = (RingObject *)self;
    long long slot;
    if (!PyArg_ParseTuple(args, "L:slot_address", &slot) || check_slot(r, slot) < 0)
        return NULL;
    return PyLong_FromVoidPtr(slot_data(r, (uint32_t)slot));
}

PyDoc_STRVAR(state_doc, "state(slot) -> int\n\nThe slot's state (FREE, ASSIGNED, READY, ERROR), read with acquire order.");
static PyObject *ring_state(PyObject *self, PyObject *args) {
    RingObject *r = (RingObject *)self;
    long long slot;
    if (!PyArg_ParseTuple(args, "L:state", &slot) || check_slot(r, slot) < 0)
        return NULL;
    return PyLong_FromUnsignedLong(atomic_load_explicit(&ctl_of(r, (uint32_t)slot)->state, memory_order_acquire));
}

PyDoc_STRVAR(set_state_doc, "set_state(slot, state)\n\nStore a state (release order) and wake the waiters.");
static PyObject *ring_set_state(PyObject *self, PyObject *args) {
    RingObject *r = (RingObject *)self;
    long long slot;
    unsigned int state;
    if (!PyArg_ParseTuple(args, "LI:set_state", &slot, &state) || check_slot(r, slot) < 0)
        return NULL;
    if (state > HL_SLOT_ERROR) {
        PyErr_Format(PyExc_ValueError, "state: expected 0 to %d, got %u", HL_SLOT_ERROR, state);
        return NULL;
    }
    atomic_store_explicit(&ctl_of(r, (uint32_t)slot)->state, state, memory_order_release);
    bump_completions(r);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(publish_doc, "publish(slot, task, worker, meta_len, flags=0, error=False)\n\n"
             "Worker side: the slot's bytes are written; record who filled it for which task, then make it\n"
             "READY (ERROR when error) with release order, so the reader sees every byte, and wake the main\n"
             "process. The slot must be ASSIGNED.");
static PyObject *ring_publish(PyObject *self, PyObject *args) {
    RingObject *r = (RingObject *)self;
    long long slot, task, meta_len;
    int worker, error = 0;
    unsigned int flags = 0;
    if (!PyArg_ParseTuple(args, "LLiL|Ip:publish", &slot, &task, &worker, &meta_len, &flags, &error) ||
        check_slot(r, slot) < 0)
        return NULL;
    if (meta_len < 0 || (uint64_t)meta_len > r->slot_bytes) {
        PyErr_Format(PyExc_ValueError, "meta_len: expected 0 to %llu, got %lld", (unsigned long long)r->slot_bytes,
                     meta_len);
        return NULL;
    }
    hl_slot_ctl *c = ctl_of(r, (uint32_t)slot);
    uint32_t expected = HL_SLOT_ASSIGNED;
    c->task = task;
    c->worker = worker;
    c->meta_len = (uint64_t)meta_len;
    c->flags = flags;
    if (!atomic_compare_exchange_strong_explicit(&c->state, &expected, error ? HL_SLOT_ERROR : HL_SLOT_READY,
                                                 memory_order_acq_rel, memory_order_acquire)) {
        PyErr_Format(PyExc_RuntimeError, "publish: slot %lld is in state %u, not ASSIGNED", slot, expected);
        return NULL;
    }
    bump_completions(r);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(info_doc, "info(slot) -> (state, task, worker, meta_len, flags)");
static PyObject *ring_info(PyObject *self, PyObject *args) {
    RingObject *r = (RingObject *)self;
    long long slot;
    if (!PyArg_ParseTuple(args, "L:info", &slot) || check_slot(r, slot) < 0)
        return NULL;
    hl_slot_ctl *c = ctl_of(r, (uint32_t)slot);
    unsigned state = atomic_load_explicit(&c->state, memory_order_acquire);
    return Py_BuildValue("(ILiKI)", state, (long long)c->task, c->worker, (unsigned long long)c->meta_len, c->flags);
}

PyDoc_STRVAR(wait_doc, "wait(slot, not_state, timeout, any_change=False) -> int\n\n"
             "Sleep (futex, GIL released) until the slot's state differs from not_state, or timeout seconds\n"
             "passed (with any_change: or any slot changed state); return the slot's state then. A negative\n"
             "timeout waits without limit.");
static PyObject *ring_wait(PyObject *self, PyObject *args) {
    RingObject *r = (RingObject *)self;
    long long slot;
    unsigned int not_state, state;
    double timeout;
    int any_change = 0;
    if (!PyArg_ParseTuple(args, "LId|p:wait", &slot, &not_state, &timeout, &any_change) || check_slot(r, slot) < 0)
        return NULL;
    hl_slot_ctl *c = ctl_of(r, (uint32_t)slot);
    _Atomic uint32_t *word = &header_of(r)->completions;
    Py_BEGIN_ALLOW_THREADS
    double deadline = now_seconds() + timeout;
    uint32_t first = atomic_load_explicit(word, memory_order_acquire);
    for (;;) {
        /* read the counter before the state: a change after this read bumps the counter, and the
           futex then refuses to sleep */
        uint32_t seen = atomic_load_explicit(word, memory_order_acquire);
        state = atomic_load_explicit(&c->state, memory_order_acquire);
        if (state != not_state || (any_change && seen != first))
            break;
        struct timespec ts, *tsp = NULL;
        if (timeout >= 0) {
            double left = deadline - now_seconds();
            if (left <= 0)
                break;
            ts.tv_sec = (time_t)left;
            ts.tv_nsec = (long)((left - (double)ts.tv_sec) * 1e9);
            tsp = &ts;
        }
        futex(word, FUTEX_WAIT, seen, tsp);
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(state);
}

/* packed int64 triples from Python (array('q').tobytes()) */
static int parse_triples(PyObject *packed, const char *argname, const int64_t **out, Py_ssize_t *count) {
    if (!PyBytes_Check(packed)) {
        PyErr_Format(PyExc_TypeError, "%s: expected bytes of int64 triples, got %R", argname,
                     (PyObject *)Py_TYPE(packed));
        return -1;
    }
    Py_ssize_t n = PyBytes_Size(packed);
    if (n % (3 * (Py_ssize_t)sizeof(int64_t)) != 0) {
        PyErr_Format(PyExc_ValueError, "%s: expected a multiple of 24 bytes, got %zd", argname, n);
        return -1;
    }
    *out = (const int64_t *)PyBytes_AsString(packed);
    *count = n / (3 * (Py_ssize_t)sizeof(int64_t));
    return 0;
}

static int check_range(RingObject *r, int64_t offset, int64_t nbytes) {
    if (offset < 0 || nbytes < 0 || (uint64_t)(offset + nbytes) > r->slot_bytes) {
        PyErr_Format(PyExc_ValueError, "bytes [%lld, %lld) do not lie inside a slot of %llu bytes", (long long)offset,
                     (long long)(offset + nbytes), (unsigned long long)r->slot_bytes);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(copy_out_doc, "copy_out(slot, packed)\n\n"
             "Host copies out of a slot, GIL released: packed holds int64 triples (offset in the slot,\n"
             "destination address, bytes). The destinations must be host memory of at least that size.");
static PyObject *ring_copy_out(PyObject *self, PyObject *args) {
    RingObject *r = (RingObject *)self;
    long long slot;
    PyObject *packed;
    const int64_t *t;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "LO:copy_out", &slot, &packed) || check_slot(r, slot) < 0 ||
        parse_triples(packed, "packed", &t, &n) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (check_range(r, t[3 * i], t[3 * i + 2]) < 0)
            return NULL;
    char *src = slot_data(r, (uint32_t)slot);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        memcpy((void *)(uintptr_t)t[3 * i + 1], src + t[3 * i], (size_t)t[3 * i + 2]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#ifdef HOTLOOP_WITH_CUDA
/* work on one slot for hl_cuda_run: page-lock it, or copy parts of it to the device */
typedef struct {
    RingObject *ring;
    uint32_t slot;
    const int64_t *triples; /* (offset in the slot, device address, bytes) */
    Py_ssize_t count;
    cudaStream_t stream;
} slot_copies;

static cudaError_t run_register(void *ctx) {
    slot_copies *job = (slot_copies *)ctx;
    return cudaHostRegister(slot_data(job->ring, job->slot), job->ring->slot_bytes, cudaHostRegisterPortable);
}

static cudaError_t run_copies(void *ctx) {
    slot_copies *job = (slot_copies *)ctx;
    char *src = slot_data(job->ring, job->slot);
    for (Py_ssize_t i = 0; i < job->count; i++) {
        const int64_t *t = job->triples + 3 * i;
        cudaError_t err = cudaMemcpyAsync((void *)(uintptr_t)t[1], src + t[0], (size_t)t[2], cudaMemcpyHostToDevice,
                                          job->stream);
        if (err != cudaSuccess)
            return err;
    }
    return cudaSuccess;
}
#endif

PyDoc_STRVAR(prefault_doc, "prefault(slot)\n\n"
             "Fault in (writable) every page of the slot in one call (MADV_POPULATE_WRITE, or a touch per page\n"
             "on older kernels), GIL released: the batch copy that follows runs at memory speed. Pages another\n"
             "process faulted in already only need mapping here, which is cheap.");
static PyObject *ring_prefault(PyObject *self, PyObject *args) {
    RingObject *r = (RingObject *)self;
    long long slot;
    if (!PyArg_ParseTuple(args, "L:prefault", &slot) || check_slot(r, slot) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    fault_in(r, (uint32_t)slot);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(faulted_doc, "faulted(slot) -> bool\n\nWhether some process faulted the slot's pages in already.");
static PyObject *ring_faulted(PyObject *self, PyObject *args) {
    RingObject *r = (RingObject *)self;
    long long slot;
    if (!PyArg_ParseTuple(args, "L:faulted", &slot) || check_slot(r, slot) < 0)
        return NULL;
    return PyBool_FromLong(atomic_load(&ctl_of(r, (uint32_t)slot)->faulted) != 0);
}

PyDoc_STRVAR(populate_all_doc, "populate_all(order)\n\n"
             "Start a thread that faults in every slot's pages not faulted yet, in `order` (slot numbers: the\n"
             "order the caller will use them), without the GIL and without CUDA. Once per ring; close() stops\n"
             "it.");
static PyObject *ring_populate_all(PyObject *self, PyObject *order) {
    RingObject *r = (RingObject *)self;
    if (check_open(r) < 0)
        return NULL;
    if (r->populate_order != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "populate_all: the ring's populating thread was started already");
        return NULL;
    }
    Py_ssize_t n = PySequence_Size(order);
    if (n < 0)
        return NULL;
    uint32_t *slots = (uint32_t *)calloc(n > 0 ? (size_t)n : 1, sizeof(uint32_t));
    if (slots == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(order, i);
        long long slot = item == NULL ? -1 : PyLong_AsLongLong(item);
        Py_XDECREF(item);
        if ((slot == -1 && PyErr_Occurred()) || check_slot(r, slot) < 0) {
            free(slots);
            return NULL;
        }
        slots[i] = (uint32_t)slot;
    }
    r->populate_order = slots;
    r->populate_count = (uint32_t)n;
    atomic_store(&r->populater_stop, 0);
    int err = pthread_create(&r->populater, NULL, populater_main, r);
    if (err != 0) {
        r->populate_count = 0;
        PyErr_Format(PyExc_OSError, "populate_all: pthread_create failed: %s", strerror(err));
        return NULL;
    }
    r->populater_running = 1;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cuda_register_slot_doc, "cuda_register_slot(slot, device) -> bool\n\n"
             "cudaHostRegister one slot (page-locked, portable) so copies from it run at DMA speed; False when\n"
             "it already was. Slots are registered one by one as they are first used (or while the main process\n"
             "waits), so no large up-front pinning delays the first batch; close() unregisters them all. One\n"
             "device per ring. Faulted slots (see populate_all) take ~2 ms, fresh ones ~15 ms of a driver lock.");
static PyObject *ring_cuda_register_slot(PyObject *self, PyObject *args) {
    RingObject *r = (RingObject *)self;
    long long slot;
    int device;
    PyObject *module = PyType_GetModule(Py_TYPE(self));
    if (!PyArg_ParseTuple(args, "Li:cuda_register_slot", &slot, &device) || module == NULL || check_slot(r, slot) < 0)
        return NULL;
    if (r->registered[slot])
        Py_RETURN_FALSE;
    if (r->registered_device >= 0 && r->registered_device != device) {
        PyErr_Format(PyExc_ValueError, "device: this ring is registered for device %d, got %d", r->registered_device,
                     device);
        return NULL;
    }
    if (hl_cuda_require(module, device) < 0)
        return NULL;
#ifdef HOTLOOP_WITH_CUDA
    slot_copies job = {r, (uint32_t)slot, NULL, 0, NULL};
    if (hl_cuda_run(module, device, run_register, &job) < 0)
        return NULL;
    r->registered[slot] = 1;
    r->registered_device = device;
#endif
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(copy_to_device_doc, "copy_to_device(slot, packed, stream, device)\n\n"
             "cudaMemcpyAsync from the (registered) slot to device memory on `stream`: packed holds int64\n"
             "triples (offset in the slot, device address, bytes). Nothing waits; the caller records an\n"
             "event after and frees the slot only once it completed.");
static PyObject *ring_copy_to_device(PyObject *self, PyObject *args) {
    RingObject *r = (RingObject *)self;
    long long slot;
    PyObject *packed;
    unsigned long long stream;
    int device;
    const int64_t *t;
    Py_ssize_t n;
    PyObject *module = PyType_GetModule(Py_TYPE(self));
    if (!PyArg_ParseTuple(args, "LOKi:copy_to_device", &slot, &packed, &stream, &device) || module == NULL ||
        check_slot(r, slot) < 0 || parse_triples(packed, "packed", &t, &n) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (check_range(r, t[3 * i], t[3 * i + 2]) < 0)
            return NULL;
    if (hl_cuda_require(module, device) < 0)
        return NULL;
#ifdef HOTLOOP_WITH_CUDA
    slot_copies job = {r, (uint32_t)slot, t, n, hl_stream(stream)};
    if (hl_cuda_run(module, device, run_copies, &job) < 0)
        return NULL;
#else
    (void)stream;
#endif
    Py_RETURN_NONE;
}

static PyObject *get_fd(PyObject *self, void *c) { (void)c; return PyLong_FromLong(((RingObject *)self)->fd); }
static PyObject *get_nslots(PyObject *self, void *c) { (void)c; return PyLong_FromUnsignedLong(((RingObject *)self)->nslots); }
static PyObject *get_slot_bytes(PyObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLongLong(((RingObject *)self)->slot_bytes);
}
static PyObject *get_nbytes(PyObject *self, void *c) { (void)c; return PyLong_FromSize_t(((RingObject *)self)->nbytes); }
static PyObject *get_closed(PyObject *self, void *c) { (void)c; return PyBool_FromLong(((RingObject *)self)->base == NULL); }
static PyObject *get_registered(PyObject *self, void *c) {
    (void)c;
    RingObject *r = (RingObject *)self;
    long count = 0;
    for (uint32_t i = 0; r->registered != NULL && i < r->nslots; i++)
        count += r->registered[i];
    return PyLong_FromLong(count);
}
static PyObject *get_completions(PyObject *self, void *c) {
    (void)c;
    RingObject *r = (RingObject *)self;
    if (check_open(r) < 0)
        return NULL;
    return PyLong_FromUnsignedLong(atomic_load(&header_of(r)->completions));
}

static PyGetSetDef ring_getset[] = {
    {"fd", get_fd, NULL, "the memfd (-1 once closed)", NULL},
    {"nslots", get_nslots, NULL, "slots in the ring", NULL},
    {"slot_bytes", get_slot_bytes, NULL, "bytes per slot (a multiple of 4096)", NULL},
    {"nbytes", get_nbytes, NULL, "bytes of shared memory, control blocks included", NULL},
    {"closed", get_closed, NULL, "True once close() ran", NULL},
    {"registered", get_registered, NULL, "how many slots are cudaHostRegister'ed now", NULL},
    {"completions", get_completions, NULL, "the futex counter, bumped on every state change", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef ring_methods[] = {
    {"close", ring_close, METH_NOARGS, close_doc},
    {"view", ring_view, METH_VARARGS, view_doc},
    {"slot_address", ring_slot_address, METH_VARARGS, slot_address_doc},
    {"state", ring_state, METH_VARARGS, state_doc},
    {"set_state", ring_set_state, METH_VARARGS, set_state_doc},
    {"publish", ring_publish, METH_VARARGS, publish_doc},
    {"info", ring_info, METH_VARARGS, info_doc},
    {"wait", ring_wait, METH_VARARGS, wait_doc},
    {"copy_out", ring_copy_out, METH_VARARGS, copy_out_doc},
    {"prefault", ring_prefault, METH_VARARGS, prefault_doc},
    {"faulted", ring_faulted, METH_VARARGS, faulted_doc},
    {"populate_all", ring_populate_all, METH_O, populate_all_doc},
    {"cuda_register_slot", ring_cuda_register_slot, METH_VARARGS, cuda_register_slot_doc},
    {"copy_to_device", ring_copy_to_device, METH_VARARGS, copy_to_device_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(ring_doc, "Ring(nslots, slot_bytes, path=None, populate=False)\n\n"
             "Slots of shared memory from memfd_create (no /dev/shm file), pre-faulted all at once (populate)\n"
             "or slot by slot (prefault). Without path a new\n"
             "ring is made; with path (/proc/PID/fd/FD of the creator's fd) that ring is mapped here.\n"
             "Slot states live in the shared memory and change with atomics; wait() sleeps on a futex.");

static PyType_Slot ring_slots[] = {
    {Py_tp_new, ring_new},
    {Py_tp_dealloc, ring_dealloc},
    {Py_tp_methods, ring_methods},
    {Py_tp_getset, ring_getset},
    {Py_tp_doc, (void *)ring_doc},
    {0, NULL},
};

static int hl_ring_leases_exec(PyObject *module); /* the leases, at the end of this file */

static PyType_Spec ring_spec = {
    .name = "hotloop._C.Ring",
    .basicsize = sizeof(RingObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = ring_slots,
};

int hl_ring_exec(PyObject *module) {
    hl_state *state = hl_state_of(module);
    state->ring_type = PyType_FromModuleAndSpec(module, &ring_spec, NULL);
    if (state->ring_type == NULL)
        return -1;
    if (PyModule_AddType(module, (PyTypeObject *)state->ring_type) < 0 || hl_normalize_exec(module) < 0 ||
        hl_ring_leases_exec(module) < 0)
        return -1;
    return PyModule_AddIntConstant(module, "RING_FREE", HL_SLOT_FREE) < 0 ||
                   PyModule_AddIntConstant(module, "RING_ASSIGNED", HL_SLOT_ASSIGNED) < 0 ||
                   PyModule_AddIntConstant(module, "RING_READY", HL_SLOT_READY) < 0 ||
                   PyModule_AddIntConstant(module, "RING_ERROR", HL_SLOT_ERROR) < 0 ||
                   PyModule_AddIntConstant(module, "RING_FLAG_OVERFLOW", HL_SLOT_FLAG_OVERFLOW) < 0
               ? -1
               : 0;
}

/* ---- leases: slots handed to the consumer as tensors, zero-copy --------------------------------

   RingLeases(ring).lease(slot, parts) returns one DLPack capsule ("dltensor", uint8) per part of
   the slot, for torch.from_dlpack: each leaf gets a storage of its own bytes, as a collated tensor
   has. torch calls a capsule's deleter when its storage dies, i.e. once no tensor, view, storage or
   numpy array made from it is left, from whichever thread drops the last one, often without the
   GIL. When the last part of a slot is gone the slot is marked returned with an atomic store; the
   main process collects returned slots with returned(). Each lease holds a reference to the
   RingLeases, which holds the ring, so the mapping outlives every leased tensor even after the pool
   closed. (The limited API of 3.10 cannot define a buffer exporter, hence DLPack.) */

#include "dlpack.h"

enum { HL_LEASE_NONE = 0, HL_LEASE_OUT = 1, HL_LEASE_BACK = 2 };

typedef struct {
    PyObject_HEAD
    RingObject *ring;          /* strong */
    _Atomic uint32_t *state;   /* per slot: enum above (malloc'd, nslots words) */
    _Atomic uint32_t out;      /* leases with a tensor still alive */
    uint32_t nslots;
    int close_pending;         /* close_ring() came while leases were out: the last one closes it */
} LeasesObject;

struct hl_lease;

typedef struct {
    dl_managed managed;
    int64_t shape[1];
    struct hl_lease *lease;
} hl_lease_part;

typedef struct hl_lease {
    _Atomic uint32_t refs; /* parts alive, plus one while lease() builds them */
    LeasesObject *owner;   /* strong */
    uint32_t slot;
    hl_lease_part parts[];
} hl_lease;

static void lease_unref(hl_lease *l) {
    if (atomic_fetch_sub_explicit(&l->refs, 1, memory_order_acq_rel) != 1)
        return;
    LeasesObject *o = l->owner;
    uint32_t slot = l->slot;
    free(l);
    atomic_fetch_sub_explicit(&o->out, 1, memory_order_acq_rel);
    atomic_store_explicit(&o->state[slot], HL_LEASE_BACK, memory_order_release);
    /* the last lease may hold the last reference to the ring: its dealloc unmaps, under the GIL */
    PyGILState_STATE gil = PyGILState_Ensure();
    if (o->close_pending && atomic_load(&o->out) == 0) {
        o->close_pending = 0;
        release_ring(o->ring);
    }
    Py_DECREF(o);
    PyGILState_Release(gil);
}

static void lease_part_deleter(dl_managed *m) { lease_unref(((hl_lease_part *)m->manager_ctx)->lease); }

static void lease_capsule_destructor(PyObject *capsule) {
    /* a capsule torch never consumed still holds its part */
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        dl_managed *m = (dl_managed *)PyCapsule_GetPointer(capsule, "dltensor");
        if (m != NULL && m->deleter != NULL)
            m->deleter(m);
    }
}

static PyObject *leases_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"ring", NULL};
    PyObject *ring;
    LeasesObject *o = NULL;
    PyObject *module = PyType_GetModule(type);
    if (module == NULL || !PyArg_ParseTupleAndKeywords(args, kwargs, "O:RingLeases", kwlist, &ring))
        return NULL;
    if (!PyObject_TypeCheck(ring, (PyTypeObject *)hl_state_of(module)->ring_type)) {
        PyErr_Format(PyExc_TypeError, "RingLeases: expected a hotloop._C.Ring, got %R", (PyObject *)Py_TYPE(ring));
        return NULL;
    }
    if (check_open((RingObject *)ring) < 0)
        return NULL;
    o = (LeasesObject *)PyType_GenericAlloc(type, 0);
    if (o == NULL)
        return NULL;
    o->nslots = ((RingObject *)ring)->nslots;
    o->state = (_Atomic uint32_t *)calloc(o->nslots, sizeof(uint32_t));
    if (o->state == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    Py_INCREF(ring);
    o->ring = (RingObject *)ring;
    atomic_store(&o->out, 0);
    return (PyObject *)o;
error:
    Py_DECREF(o);
    return NULL;
}

static void leases_dealloc(PyObject *self) {
    LeasesObject *o = (LeasesObject *)self;
    PyTypeObject *type = Py_TYPE(self);
    free((void *)o->state);
    Py_XDECREF(o->ring);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(self);
    Py_DECREF(type);
}

PyDoc_STRVAR(lease_doc, "lease(slot, parts) -> list of DLPack capsules\n\n"
             "The slot's bytes as uint8 CPU tensors for torch.from_dlpack, without a copy: parts holds int64\n"
             "pairs (offset in the slot, bytes), one capsule each. The slot counts as returned (see\n"
             "returned()) once the last tensor, view, storage or array made from any of them is gone; until\n"
             "then it must not be written. A slot is leased once at a time.");
static PyObject *leases_lease(PyObject *self, PyObject *args) {
    LeasesObject *o = (LeasesObject *)self;
    long long slot;
    PyObject *packed, *out = NULL;
    hl_lease *l = NULL;
    if (!PyArg_ParseTuple(args, "LO:lease", &slot, &packed) || check_slot(o->ring, slot) < 0)
        return NULL;
    if (!PyBytes_Check(packed) || PyBytes_Size(packed) % (2 * (Py_ssize_t)sizeof(int64_t)) != 0) {
        PyErr_Format(PyExc_TypeError, "parts: expected bytes of int64 (offset, bytes) pairs, got %R",
                     (PyObject *)Py_TYPE(packed));
        return NULL;
    }
    const int64_t *pairs = (const int64_t *)PyBytes_AsString(packed);
    Py_ssize_t n = PyBytes_Size(packed) / (2 * (Py_ssize_t)sizeof(int64_t));
    for (Py_ssize_t i = 0; i < n; i++)
        if (check_range(o->ring, pairs[2 * i], pairs[2 * i + 1]) < 0)
            return NULL;
    uint32_t expected = HL_LEASE_NONE;
    if (!atomic_compare_exchange_strong(&o->state[slot], &expected, HL_LEASE_OUT)) {
        PyErr_Format(PyExc_ValueError, "lease: slot %lld is %s", slot,
                     expected == HL_LEASE_OUT ? "leased already" : "returned but not collected by returned()");
        return NULL;
    }
    l = (hl_lease *)calloc(1, sizeof(hl_lease) + (size_t)n * sizeof(hl_lease_part));
    if (l == NULL) {
        atomic_store(&o->state[slot], HL_LEASE_NONE);
        return PyErr_NoMemory();
    }
    /* from here on the lease owns the slot: every way out goes through lease_unref */
    atomic_store(&l->refs, 1);
    Py_INCREF(self);
    l->owner = o;
    l->slot = (uint32_t)slot;
    atomic_fetch_add_explicit(&o->out, 1, memory_order_acq_rel);
    out = PyList_New(0);
    if (out == NULL)
        goto error;
    for (Py_ssize_t i = 0; i < n; i++) {
        hl_lease_part *p = &l->parts[i];
        p->lease = l;
        p->shape[0] = pairs[2 * i + 1];
        p->managed.tensor.data = slot_data(o->ring, (uint32_t)slot) + pairs[2 * i];
        p->managed.tensor.device.device_type = DL_CPU;
        p->managed.tensor.ndim = 1;
        p->managed.tensor.dtype.code = DL_UINT;
        p->managed.tensor.dtype.bits = 8;
        p->managed.tensor.dtype.lanes = 1;
        p->managed.tensor.shape = p->shape;
        p->managed.manager_ctx = p;
        p->managed.deleter = lease_part_deleter;
        atomic_fetch_add_explicit(&l->refs, 1, memory_order_acq_rel);
        PyObject *capsule = PyCapsule_New(&p->managed, "dltensor", lease_capsule_destructor);
        if (capsule == NULL) {
            atomic_fetch_sub_explicit(&l->refs, 1, memory_order_acq_rel); /* never handed out */
            goto error;
        }
        int rc = PyList_Append(out, capsule);
        Py_DECREF(capsule);
        if (rc < 0)
            goto error;
    }
    lease_unref(l); /* the parts hold it now (none: returned at once) */
    return out;
error:
    Py_XDECREF(out); /* capsules made so far give their parts back */
    lease_unref(l);
    return NULL;
}

PyDoc_STRVAR(returned_doc, "returned() -> list of int\n\n"
             "The slots whose leases ended since the last call (each once); they may be leased again.");
static PyObject *leases_returned(PyObject *self, PyObject *Py_UNUSED(a)) {
    LeasesObject *o = (LeasesObject *)self;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (uint32_t i = 0; i < o->nslots; i++) {
        uint32_t expected = HL_LEASE_BACK;
        if (atomic_load_explicit(&o->state[i], memory_order_acquire) != HL_LEASE_BACK ||
            !atomic_compare_exchange_strong(&o->state[i], &expected, HL_LEASE_NONE))
            continue;
        PyObject *n = PyLong_FromUnsignedLong(i);
        if (n == NULL || PyList_Append(out, n) < 0) {
            Py_XDECREF(n);
            atomic_store(&o->state[i], HL_LEASE_BACK); /* collected by the next call */
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(n);
    }
    return out;
}

PyDoc_STRVAR(close_ring_doc, "close_ring()\n\n"
             "Close the ring now if no leased tensor is left, else once the last one is gone.");
static PyObject *leases_close_ring(PyObject *self, PyObject *Py_UNUSED(a)) {
    LeasesObject *o = (LeasesObject *)self;
    /* the deleter decrements `out` before it takes the GIL, which this holds: a deleter that
       finds close_pending unset has not yet looked, and will see it */
    if (atomic_load(&o->out) == 0)
        release_ring(o->ring);
    else
        o->close_pending = 1;
    Py_RETURN_NONE;
}

static PyObject *leases_get_outstanding(PyObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLong(atomic_load(&((LeasesObject *)self)->out));
}

static PyObject *leases_get_ring(PyObject *self, void *c) {
    (void)c;
    PyObject *ring = (PyObject *)((LeasesObject *)self)->ring;
    Py_INCREF(ring);
    return ring;
}

static PyGetSetDef leases_getset[] = {
    {"outstanding", leases_get_outstanding, NULL, "leases whose tensors are still alive", NULL},
    {"ring", leases_get_ring, NULL, "the ring whose slots are leased", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef leases_methods[] = {
    {"lease", leases_lease, METH_VARARGS, lease_doc},
    {"returned", leases_returned, METH_NOARGS, returned_doc},
    {"close_ring", leases_close_ring, METH_NOARGS, close_ring_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(leases_doc, "RingLeases(ring)\n\n"
             "Slots of a ring lent out as zero-copy tensors (lease), and the slots whose tensors are all\n"
             "gone (returned). Keeps the ring mapped while any leased tensor lives: close it with\n"
             "close_ring(), not with the ring's close().");

static PyType_Slot leases_slots[] = {
    {Py_tp_new, leases_new},
    {Py_tp_dealloc, leases_dealloc},
    {Py_tp_methods, leases_methods},
    {Py_tp_getset, leases_getset},
    {Py_tp_doc, (void *)leases_doc},
    {0, NULL},
};

static PyType_Spec leases_spec = {
    .name = "hotloop._C.RingLeases",
    .basicsize = sizeof(LeasesObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = leases_slots,
};

static int hl_ring_leases_exec(PyObject *module) {
    PyObject *type = PyType_FromModuleAndSpec(module, &leases_spec, NULL);
    if (type == NULL)
        return -1;
    int rc = PyModule_AddType(module, (PyTypeObject *)type);
    Py_DECREF(type);
    return rc;
}
