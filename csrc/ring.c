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
#include "ring_object.h"

#ifndef PyBUF_WRITE
#define PyBUF_WRITE 0x200 /* the limited API names it only from 3.11; the value is CPython's */
#endif

/* the most slots a ring takes (at most 256 KiB of 64-byte control blocks before the first slot) */
#define HL_RING_MAX_SLOTS 4096

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

int hl_ring_check_open(RingObject *r) {
    if (r->base == NULL) {
        PyErr_SetString(PyExc_ValueError, "the ring is closed");
        return -1;
    }
    return 0;
}

int hl_ring_check_slot(RingObject *r, long long slot) {
    if (hl_ring_check_open(r) < 0)
        return -1;
    if (slot < 0 || slot >= (long long)r->nslots) {
        PyErr_Format(PyExc_IndexError, "slot %lld out of range: the ring has %u slots", slot, r->nslots);
        return -1;
    }
    return 0;
}

/* The slot number of a one-argument method (METH_O): 0, or -1 with TypeError/IndexError set. */
static int slot_arg(RingObject *r, PyObject *arg, long long *slot) {
    *slot = PyLong_AsLongLong(arg);
    if (*slot == -1 && PyErr_Occurred())
        return -1;
    return hl_ring_check_slot(r, *slot);
}

/* one madvise(MADV_POPULATE_WRITE), or a touch per page on older kernels */
void hl_ring_fault_range(char *p, uint64_t nbytes) {
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
    if (madvise(p, nbytes, MADV_POPULATE_WRITE) != 0) {
        /* a read-modify-write of one byte per page: no writer of the slot can lose a byte to it, as
           the pages read here were either zero (never written) or written by this same process */
        for (uint64_t off = 0; off < nbytes; off += HL_PAGE)
            ((volatile char *)p)[off] = ((volatile char *)p)[off];
    }
}

void hl_ring_fault_in(RingObject *r, uint32_t slot) {
    hl_ring_fault_range(slot_data(r, slot), r->slot_bytes);
    atomic_store(&ctl_of(r, slot)->faulted, 1);
}

void hl_ring_release(RingObject *r) {
    hl_pin_release(r); /* threads stopped and memory unregistered before it is unmapped */
    if (r->base != NULL)
        munmap(r->base, r->nbytes);
    r->base = NULL;
    if (r->fd >= 0)
        close(r->fd);
    r->fd = -1;
}

/* Ring(nslots, slot_bytes, fd=-1, populate=False): a new memfd ring, or (fd given: the creator's memfd,
   inherited across fork or received over a socket) the same ring mapped into this process. Never a
   reopen through /proc/PID/fd: that needs the creator to be dumpable, which a process that called
   prctl(PR_SET_DUMPABLE, 0) or changed its credentials is not. */
static PyObject *ring_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"nslots", "slot_bytes", "fd", "populate", NULL};
    long long nslots = 0, slot_bytes = 0;
    int fd = -1, populate = 0;
    RingObject *r = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LL|ip:Ring", kwlist, &nslots, &slot_bytes, &fd, &populate))
        return NULL;
    if (nslots < 1 || nslots > HL_RING_MAX_SLOTS) {
        PyErr_Format(PyExc_ValueError, "nslots: expected 1 to %d, got %lld", HL_RING_MAX_SLOTS, nslots);
        return NULL;
    }
    if (slot_bytes < 1) {
        PyErr_Format(PyExc_ValueError, "slot_bytes: expected a positive size, got %lld", slot_bytes);
        return NULL;
    }
    if (fd < -1) {
        PyErr_Format(PyExc_ValueError, "fd: expected a file descriptor or -1, got %d", fd);
        return NULL;
    }
    r = (RingObject *)PyType_GenericAlloc(type, 0);
    if (r == NULL)
        return NULL;
    r->fd = fd; /* the ring's once this call succeeds: closed with the ring */
    r->pid = getpid();
    r->nslots = (uint32_t)nslots;
    r->slot_bytes = round_up((uint64_t)slot_bytes, HL_PAGE);
    r->data_offset = round_up(sizeof(hl_ring_header) + (uint64_t)nslots * sizeof(hl_slot_ctl), HL_PAGE);
    r->nbytes = (size_t)(r->data_offset + r->nslots * r->slot_bytes);
    r->owner = fd < 0;
    if (hl_pin_init(r) < 0) {
        PyErr_NoMemory();
        goto error;
    }

    int err = 0, too_small = 0;
    Py_BEGIN_ALLOW_THREADS
    if (r->owner) {
        /* memfd, not a /dev/shm file: no name to leak, no 64 MB Docker /dev/shm limit */
        r->fd = memfd_create("hotloop-ring", MFD_CLOEXEC);
        if (r->fd < 0 || ftruncate(r->fd, (off_t)r->nbytes) < 0)
            err = errno;
    } else {
        /* a mapping past the end of the file would raise SIGBUS at the first touch there */
        struct stat st;
        if (fstat(r->fd, &st) < 0)
            err = errno;
        else if ((uint64_t)st.st_size < (uint64_t)r->nbytes)
            too_small = 1;
    }
    if (err == 0 && !too_small) {
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
                     r->owner ? "memfd_create/mmap" : "attach", r->nbytes, strerror(err));
        goto error;
    }
    if (too_small) {
        PyErr_Format(PyExc_ValueError, "Ring: fd %d is smaller than a ring of %u slots of %llu bytes", fd,
                     r->nslots, (unsigned long long)r->slot_bytes);
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
        PyErr_Format(PyExc_ValueError, "Ring: fd %d is not a ring of %u slots of %llu bytes", fd, r->nslots,
                     (unsigned long long)r->slot_bytes);
        goto error;
    }
    return (PyObject *)r;
error:
    if (!r->owner)
        r->fd = -1; /* still the caller's, who closes it */
    Py_DECREF(r);
    return NULL;
}

static void ring_dealloc(PyObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    hl_ring_release((RingObject *)self);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(self);
    Py_DECREF(type);
}

PyDoc_STRVAR(close_doc, "close()\n\nUnregister pinned memory, unmap and close the memfd. Idempotent. Any view\n"
             "taken with view() must be gone before.");
static PyObject *ring_close(PyObject *self, PyObject *Py_UNUSED(a)) {
    RingObject *r = (RingObject *)self;
    Py_BEGIN_ALLOW_THREADS
    hl_ring_release(r);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(view_doc, "view(slot) -> memoryview\n\nThe slot's bytes, writable. The ring must outlive the view:"
             " the caller keeps it.");
static PyObject *ring_view(PyObject *self, PyObject *arg) {
    RingObject *r = (RingObject *)self;
    long long slot;
    if (slot_arg(r, arg, &slot) < 0)
        return NULL;
    return PyMemoryView_FromMemory(slot_data(r, (uint32_t)slot), (Py_ssize_t)r->slot_bytes, PyBUF_WRITE);
}

PyDoc_STRVAR(slot_address_doc, "slot_address(slot) -> int\n\nAddress of the slot's first byte in this process.");
static PyObject *ring_slot_address(PyObject *self, PyObject *arg) {
    RingObject *r = (RingObject *)self;
    long long slot;
    if (slot_arg(r, arg, &slot) < 0)
        return NULL;
    return PyLong_FromVoidPtr(slot_data(r, (uint32_t)slot));
}

PyDoc_STRVAR(state_doc, "state(slot) -> int\n\nThe slot's state (FREE, ASSIGNED, READY, ERROR), read with acquire order.");
static PyObject *ring_state(PyObject *self, PyObject *arg) {
    RingObject *r = (RingObject *)self;
    long long slot;
    if (slot_arg(r, arg, &slot) < 0)
        return NULL;
    return PyLong_FromUnsignedLong(atomic_load_explicit(&ctl_of(r, (uint32_t)slot)->state, memory_order_acquire));
}

PyDoc_STRVAR(set_state_doc, "set_state(slot, state)\n\nStore a state (release order) and wake the waiters.");
static PyObject *ring_set_state(PyObject *self, PyObject *args) {
    RingObject *r = (RingObject *)self;
    long long slot;
    unsigned int state;
    if (!PyArg_ParseTuple(args, "LI:set_state", &slot, &state) || hl_ring_check_slot(r, slot) < 0)
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
        hl_ring_check_slot(r, slot) < 0)
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
static PyObject *ring_info(PyObject *self, PyObject *arg) {
    RingObject *r = (RingObject *)self;
    long long slot;
    if (slot_arg(r, arg, &slot) < 0)
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
    if (!PyArg_ParseTuple(args, "LId|p:wait", &slot, &not_state, &timeout, &any_change) || hl_ring_check_slot(r, slot) < 0)
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

int hl_ring_parse_triples(PyObject *packed, const char *argname, const int64_t **out, Py_ssize_t *count) {
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

int hl_ring_check_range(RingObject *r, int64_t offset, int64_t nbytes) {
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
    if (!PyArg_ParseTuple(args, "LO:copy_out", &slot, &packed) || hl_ring_check_slot(r, slot) < 0 ||
        hl_ring_parse_triples(packed, "packed", &t, &n) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (hl_ring_check_range(r, t[3 * i], t[3 * i + 2]) < 0)
            return NULL;
    char *src = slot_data(r, (uint32_t)slot);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        memcpy((void *)(uintptr_t)t[3 * i + 1], src + t[3 * i], (size_t)t[3 * i + 2]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(prefault_doc, "prefault(slot)\n\n"
             "Fault in (writable) every page of the slot in one call (MADV_POPULATE_WRITE, or a touch per page\n"
             "on older kernels), GIL released: the batch copy that follows runs at memory speed. Pages another\n"
             "process faulted in already only need mapping here, which is cheap.");
static PyObject *ring_prefault(PyObject *self, PyObject *arg) {
    RingObject *r = (RingObject *)self;
    long long slot;
    if (slot_arg(r, arg, &slot) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    hl_ring_fault_in(r, (uint32_t)slot);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(faulted_doc, "faulted(slot) -> bool\n\nWhether some process faulted the slot's pages in already.");
static PyObject *ring_faulted(PyObject *self, PyObject *arg) {
    RingObject *r = (RingObject *)self;
    long long slot;
    if (slot_arg(r, arg, &slot) < 0)
        return NULL;
    return PyBool_FromLong(atomic_load(&ctl_of(r, (uint32_t)slot)->faulted) != 0);
}

static PyObject *get_fd(PyObject *self, void *c) { (void)c; return PyLong_FromLong(((RingObject *)self)->fd); }
static PyObject *get_nslots(PyObject *self, void *c) { (void)c; return PyLong_FromUnsignedLong(((RingObject *)self)->nslots); }
static PyObject *get_slot_bytes(PyObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLongLong(((RingObject *)self)->slot_bytes);
}
static PyObject *get_nbytes(PyObject *self, void *c) { (void)c; return PyLong_FromSize_t(((RingObject *)self)->nbytes); }
static PyObject *get_closed(PyObject *self, void *c) { (void)c; return PyBool_FromLong(((RingObject *)self)->base == NULL); }
static PyObject *get_completions(PyObject *self, void *c) {
    (void)c;
    RingObject *r = (RingObject *)self;
    if (hl_ring_check_open(r) < 0)
        return NULL;
    return PyLong_FromUnsignedLong(atomic_load(&header_of(r)->completions));
}

static PyGetSetDef ring_getset[] = {
    {"fd", get_fd, NULL, "the memfd (-1 once closed)", NULL},
    {"nslots", get_nslots, NULL, "slots in the ring", NULL},
    {"slot_bytes", get_slot_bytes, NULL, "bytes per slot (a multiple of 4096)", NULL},
    {"nbytes", get_nbytes, NULL, "bytes of shared memory, control blocks included", NULL},
    {"closed", get_closed, NULL, "True once close() ran", NULL},
    {"registered", hl_ring_get_registered, NULL, "how many slots are page-locked (registered with the driver) now", NULL},
    {"completions", get_completions, NULL, "the futex counter, bumped on every state change", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef ring_methods[] = {
    {"close", ring_close, METH_NOARGS, close_doc},
    {"view", ring_view, METH_O, view_doc},
    {"slot_address", ring_slot_address, METH_O, slot_address_doc},
    {"state", ring_state, METH_O, state_doc},
    {"set_state", ring_set_state, METH_VARARGS, set_state_doc},
    {"publish", ring_publish, METH_VARARGS, publish_doc},
    {"info", ring_info, METH_O, info_doc},
    {"wait", ring_wait, METH_VARARGS, wait_doc},
    {"copy_out", ring_copy_out, METH_VARARGS, copy_out_doc},
    {"prefault", ring_prefault, METH_O, prefault_doc},
    {"faulted", ring_faulted, METH_O, faulted_doc},
    {"populate_all", hl_ring_populate_all, METH_VARARGS, hl_ring_populate_all_doc},
    {"cuda_register_slot", hl_ring_cuda_register_slot, METH_VARARGS, hl_ring_cuda_register_slot_doc},
    {"slot_pinned", hl_ring_slot_pinned, METH_O, hl_ring_slot_pinned_doc},
    {"copy_to_device", hl_ring_copy_to_device, METH_VARARGS, hl_ring_copy_to_device_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(ring_doc, "Ring(nslots, slot_bytes, fd=-1, populate=False)\n\n"
             "Slots of shared memory from memfd_create (no /dev/shm file), pre-faulted all at once (populate)\n"
             "or slot by slot (prefault). Without fd a new ring is made; with fd (the creator's memfd, inherited\n"
             "or received over a socket) that ring is mapped here and owns fd from then on (closed with it; if the\n"
             "call raises, fd stays the caller's).\n"
             "Slot states live in the shared memory and change with atomics; wait() sleeps on a futex.");

static PyType_Slot ring_slots[] = {
    {Py_tp_new, ring_new},
    {Py_tp_dealloc, ring_dealloc},
    {Py_tp_methods, ring_methods},
    {Py_tp_getset, ring_getset},
    {Py_tp_doc, (void *)ring_doc},
    {0, NULL},
};


static PyType_Spec ring_spec = {
    .name = "hotloop._C.Ring",
    .basicsize = sizeof(RingObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = ring_slots,
};

static const hl_int_constant ring_constants[] = {
    {"RING_FREE", HL_SLOT_FREE},
    {"RING_ASSIGNED", HL_SLOT_ASSIGNED},
    {"RING_READY", HL_SLOT_READY},
    {"RING_ERROR", HL_SLOT_ERROR},
    {"RING_FLAG_OVERFLOW", HL_SLOT_FLAG_OVERFLOW},
    {"RING_MAX_SLOTS", HL_RING_MAX_SLOTS},
    {"RING_PAGE_BYTES", (long)HL_PAGE}, /* slot sizes and the data offset are multiples of it */
    {NULL, 0},
};

int hl_ring_exec(PyObject *module) {
    hl_state *state = hl_state_of(module);
    state->ring_type = PyType_FromModuleAndSpec(module, &ring_spec, NULL);
    if (state->ring_type == NULL)
        return -1;
    if (PyModule_AddType(module, (PyTypeObject *)state->ring_type) < 0 || hl_ring_leases_exec(module) < 0)
        return -1;
    return hl_add_int_constants(module, ring_constants);
}
