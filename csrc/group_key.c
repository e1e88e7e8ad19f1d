/* _C.group_key: the key of one param group's optimizer step (python/hotloop/optim/group_key.py says what
   it holds and why), read here because a step's host time is mostly these reads: the same calls into
   torch's tensor methods, without the interpreter's work around each. */
#include "module.h"

/* the attribute and method names read per tensor, interned once per call */
typedef struct {
    PyObject *grad, *data_ptr, *dtype, *shape, *stride;
} tensor_names;

static void names_clear(tensor_names *n) {
    Py_XDECREF(n->grad);
    Py_XDECREF(n->data_ptr);
    Py_XDECREF(n->dtype);
    Py_XDECREF(n->shape);
    Py_XDECREF(n->stride);
}

static int names_make(tensor_names *n) {
    n->grad = PyUnicode_InternFromString("grad");
    n->data_ptr = PyUnicode_InternFromString("data_ptr");
    n->dtype = PyUnicode_InternFromString("dtype");
    n->shape = PyUnicode_InternFromString("shape");
    n->stride = PyUnicode_InternFromString("stride");
    return n->grad && n->data_ptr && n->dtype && n->shape && n->stride ? 0 : -1;
}

/* append `item` (a new reference, or NULL after a failure) to `out`: 0, or -1 with an exception */
static int append_new(PyObject *out, PyObject *item) {
    if (item == NULL)
        return -1;
    int rc = PyList_Append(out, item);
    Py_DECREF(item);
    return rc;
}

/* a tensor's data_ptr(), dtype, shape and stride(), appended to `out` */
static int append_layout(PyObject *out, PyObject *t, const tensor_names *n) {
    if (append_new(out, PyObject_CallMethodObjArgs(t, n->data_ptr, NULL)) < 0 ||
        append_new(out, PyObject_GetAttr(t, n->dtype)) < 0 || append_new(out, PyObject_GetAttr(t, n->shape)) < 0)
        return -1;
    return append_new(out, PyObject_CallMethodObjArgs(t, n->stride, NULL));
}

/* one parameter's part of the key; 0, or -1 with an exception */
static int append_param(PyObject *out, PyObject *state, PyObject *p, PyObject *keys, const tensor_names *n) {
    PyObject *g = PyObject_GetAttr(p, n->grad);
    if (g == NULL)
        return -1;
    if (g == Py_None) {
        Py_DECREF(g);
        return PyList_Append(out, Py_None);
    }
    int rc = append_layout(out, p, n) < 0 || append_layout(out, g, n) < 0 ? -1 : 0;
    Py_DECREF(g);
    if (rc < 0)
        return -1;
    Py_ssize_t nkeys = PyTuple_Size(keys);
    if (nkeys == 0)
        return 0;
    PyObject *st = PyDict_GetItemWithError(state, p); /* borrowed; a defaultdict's factory is not called */
    if (st == NULL) {
        if (!PyErr_Occurred()) /* no state yet: the step makes it */
            PyErr_SetString(PyExc_KeyError, "no state");
        return -1;
    }
    Py_INCREF(st);
    for (Py_ssize_t k = 0; k < nkeys && rc == 0; k++) {
        PyObject *t = PyObject_GetItem(st, PyTuple_GetItem(keys, k));
        if (t == NULL) {
            rc = -1;
            break;
        }
        rc = append_new(out, PyLong_FromVoidPtr(t)) < 0 ||
                     append_new(out, PyObject_CallMethodObjArgs(t, n->data_ptr, NULL)) < 0
                 ? -1
                 : 0;
        Py_DECREF(t);
    }
    Py_DECREF(st);
    return rc;
}

PyDoc_STRVAR(group_key_doc,
             "group_key(state, params, keys) -> tuple or None\n\n"
             "hotloop.optim.group_key.group_key's key: per parameter None without a gradient, else the address,\n"
             "dtype, shape and strides of the parameter and of its gradient, and the identity and address of\n"
             "each of its state tensors named in `keys` (a tuple of str). None where a parameter with a\n"
             "gradient has no such state, or a read fails with TypeError, KeyError, AttributeError or\n"
             "RuntimeError (a sparse gradient's strides); any other exception propagates.");

static PyObject *py_group_key(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *state, *params, *keys;
    if (!PyArg_ParseTuple(args, "O!OO!:group_key", &PyDict_Type, &state, &params, &PyTuple_Type, &keys))
        return NULL;
    PyObject *seq = PySequence_Fast(params, "group_key: params: expected a sequence of tensors");
    if (seq == NULL)
        return NULL;
    tensor_names names = {0};
    PyObject *out = PyList_New(0), *key = NULL;
    int rc = out != NULL && names_make(&names) == 0 ? 0 : -1;
    Py_ssize_t count = PySequence_Size(seq);
    int is_list = PyList_Check(seq); /* PySequence_Fast gives a list or a tuple */
    for (Py_ssize_t i = 0; i < count && rc == 0; i++) {
        PyObject *p = is_list ? PyList_GetItem(seq, i) : PyTuple_GetItem(seq, i); /* borrowed */
        rc = append_param(out, state, p, keys, &names);
    }
    if (rc == 0) {
        key = PyList_AsTuple(out);
    } else if (PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_KeyError) ||
               PyErr_ExceptionMatches(PyExc_AttributeError) || PyErr_ExceptionMatches(PyExc_RuntimeError)) {
        PyErr_Clear(); /* the step checks everything instead, and says what is wrong */
        key = Py_NewRef(Py_None);
    }
    names_clear(&names);
    Py_XDECREF(out);
    Py_DECREF(seq);
    return key;
}

static PyMethodDef group_key_methods[] = {
    {"group_key", py_group_key, METH_VARARGS, group_key_doc},
    {NULL, NULL, 0, NULL},
};

int hl_group_key_exec(PyObject *module) { return PyModule_AddFunctions(module, group_key_methods); }
