/* JPEG headers read in C: a bounds-checked walk of the markers up to the first scan, and _C.jpeg_header. */
#include "module.h"
#include "jpeg_header.h"

#include <string.h>

/* ---------------------------------------------------------------------------------------------
   The walk. Every read is checked against `size` before it happens; the entropy-coded data after
   the first scan header is never read, only the last bytes (for EOI). */

static unsigned be16(const uint8_t *p) { return (unsigned)p[0] << 8 | p[1]; }

static int is_sof(unsigned marker) {
    /* C4 (DHT), C8 (JPG) and CC (DAC) share the range but are not frame headers */
    return marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC;
}

static int corrupt(const char **why, const char *what) {
    *why = what;
    return HL_JPEG_CORRUPT;
}

int hl_jpeg_parse(const uint8_t *data, size_t size, hl_jpeg_info *info, const char **why) {
    memset(info, 0, sizeof(*info));
    info->adobe_transform = -1;
    *why = NULL;
    if (size < 2 || data[0] != 0xFF || data[1] != 0xD8)
        return HL_JPEG_NOT_JPEG;
    int frame = 0;
    size_t p = 2;
    for (;;) {
        /* as libjpeg and PIL do: step over junk before a marker, then over FF fill bytes */
        while (p < size && data[p] != 0xFF)
            p++;
        while (p < size && data[p] == 0xFF)
            p++;
        if (p >= size) {
            if (!frame)
                return corrupt(why, "the data ends before the frame header (SOF)");
            break;
        }
        unsigned marker = data[p++];
        if (marker == 0x00 || marker == 0x01 || (marker >= 0xD0 && marker <= 0xD7))
            continue; /* a stuffed FF 00 outside a scan (junk), TEM, RSTn: no length follows */
        if (marker == 0xD8 || marker == 0xD9 || (marker >= 0x02 && marker <= 0xBF)) {
            if (!frame)
                return corrupt(why, marker == 0xD8   ? "a second SOI marker before the frame header"
                                    : marker == 0xD9 ? "EOI before the frame header (SOF)"
                                                     : "a reserved marker before the frame header (SOF)");
            break;
        }
        if (marker == 0xDA && !frame)
            return corrupt(why, "a scan (SOS) before the frame header (SOF)");
        if (size - p < 2) {
            if (!frame)
                return corrupt(why, "the data ends inside a marker before the frame header (SOF)");
            break;
        }
        size_t length = be16(data + p); /* counts its own two bytes */
        if (length < 2 || length > size - p) {
            if (!frame)
                return corrupt(why, length < 2 ? "a marker segment length below 2"
                                               : "the data ends inside a marker segment before the frame header (SOF)");
            break;
        }
        const uint8_t *s = data + p + 2;
        size_t n = length - 2;
        p += length;
        if (marker == 0xDA) {
            info->scan = 1;
            break;
        }
        if (is_sof(marker)) {
            if (frame)
                break; /* a second frame header: libjpeg refuses the file; scan stays 0 */
            if (n < 6)
                return corrupt(why, "a frame header (SOF) shorter than 6 bytes");
            int components = s[5];
            if (components == 0)
                return corrupt(why, "a frame header (SOF) with no components");
            if (n < 6 + 3 * (size_t)components)
                return corrupt(why, "a frame header (SOF) shorter than its component list");
            info->precision = s[0];
            info->height = (int)be16(s + 1);
            info->width = (int)be16(s + 3);
            if (info->height == 0 || info->width == 0) /* height 0 defers to a DNL marker: libjpeg refuses */
                return corrupt(why, "a frame header (SOF) with a height or width of 0");
            info->components = components;
            for (int c = 0; c < components && c < HL_JPEG_MAX_COMPONENTS; c++) {
                info->component_id[c] = s[6 + 3 * c];
                info->sampling[c] = s[7 + 3 * c];
            }
            info->process = marker == 0xC0 ? HL_JPEG_BASELINE
                          : marker == 0xC1 ? HL_JPEG_EXTENDED
                          : marker == 0xC2 ? HL_JPEG_PROGRESSIVE
                                           : HL_JPEG_OTHER;
            frame = 1;
        } else if (marker == 0xE0 && n >= 5 && memcmp(s, "JFIF\0", 5) == 0) {
            info->jfif = 1;
        } else if (marker == 0xEE && n >= 12 && memcmp(s, "Adobe", 5) == 0) {
            info->adobe_transform = s[11]; /* as libjpeg reads APP14: version, flags0, flags1, transform */
        }
    }
    /* A file cut short in its entropy-coded data lacks the EOI at its end (FF D9 cannot occur inside
       entropy-coded data). Zero or FF bytes after the EOI (padding) are allowed; other trailing bytes
       make this 0 although PIL decodes such a file. */
    size_t end = size;
    while (end > p && (data[end - 1] == 0x00 || data[end - 1] == 0xFF))
        end--;
    info->ends_with_eoi = end >= p + 2 && data[end - 2] == 0xFF && data[end - 1] == 0xD9;
    return HL_JPEG_OK;
}

int hl_jpeg_is_rgb(const hl_jpeg_info *info) {
    if (info->components != 3 || info->jfif)
        return 0;
    if (info->adobe_transform >= 0)
        return info->adobe_transform == 0;
    return info->component_id[0] == 'R' && info->component_id[1] == 'G' && info->component_id[2] == 'B';
}

/* ---------------------------------------------------------------------------------------------
   Bytes from any object with the buffer protocol. The buffer functions joined the limited API in
   3.11 with the Py_buffer layout they have had since 3.3, and CPython 3.10 exports them too: declared
   here for a 3.10 limited-API build, so one abi3 _C reads buffers on every CPython >= 3.10. */

#if defined(Py_LIMITED_API) && Py_LIMITED_API + 0 < 0x030B0000
typedef struct {
    void *buf;
    PyObject *obj;
    Py_ssize_t len;
    Py_ssize_t itemsize;
    int readonly;
    int ndim;
    char *format;
    Py_ssize_t *shape;
    Py_ssize_t *strides;
    Py_ssize_t *suboffsets;
    void *internal;
} Py_buffer;
PyAPI_FUNC(int) PyObject_CheckBuffer(PyObject *obj);
PyAPI_FUNC(int) PyObject_GetBuffer(PyObject *obj, Py_buffer *view, int flags);
PyAPI_FUNC(void) PyBuffer_Release(Py_buffer *view);
#define PyBUF_SIMPLE 0
#endif

PyDoc_STRVAR(jpeg_header_doc,
             "jpeg_header(buffer) -> JpegInfo | None\n\n"
             "The frame of a JPEG from its markers: (height, width, components, process, adobe_transform,\n"
             "ends_with_eoi), plus the attributes precision (bits per sample), rgb (libjpeg takes the three\n"
             "components as RGB, not YCbCr) and scan (a scan header follows: the header is complete).\n"
             "process: JPEG_BASELINE, JPEG_EXTENDED, JPEG_PROGRESSIVE or JPEG_OTHER (lossless, hierarchical,\n"
             "arithmetic); adobe_transform: -1 without an APP14 Adobe marker, else its transform (0: RGB or\n"
             "CMYK, 1: YCbCr, 2: YCCK); ends_with_eoi: the bytes end with EOI (after any 00/FF padding); a\n"
             "file cut short in its data does not. `buffer`: bytes or any C-contiguous buffer (memoryview,\n"
             "numpy array). None when it does not start with SOI; ValueError when the header is corrupt or\n"
             "ends before the frame header. Reads the markers and the last bytes only.");

static PyObject *py_jpeg_header(PyObject *module, PyObject *obj) {
    Py_buffer view;
    const uint8_t *data;
    Py_ssize_t size;
    int have_view = 0;
    if (PyBytes_Check(obj)) { /* the common case, without the buffer machinery */
        char *bytes;
        if (PyBytes_AsStringAndSize(obj, &bytes, &size) < 0)
            return NULL;
        data = (const uint8_t *)bytes;
    } else {
        if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) {
            if (!PyObject_CheckBuffer(obj)) { /* a buffer's own error (not contiguous) says what it is */
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "jpeg_header: expected bytes or a C-contiguous buffer (memoryview, "
                             "numpy array), got %R", (PyObject *)Py_TYPE(obj));
            }
            return NULL;
        }
        have_view = 1;
        data = (const uint8_t *)view.buf;
        size = view.len;
    }
    hl_jpeg_info info;
    const char *why = NULL;
    int rc = hl_jpeg_parse(data, (size_t)size, &info, &why);
    if (have_view)
        PyBuffer_Release(&view);
    if (rc == HL_JPEG_NOT_JPEG)
        Py_RETURN_NONE;
    if (rc == HL_JPEG_CORRUPT) {
        PyErr_Format(PyExc_ValueError, "jpeg_header: corrupt JPEG: %s", why);
        return NULL;
    }
    PyObject *result = PyStructSequence_New((PyTypeObject *)hl_state_of(module)->jpeg_info_type);
    if (result == NULL)
        return NULL;
    PyObject *items[] = {
        PyLong_FromLong(info.height),          PyLong_FromLong(info.width), PyLong_FromLong(info.components),
        PyLong_FromLong(info.process),         PyLong_FromLong(info.adobe_transform),
        PyBool_FromLong(info.ends_with_eoi),   PyLong_FromLong(info.precision),
        PyBool_FromLong(hl_jpeg_is_rgb(&info)), PyBool_FromLong(info.scan),
    };
    int failed = 0;
    for (Py_ssize_t i = 0; i < (Py_ssize_t)(sizeof(items) / sizeof(items[0])); i++) {
        if (items[i] == NULL)
            failed = 1;
        else
            PyStructSequence_SetItem(result, i, items[i]); /* steals the reference */
    }
    if (failed) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

static PyStructSequence_Field jpeg_info_fields[] = {
    {"height", "pixels"},
    {"width", "pixels"},
    {"components", "1 grey, 3 YCbCr (or RGB), 4 CMYK or YCCK"},
    {"process", "JPEG_BASELINE, JPEG_EXTENDED, JPEG_PROGRESSIVE or JPEG_OTHER"},
    {"adobe_transform", "-1 without an APP14 Adobe marker, else its transform byte"},
    {"ends_with_eoi", "the data ends with EOI (after any 00/FF padding); a truncated file does not"},
    {"precision", "bits per sample (PIL opens 8 only)"},
    {"rgb", "libjpeg takes the three components as RGB, not YCbCr (nvjpeg would convert them)"},
    {"scan", "a scan header follows the frame header: the header is complete"},
    {NULL, NULL},
};

static PyStructSequence_Desc jpeg_info_desc = {
    "hotloop._C.JpegInfo",
    "What jpeg_header() read: a 6-tuple (height, width, components, process, adobe_transform,\n"
    "ends_with_eoi) with the attributes precision, rgb and scan besides.",
    jpeg_info_fields,
    6,
};

static PyMethodDef jpeg_header_methods[] = {
    {"jpeg_header", py_jpeg_header, METH_O, jpeg_header_doc},
    {NULL, NULL, 0, NULL},
};

static const hl_int_constant jpeg_header_constants[] = {
    {"JPEG_BASELINE", HL_JPEG_BASELINE},
    {"JPEG_EXTENDED", HL_JPEG_EXTENDED},
    {"JPEG_PROGRESSIVE", HL_JPEG_PROGRESSIVE},
    {"JPEG_OTHER", HL_JPEG_OTHER},
    {NULL, 0},
};

int hl_jpeg_header_exec(PyObject *module) {
    hl_state *state = hl_state_of(module);
    state->jpeg_info_type = (PyObject *)PyStructSequence_NewType(&jpeg_info_desc);
    if (state->jpeg_info_type == NULL)
        return -1;
    if (PyModule_AddObjectRef(module, "JpegInfo", state->jpeg_info_type) < 0 ||
        PyModule_AddFunctions(module, jpeg_header_methods) < 0)
        return -1;
    return hl_add_int_constants(module, jpeg_header_constants);
}
