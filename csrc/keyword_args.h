/* Keyword-only arguments for the entry points that take many: each value found by its name, so that a swapped pair cannot pass. */
#ifndef HOTLOOP_KEYWORD_ARGS_H
#define HOTLOOP_KEYWORD_ARGS_H

#include "module.h"

/* NOTE [ Keyword-only seams ]
   An entry point that takes more than six values (addresses, counts, flags, factors) takes them by
   keyword only: two ints or two addresses given in the wrong order would otherwise pass every check
   and give a wrong answer. Such a function is METH_FASTCALL | METH_KEYWORDS (stable ABI since 3.10):
   the caller's names arrive as one tuple that the compiler made once, the values as an array, so no
   tuple or dict is built per call, and hl_parse_keywords finds each name with one comparison when
   the caller gives them in the declared order (a few more otherwise). That keeps a call as cheap as
   the positional one it replaced, which the scaler and the optimizers make every step. */

enum hl_arg_kind {
    HL_ARG_INT,     /* int */
    HL_ARG_INT64,   /* long long */
    HL_ARG_ADDRESS, /* unsigned long long: an address or a stream handle; negative is an error */
    HL_ARG_FLOAT,   /* float */
    HL_ARG_DOUBLE,  /* double */
    HL_ARG_BOOL,    /* int, 0 or 1, from the value's truth */
    HL_ARG_OBJECT,  /* PyObject *, borrowed for the call */
};

typedef struct {
    const char *name;
    enum hl_arg_kind kind;
    void *dst;    /* where the value goes; holds the default of an optional argument */
    int optional; /* 0: required */
} hl_arg;

/* The signature of a METH_FASTCALL | METH_KEYWORDS function; cast with HL_FASTCALL_KEYWORDS for its
   PyMethodDef (the limited API of 3.10 does not name the type). */
typedef PyObject *(*hl_fastcall_keywords)(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                          PyObject *kwnames);
#define HL_FASTCALL_KEYWORDS(fn) ((PyCFunction)(void (*)(void))(hl_fastcall_keywords)(fn))

/* Fill spec[0..n) (n <= 64) from a keyword-only call: 0, or -1 with a TypeError naming `function` and
   the argument (a positional value, an unknown or missing name, a value of the wrong type) or an
   OverflowError (a value out of its C type's range). */
int hl_parse_keywords(const char *function, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                      hl_arg *spec, int n);

#define HL_ARGS_COUNT(spec) ((int)(sizeof(spec) / sizeof((spec)[0])))

#endif
