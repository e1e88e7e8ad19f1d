/* Keyword-only argument parsing for the entry points that take many values (NOTE [ Keyword-only seams ] in keyword_args.h). */
#include "keyword_args.h"

#include <limits.h>

static const char *kind_name(enum hl_arg_kind kind) {
    switch (kind) {
    case HL_ARG_INT:
    case HL_ARG_INT64:
        return "an int";
    case HL_ARG_ADDRESS:
        return "an int >= 0 (an address or handle)";
    case HL_ARG_FLOAT:
    case HL_ARG_DOUBLE:
        return "a number";
    default:
        return "a value";
    }
}

/* the value of one argument into its destination: 0, or -1 with an exception naming it */
static int convert(const char *function, const hl_arg *arg, PyObject *value) {
    switch (arg->kind) {
    case HL_ARG_INT: {
        long v = PyLong_AsLong(value);
        if (v == -1 && PyErr_Occurred())
            goto error;
        if (v < INT_MIN || v > INT_MAX) {
            PyErr_Format(PyExc_OverflowError, "%s: %s: %ld does not fit a C int", function, arg->name, v);
            return -1;
        }
        *(int *)arg->dst = (int)v;
        return 0;
    }
    case HL_ARG_INT64: {
        long long v = PyLong_AsLongLong(value);
        if (v == -1 && PyErr_Occurred())
            goto error;
        *(long long *)arg->dst = v;
        return 0;
    }
    case HL_ARG_ADDRESS: {
        unsigned long long v = PyLong_AsUnsignedLongLong(value);
        if (v == (unsigned long long)-1 && PyErr_Occurred())
            goto error;
        *(unsigned long long *)arg->dst = v;
        return 0;
    }
    case HL_ARG_FLOAT:
    case HL_ARG_DOUBLE: {
        double v = PyFloat_AsDouble(value);
        if (v == -1.0 && PyErr_Occurred())
            goto error;
        if (arg->kind == HL_ARG_FLOAT)
            *(float *)arg->dst = (float)v;
        else
            *(double *)arg->dst = v;
        return 0;
    }
    case HL_ARG_BOOL: {
        int v = PyObject_IsTrue(value);
        if (v < 0)
            return -1;
        *(int *)arg->dst = v;
        return 0;
    }
    case HL_ARG_OBJECT:
        *(PyObject **)arg->dst = value;
        return 0;
    }
    return 0;
error:
    if (PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: %s: expected %s, got %S", function, arg->name, kind_name(arg->kind),
                     (PyObject *)Py_TYPE(value));
    } else if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_OverflowError, "%s: %s: %R is out of range for %s", function, arg->name, value,
                     kind_name(arg->kind));
    }
    return -1;
}

/* the index in spec of `name`, trying `hint` first (callers give the names in the declared order); -1 if none */
static int find(const hl_arg *spec, int n, PyObject *name, int hint) {
    for (int k = 0; k < n; k++) {
        int i = (hint + k) % n;
        if (PyUnicode_CompareWithASCIIString(name, spec[i].name) == 0)
            return i;
    }
    return -1;
}

int hl_parse_keywords(const char *function, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                      hl_arg *spec, int n) {
    if (n > 64) { /* `seen` below has a bit per argument */
        PyErr_Format(PyExc_SystemError, "%s: %d keyword arguments declared, at most 64 are parsed", function, n);
        return -1;
    }
    if (nargs != 0) {
        PyErr_Format(PyExc_TypeError, "%s takes keyword arguments only (got %zd positional)", function, nargs);
        return -1;
    }
    const Py_ssize_t count = kwnames != NULL ? PyTuple_Size(kwnames) : 0;
    unsigned long long seen = 0;
    int hint = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *name = PyTuple_GetItem(kwnames, k);
        int i = find(spec, n, name, hint);
        if (i < 0) {
            PyErr_Format(PyExc_TypeError, "%s: unexpected keyword argument %R", function, name);
            return -1;
        }
        if (convert(function, &spec[i], args[k]) < 0)
            return -1;
        seen |= 1ull << i;
        hint = i + 1 < n ? i + 1 : 0;
    }
    for (int i = 0; i < n; i++)
        if (!spec[i].optional && !(seen & (1ull << i))) {
            PyErr_Format(PyExc_TypeError, "%s: missing keyword argument '%s'", function, spec[i].name);
            return -1;
        }
    return 0;
}
