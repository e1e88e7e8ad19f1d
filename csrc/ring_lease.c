/* hotloop._C.RingLeases: ring slots lent to the consumer as tensors (DLPack), returned when the last one dies. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dlpack.h"
#include "ring_object.h"

/* RingLeases(ring).lease(slot, parts) returns one DLPack capsule ("dltensor", uint8) per part of
   the slot, for torch.from_dlpack: each leaf gets a storage of its own bytes, as a collated tensor
   has. torch calls a capsule's deleter when its storage dies, i.e. once no tensor, view, storage or
   numpy array made from it is left, from whichever thread drops the last one, often without the
   GIL. When the last part of a slot is gone the slot is marked returned with an atomic store; the
   main process collects returned slots with returned(). Each lease holds a reference to the
   RingLeases, which holds the ring, so the mapping outlives every leased tensor even after the pool
   closed. (The limited API of 3.10 cannot define a buffer exporter, hence DLPack.) */

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
        hl_ring_release(o->ring);
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
    if (hl_ring_check_open((RingObject *)ring) < 0)
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
    if (!PyArg_ParseTuple(args, "LO:lease", &slot, &packed) || hl_ring_check_slot(o->ring, slot) < 0)
        return NULL;
    if (!PyBytes_Check(packed) || PyBytes_Size(packed) % (2 * (Py_ssize_t)sizeof(int64_t)) != 0) {
        PyErr_Format(PyExc_TypeError, "parts: expected bytes of int64 (offset, bytes) pairs, got %R",
                     (PyObject *)Py_TYPE(packed));
        return NULL;
    }
    const int64_t *pairs = (const int64_t *)PyBytes_AsString(packed);
    Py_ssize_t n = PyBytes_Size(packed) / (2 * (Py_ssize_t)sizeof(int64_t));
    for (Py_ssize_t i = 0; i < n; i++)
        if (hl_ring_check_range(o->ring, pairs[2 * i], pairs[2 * i + 1]) < 0)
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
        hl_ring_release(o->ring);
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

int hl_ring_leases_exec(PyObject *module) {
    PyObject *type = PyType_FromModuleAndSpec(module, &leases_spec, NULL);
    if (type == NULL)
        return -1;
    int rc = PyModule_AddType(module, (PyTypeObject *)type);
    Py_DECREF(type);
    return rc;
}
