/* The DLPack C ABI (v1.x and the legacy unversioned form): only the declarations hotloop reads. */
#ifndef HOTLOOP_DLPACK_H
#define HOTLOOP_DLPACK_H

#include <stdint.h>

enum { DL_CPU = 1, DL_CUDA = 2, DL_CUDA_HOST = 3, DL_CUDA_MANAGED = 13 };
enum { DL_INT = 0, DL_UINT = 1, DL_FLOAT = 2, DL_BFLOAT = 4, DL_COMPLEX = 5, DL_BOOL = 6 };
#define DL_MAJOR_VERSION 1
#define DL_FLAG_READ_ONLY (1ull << 0)

typedef struct {
    int32_t device_type;
    int32_t device_id;
} dl_device;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} dl_dtype;

typedef struct {
    void *data;
    dl_device device;
    int32_t ndim;
    dl_dtype dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL means compact row-major */
    uint64_t byte_offset;
} dl_tensor;

/* legacy capsule "dltensor" */
typedef struct dl_managed {
    dl_tensor tensor;
    void *manager_ctx;
    void (*deleter)(struct dl_managed *self);
} dl_managed;

/* versioned capsule "dltensor_versioned" */
typedef struct dl_managed_versioned {
    struct {
        uint32_t major;
        uint32_t minor;
    } version;
    void *manager_ctx;
    void (*deleter)(struct dl_managed_versioned *self);
    uint64_t flags;
    dl_tensor tensor;
} dl_managed_versioned;

#endif
