/* nvjpeg for hotloop: the part of nvjpeg's C API it uses (no nvjpeg.h needed to build) and the library table nvjpeg.c offers. */
#ifndef HOTLOOP_NVJPEG_H
#define HOTLOOP_NVJPEG_H

#include "module.h"

#include <stddef.h>

/* nvjpeg is never linked: nvjpeg.c opens the library Python names with dlopen and looks each
   function up with dlsym, so these are types of function pointers, not prototypes. Values and
   layouts as nvjpeg.h (CUDA 13) declares them. */

typedef int nvjpegStatus_t; /* an enum in nvjpeg; int-sized */
enum {
    NVJPEG_STATUS_SUCCESS = 0,
    NVJPEG_STATUS_NOT_INITIALIZED = 1,
    NVJPEG_STATUS_INVALID_PARAMETER = 2,
    NVJPEG_STATUS_BAD_JPEG = 3,
    NVJPEG_STATUS_JPEG_NOT_SUPPORTED = 4,
    NVJPEG_STATUS_ALLOCATOR_FAILURE = 5,
    NVJPEG_STATUS_EXECUTION_FAILED = 6,
    NVJPEG_STATUS_ARCH_MISMATCH = 7,
    NVJPEG_STATUS_INTERNAL_ERROR = 8,
    NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED = 9,
    NVJPEG_STATUS_INCOMPLETE_BITSTREAM = 10,
};

enum { /* nvjpegBackend_t */
    NVJPEG_BACKEND_DEFAULT = 0,
    NVJPEG_BACKEND_HYBRID = 1,     /* Huffman decoding on the CPU, the rest on the SMs */
    NVJPEG_BACKEND_GPU_HYBRID = 2, /* Huffman decoding on the SMs too (batched, baseline, batches over 50) */
    NVJPEG_BACKEND_HARDWARE = 3,   /* the JPEG engines (A100, H100, H200...): baseline, one scan */
};

/* nvjpegOutputFormat_t: R, G, B interleaved in channel[0], the only format asked for (NOTE [ RGB out of
   nvjpeg ] in nvjpeg_engine.c) */
enum { NVJPEG_OUTPUT_RGBI = 5 };
enum { NVJPEG_CSS_444 = 0 }; /* nvjpegChromaSubsampling_t: the layout that holds any other */
enum { NVJPEG_FLAGS_DEFAULT = 0, NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION = 1 << 5 };
enum { HL_LIBRARY_MAJOR_VERSION = 0, HL_LIBRARY_MINOR_VERSION = 1, HL_LIBRARY_PATCH_LEVEL = 2 }; /* libraryPropertyType */

#define NVJPEG_MAX_COMPONENT 4

/* an output image: planes (or one interleaved plane) on the device, each with its pitch in bytes */
typedef struct {
    unsigned char *channel[NVJPEG_MAX_COMPONENT];
    size_t pitch[NVJPEG_MAX_COMPONENT];
} nvjpegImage_t;

/* opaque handles */
typedef struct hl_nvjpeg_handle *nvjpegHandle_t;
typedef struct hl_nvjpeg_state *nvjpegJpegState_t;
typedef struct hl_nvjpeg_stream *nvjpegJpegStream_t;
typedef struct hl_nvjpeg_decoder *nvjpegJpegDecoder_t;
typedef struct hl_nvjpeg_params *nvjpegDecodeParams_t;
typedef struct hl_nvjpeg_pinned *nvjpegBufferPinned_t;
typedef struct hl_nvjpeg_device_buffer *nvjpegBufferDevice_t;
typedef void *hl_stream_t; /* cudaStream_t, which is a CUstream */

/* function pointer types, one per nvjpeg entry point used */
typedef nvjpegStatus_t (*nvjpegGetProperty_fn)(int type, int *value);
typedef nvjpegStatus_t (*nvjpegCreateEx_fn)(int backend, void *dev_allocator, void *pinned_allocator,
                                            unsigned int flags, nvjpegHandle_t *handle);
typedef nvjpegStatus_t (*nvjpegDestroy_fn)(nvjpegHandle_t handle);
typedef nvjpegStatus_t (*nvjpegGetHardwareDecoderInfo_fn)(nvjpegHandle_t handle, unsigned int *engines,
                                                          unsigned int *cores_per_engine);
typedef nvjpegStatus_t (*nvjpegJpegStateCreate_fn)(nvjpegHandle_t handle, nvjpegJpegState_t *state);
typedef nvjpegStatus_t (*nvjpegJpegStateDestroy_fn)(nvjpegJpegState_t state);
typedef nvjpegStatus_t (*nvjpegDecodeBatchedInitialize_fn)(nvjpegHandle_t handle, nvjpegJpegState_t state,
                                                           int batch_size, int max_cpu_threads, int output_format);
typedef nvjpegStatus_t (*nvjpegDecodeBatched_fn)(nvjpegHandle_t handle, nvjpegJpegState_t state,
                                                 const unsigned char *const *data, const size_t *lengths,
                                                 nvjpegImage_t *destinations, hl_stream_t stream);
typedef nvjpegStatus_t (*nvjpegJpegStreamCreate_fn)(nvjpegHandle_t handle, nvjpegJpegStream_t *stream);
typedef nvjpegStatus_t (*nvjpegJpegStreamDestroy_fn)(nvjpegJpegStream_t stream);
typedef nvjpegStatus_t (*nvjpegJpegStreamParseHeader_fn)(nvjpegHandle_t handle, const unsigned char *data,
                                                         size_t length, nvjpegJpegStream_t stream);
typedef nvjpegStatus_t (*nvjpegJpegStreamParse_fn)(nvjpegHandle_t handle, const unsigned char *data, size_t length,
                                                   int save_metadata, int save_stream, nvjpegJpegStream_t stream);
typedef nvjpegStatus_t (*nvjpegDecodeBatchedSupported_fn)(nvjpegHandle_t handle, nvjpegJpegStream_t stream,
                                                          int *is_supported); /* 0: supported */
typedef nvjpegStatus_t (*nvjpegDecoderCreate_fn)(nvjpegHandle_t handle, int backend, nvjpegJpegDecoder_t *decoder);
typedef nvjpegStatus_t (*nvjpegDecoderDestroy_fn)(nvjpegJpegDecoder_t decoder);
typedef nvjpegStatus_t (*nvjpegDecoderStateCreate_fn)(nvjpegHandle_t handle, nvjpegJpegDecoder_t decoder,
                                                      nvjpegJpegState_t *state);
typedef nvjpegStatus_t (*nvjpegBufferPinnedCreate_fn)(nvjpegHandle_t handle, void *allocator,
                                                      nvjpegBufferPinned_t *buffer);
typedef nvjpegStatus_t (*nvjpegBufferPinnedDestroy_fn)(nvjpegBufferPinned_t buffer);
typedef nvjpegStatus_t (*nvjpegBufferDeviceCreate_fn)(nvjpegHandle_t handle, void *allocator,
                                                      nvjpegBufferDevice_t *buffer);
typedef nvjpegStatus_t (*nvjpegBufferDeviceDestroy_fn)(nvjpegBufferDevice_t buffer);
typedef nvjpegStatus_t (*nvjpegStateAttachPinnedBuffer_fn)(nvjpegJpegState_t state, nvjpegBufferPinned_t buffer);
typedef nvjpegStatus_t (*nvjpegStateAttachDeviceBuffer_fn)(nvjpegJpegState_t state, nvjpegBufferDevice_t buffer);
typedef nvjpegStatus_t (*nvjpegDecodeParamsCreate_fn)(nvjpegHandle_t handle, nvjpegDecodeParams_t *params);
typedef nvjpegStatus_t (*nvjpegDecodeParamsDestroy_fn)(nvjpegDecodeParams_t params);
typedef nvjpegStatus_t (*nvjpegDecodeParamsSetOutputFormat_fn)(nvjpegDecodeParams_t params, int output_format);
typedef nvjpegStatus_t (*nvjpegDecodeJpegHost_fn)(nvjpegHandle_t handle, nvjpegJpegDecoder_t decoder,
                                                  nvjpegJpegState_t state, nvjpegDecodeParams_t params,
                                                  nvjpegJpegStream_t stream);
typedef nvjpegStatus_t (*nvjpegDecodeJpegTransferToDevice_fn)(nvjpegHandle_t handle, nvjpegJpegDecoder_t decoder,
                                                              nvjpegJpegState_t state, nvjpegJpegStream_t jpeg,
                                                              hl_stream_t stream);
typedef nvjpegStatus_t (*nvjpegDecodeJpegDevice_fn)(nvjpegHandle_t handle, nvjpegJpegDecoder_t decoder,
                                                    nvjpegJpegState_t state, nvjpegImage_t *destination,
                                                    hl_stream_t stream);

typedef nvjpegStatus_t (*nvjpegDecodeBatchedPreAllocate_fn)(nvjpegHandle_t handle, nvjpegJpegState_t state,
                                                            int batch_size, int width, int height,
                                                            int chroma_subsampling, int output_format);

/* what nvjpeg.c resolved from one library; hardware_info and batched_preallocate may be NULL (an
   nvjpeg before CUDA 11.4) */
typedef struct {
    char path[512];
    int version[3]; /* major, minor, patch */
    nvjpegGetProperty_fn get_property;
    nvjpegCreateEx_fn create_ex;
    nvjpegDestroy_fn destroy;
    nvjpegGetHardwareDecoderInfo_fn hardware_info;
    nvjpegJpegStateCreate_fn state_create;
    nvjpegJpegStateDestroy_fn state_destroy;
    nvjpegDecodeBatchedInitialize_fn batched_initialize;
    nvjpegDecodeBatched_fn batched;
    nvjpegJpegStreamCreate_fn stream_create;
    nvjpegJpegStreamDestroy_fn stream_destroy;
    nvjpegJpegStreamParseHeader_fn parse_header;
    nvjpegJpegStreamParse_fn parse;
    nvjpegDecodeBatchedSupported_fn batched_supported;
    nvjpegDecoderCreate_fn decoder_create;
    nvjpegDecoderDestroy_fn decoder_destroy;
    nvjpegDecoderStateCreate_fn decoder_state_create;
    nvjpegBufferPinnedCreate_fn pinned_create;
    nvjpegBufferPinnedDestroy_fn pinned_destroy;
    nvjpegBufferDeviceCreate_fn device_buffer_create;
    nvjpegBufferDeviceDestroy_fn device_buffer_destroy;
    nvjpegStateAttachPinnedBuffer_fn attach_pinned;
    nvjpegStateAttachDeviceBuffer_fn attach_device;
    nvjpegDecodeParamsCreate_fn params_create;
    nvjpegDecodeParamsDestroy_fn params_destroy;
    nvjpegDecodeParamsSetOutputFormat_fn params_set_output;
    nvjpegDecodeJpegHost_fn decode_host;
    nvjpegDecodeJpegTransferToDevice_fn decode_transfer;
    nvjpegDecodeJpegDevice_fn decode_device;
    nvjpegDecodeBatchedPreAllocate_fn batched_preallocate;
} hl_nvjpeg;

/* "NVJPEG_STATUS_BAD_JPEG"; "NVJPEG_STATUS_<n>" for a number nvjpeg.h does not name */
const char *hl_nvjpeg_status_name(nvjpegStatus_t status);

/* The first of `paths` (a sequence of str or os.PathLike) that opens, kept open for the life of the
   process, with the GIL released while libraries load; NULL with a RuntimeError, naming `caller`, that
   lists each path tried and why it failed. */
const hl_nvjpeg *hl_nvjpeg_from_paths(PyObject *paths, const char *caller);

#endif
