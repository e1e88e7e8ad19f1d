/* Page-locking a Ring for DMA: pages faulted in and registered (cuMemHostRegister) chunk by chunk on background threads. */
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda.h"
#include "ring_object.h"

/* Why chunks: host registration holds a driver lock for its whole call, and every CUDA call of the
   process waits for it, the training thread's kernel launches included. The lock is held for a time
   that grows with the bytes registered, so a whole slot registered in one call, slot after slot from
   a background thread, stalls the training thread's launches for as long; small chunks with a short
   pause between calls bound each stall to one small registration and let the waiting calls in
   between. A copy may not span two registrations (the driver rejects it), so copies are split at
   chunk boundaries too. */
#define PIN_CHUNK (8ull << 20)
#define PIN_PAUSE_NS 1000000L /* between two registrations: lets the training thread's calls in */

enum { CHUNK_UNLOCKED = 0, CHUNK_REGISTERED = 1 }; /* chunk_state values */

#ifdef HOTLOOP_WITH_CUDA /* only registrations and copies need a chunk's place and length */
static inline uint64_t chunk_offset(uint32_t chunk) { return (uint64_t)chunk * PIN_CHUNK; }

static inline uint64_t chunk_bytes(const RingObject *r, uint32_t chunk) {
    uint64_t left = r->slot_bytes - chunk_offset(chunk);
    return left < PIN_CHUNK ? left : PIN_CHUNK;
}
#endif

static inline _Atomic unsigned char *chunk_state(RingObject *r, uint32_t slot, uint32_t chunk) {
    return &r->chunk_state[(size_t)slot * r->chunks_per_slot + chunk];
}

int hl_pin_init(RingObject *r) {
    r->registered_device = -1;
    r->chunks_per_slot = (uint32_t)((r->slot_bytes + PIN_CHUNK - 1) / PIN_CHUNK);
    r->chunk_state = calloc((size_t)r->nslots * r->chunks_per_slot, 1);
    if (r->chunk_state == NULL)
        return -1;
    if (pthread_mutex_init(&r->pin_lock, NULL) != 0)
        return -1;
    r->pin_lock_ready = 1;
    return 0;
}

static int slot_registered(RingObject *r, uint32_t slot) {
    for (uint32_t k = 0; k < r->chunks_per_slot; k++)
        if (atomic_load(chunk_state(r, slot, k)) != CHUNK_REGISTERED)
            return 0;
    return 1;
}

#ifdef HOTLOOP_WITH_CUDA
/* Register one chunk unless it is registered already; the caller has `device` current. Serialised
   by pin_lock, so the background thread and the main thread never register the same chunk twice.
   *did says whether this call registered it. */
static CUresult register_chunk(RingObject *r, uint32_t slot, uint32_t chunk, int *did) {
    CUresult err = CUDA_SUCCESS;
    *did = 0;
    pthread_mutex_lock(&r->pin_lock);
    if (atomic_load(chunk_state(r, slot, chunk)) != CHUNK_REGISTERED) {
        err = hl_cu.cuMemHostRegister(slot_data(r, slot) + chunk_offset(chunk), chunk_bytes(r, chunk),
                                      CU_MEMHOSTREGISTER_PORTABLE);
        if (err == CUDA_SUCCESS) {
            atomic_store(chunk_state(r, slot, chunk), CHUNK_REGISTERED);
            *did = 1;
        }
    }
    pthread_mutex_unlock(&r->pin_lock);
    return err;
}
#endif

/* The populating thread: allocates every slot's pages, in the order slots will be handed out.
   Allocating the pages of a fresh slot of tens of MB is slow; a worker that did it before writing its
   first batch would delay that batch, and registering unallocated memory does it while
   holding the driver lock. No GIL, no CUDA here. */
static void *populater_main(void *arg) {
    RingObject *r = (RingObject *)arg;
    for (uint32_t i = 0; i < r->order_count && !atomic_load(&r->bg_stop); i++) {
        uint32_t slot = r->order[i];
        if (atomic_load(&ctl_of(r, slot)->faulted))
            continue;
        /* fallocate allocates the memfd's pages without touching this process's mappings: a
           madvise(MADV_POPULATE_WRITE) of a slot holds this process's mmap lock while it allocates, and
           the training thread's own memory calls queue behind it */
        if (fallocate(r->fd, 0, (off_t)(slot_data(r, slot) - r->base), (off_t)r->slot_bytes) != 0)
            hl_ring_fault_in(r, slot); /* a kernel without shmem fallocate: fault them in here */
        atomic_store(&ctl_of(r, slot)->faulted, 1);
    }
    return NULL;
}

#ifdef HOTLOOP_WITH_CUDA
/* The pinning thread: registers the slots chunk by chunk in the same order, behind the populating
   thread (a chunk it has not reached yet is allocated here, outside the driver lock). It
   stops at the first error: the main thread then registers what it copies from itself
   (cuda_register_slot) and reports the error there. */
static void *pinner_main(void *arg) {
    RingObject *r = (RingObject *)arg;
    CUcontext context = NULL; /* this thread's own current context: the device's primary one */
    if (hl_primary_context(r->registered_device, &context) != CUDA_SUCCESS ||
        hl_cu.cuCtxSetCurrent(context) != CUDA_SUCCESS)
        return NULL;
    struct timespec pause = {0, PIN_PAUSE_NS};
    for (uint32_t i = 0; i < r->order_count && !atomic_load(&r->bg_stop); i++) {
        uint32_t slot = r->order[i];
        for (uint32_t k = 0; k < r->chunks_per_slot && !atomic_load(&r->bg_stop); k++) {
            if (atomic_load(chunk_state(r, slot, k)) == CHUNK_REGISTERED)
                continue;
            /* map (and zero) the chunk's pages here, in small steps, outside the driver lock */
            hl_ring_fault_range(slot_data(r, slot) + chunk_offset(k), chunk_bytes(r, k));
            int did;
            if (register_chunk(r, slot, k, &did) != CUDA_SUCCESS)
                return NULL;
            nanosleep(&pause, NULL);
        }
    }
    return NULL;
}
#endif

/* Stop and join the background threads (only the process that started them has them). */
static void stop_background(RingObject *r) {
    if (r->pid == getpid()) {
        atomic_store(&r->bg_stop, 1);
        if (r->populater_running)
            pthread_join(r->populater, NULL);
        if (r->pinner_running)
            pthread_join(r->pinner, NULL);
    }
    r->populater_running = 0;
    r->pinner_running = 0;
}

void hl_pin_release(RingObject *r) {
    stop_background(r);
#ifdef HOTLOOP_WITH_CUDA
    if (r->registered_device >= 0 && r->base != NULL && r->chunk_state != NULL && r->pid == getpid()) {
        hl_cuda_status status = {0};
        hl_device_guard guard;
        hl_device_enter(&guard, r->registered_device, &status);
        for (uint32_t s = 0; s < r->nslots; s++)
            for (uint32_t k = 0; k < r->chunks_per_slot; k++)
                if (atomic_load(chunk_state(r, s, k)) == CHUNK_REGISTERED)
                    (void)hl_cu.cuMemHostUnregister(slot_data(r, s) + chunk_offset(k)); /* best effort: nothing to raise */
        hl_device_leave(&guard, &status);
    }
#endif
    free(r->chunk_state);
    r->chunk_state = NULL;
    free(r->order);
    r->order = NULL;
    r->order_count = 0;
    if (r->pin_lock_ready && r->pid == getpid())
        pthread_mutex_destroy(&r->pin_lock);
    r->pin_lock_ready = 0;
    r->registered_device = -1;
}

/* the one device a ring is registered for: set by the first registration, checked after */
static int claim_device(RingObject *r, int device) {
    if (r->registered_device >= 0 && r->registered_device != device) {
        PyErr_Format(PyExc_ValueError, "device: this ring is registered for device %d, got %d", r->registered_device,
                     device);
        return -1;
    }
    r->registered_device = device;
    return 0;
}

const char hl_ring_populate_all_doc[] = "populate_all(order, device=-1)\n\n"
             "Start background threads, without the GIL, that fault in the pages of every slot in `order`\n"
             "(slot numbers: the order the caller will use them) and, with a device, page-lock them for DMA\n"
             "to it (cuMemHostRegister, in 8 MiB chunks, one at a time with pauses so that the training\n"
             "loop's CUDA calls are never held up for long). Once per ring; close() stops them.";
PyObject *hl_ring_populate_all(PyObject *self, PyObject *args) {
    RingObject *r = (RingObject *)self;
    PyObject *order;
    int device = -1;
    PyObject *module = PyType_GetModule(Py_TYPE(self));
    if (!PyArg_ParseTuple(args, "O|i:populate_all", &order, &device) || module == NULL || hl_ring_check_open(r) < 0)
        return NULL;
    if (r->order != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "populate_all: the ring's background threads were started already");
        return NULL;
    }
    if (device >= 0 && (hl_cuda_require(module, device) < 0 || claim_device(r, device) < 0))
        return NULL;
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
        if ((slot == -1 && PyErr_Occurred()) || hl_ring_check_slot(r, slot) < 0) {
            free(slots);
            return NULL;
        }
        slots[i] = (uint32_t)slot;
    }
    r->order = slots;
    r->order_count = (uint32_t)n;
    atomic_store(&r->bg_stop, 0);
    int err = pthread_create(&r->populater, NULL, populater_main, r);
    r->populater_running = err == 0;
#ifdef HOTLOOP_WITH_CUDA
    if (err == 0 && device >= 0) {
        err = pthread_create(&r->pinner, NULL, pinner_main, r);
        r->pinner_running = err == 0;
    }
#endif
    if (err != 0) {
        stop_background(r);
        PyErr_Format(PyExc_OSError, "populate_all: pthread_create failed: %s", strerror(err));
        return NULL;
    }
    Py_RETURN_NONE;
}

#ifdef HOTLOOP_WITH_CUDA
typedef struct {
    RingObject *ring;
    uint32_t slot;
    int registered_any;
    const int64_t *triples; /* (offset in the slot, device address, bytes) */
    Py_ssize_t count;
    CUstream stream;
} slot_job;

static CUresult run_register(void *ctx) {
    slot_job *job = (slot_job *)ctx;
    for (uint32_t k = 0; k < job->ring->chunks_per_slot; k++) {
        int did;
        CUresult err = register_chunk(job->ring, job->slot, k, &did);
        if (err != CUDA_SUCCESS)
            return err;
        job->registered_any |= did;
    }
    return CUDA_SUCCESS;
}

/* one cuMemcpyHtoDAsync per piece of a range that lies inside one chunk */
static CUresult run_copies(void *ctx) {
    slot_job *job = (slot_job *)ctx;
    char *src = slot_data(job->ring, job->slot);
    for (Py_ssize_t i = 0; i < job->count; i++) {
        uint64_t off = (uint64_t)job->triples[3 * i], left = (uint64_t)job->triples[3 * i + 2];
        CUdeviceptr dst = (CUdeviceptr)job->triples[3 * i + 1];
        while (left > 0) {
            uint64_t piece = (off / PIN_CHUNK + 1) * PIN_CHUNK - off;
            if (piece > left)
                piece = left;
            CUresult err = hl_cu.cuMemcpyHtoDAsync(dst, src + off, (size_t)piece, job->stream);
            if (err != CUDA_SUCCESS)
                return err;
            off += piece;
            dst += piece;
            left -= piece;
        }
    }
    return CUDA_SUCCESS;
}
#endif

const char hl_ring_cuda_register_slot_doc[] = "cuda_register_slot(slot, device) -> bool\n\n"
             "Page-lock (cuMemHostRegister, portable) whatever part of the slot the background thread of\n"
             "populate_all has not yet, so that copies from it run at DMA speed; True when this call\n"
             "registered something. close() unregisters everything. One device per ring.";
PyObject *hl_ring_cuda_register_slot(PyObject *self, PyObject *args) {
    RingObject *r = (RingObject *)self;
    long long slot;
    int device;
    PyObject *module = PyType_GetModule(Py_TYPE(self));
    if (!PyArg_ParseTuple(args, "Li:cuda_register_slot", &slot, &device) || module == NULL ||
        hl_ring_check_slot(r, slot) < 0)
        return NULL;
    if (slot_registered(r, (uint32_t)slot))
        Py_RETURN_FALSE;
    if (hl_cuda_require(module, device) < 0 || claim_device(r, device) < 0)
        return NULL;
#ifdef HOTLOOP_WITH_CUDA
    slot_job job = {r, (uint32_t)slot, 0, NULL, 0, NULL};
    if (hl_cuda_run(module, device, run_register, &job) < 0)
        return NULL;
    return PyBool_FromLong(job.registered_any);
#else
    Py_RETURN_FALSE;
#endif
}

const char hl_ring_copy_to_device_doc[] = "copy_to_device(slot, packed, stream, device)\n\n"
             "cuMemcpyHtoDAsync from the (registered) slot to device memory on `stream`: packed holds int64\n"
             "triples (offset in the slot, device address, bytes), each split at the registration chunks.\n"
             "Nothing waits; the caller records an event after and frees the slot only once it completed.";
PyObject *hl_ring_copy_to_device(PyObject *self, PyObject *args) {
    RingObject *r = (RingObject *)self;
    long long slot;
    PyObject *packed;
    unsigned long long stream;
    int device;
    const int64_t *t;
    Py_ssize_t n;
    PyObject *module = PyType_GetModule(Py_TYPE(self));
    if (!PyArg_ParseTuple(args, "LOKi:copy_to_device", &slot, &packed, &stream, &device) || module == NULL ||
        hl_ring_check_slot(r, slot) < 0 || hl_ring_parse_triples(packed, "packed", &t, &n) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (hl_ring_check_range(r, t[3 * i], t[3 * i + 2]) < 0)
            return NULL;
    if (hl_cuda_require(module, device) < 0)
        return NULL;
#ifdef HOTLOOP_WITH_CUDA
    slot_job job = {r, (uint32_t)slot, 0, t, n, hl_stream(stream)};
    if (hl_cuda_run(module, device, run_copies, &job) < 0)
        return NULL;
#else
    (void)stream;
#endif
    Py_RETURN_NONE;
}

const char hl_ring_slot_pinned_doc[] = "slot_pinned(slot) -> bool\n\n"
             "Whether the whole slot is page-locked (by the background thread of populate_all or by\n"
             "cuda_register_slot). Registers nothing: a copy that can wait asks this first.";
PyObject *hl_ring_slot_pinned(PyObject *self, PyObject *arg) {
    RingObject *r = (RingObject *)self;
    long long slot = PyLong_AsLongLong(arg);
    if ((slot == -1 && PyErr_Occurred()) || hl_ring_check_slot(r, slot) < 0)
        return NULL;
    return PyBool_FromLong(r->chunk_state != NULL && slot_registered(r, (uint32_t)slot));
}

PyObject *hl_ring_get_registered(PyObject *self, void *closure) {
    (void)closure;
    RingObject *r = (RingObject *)self;
    long count = 0;
    for (uint32_t s = 0; r->chunk_state != NULL && s < r->nslots; s++)
        count += slot_registered(r, s);
    return PyLong_FromLong(count);
}
