/* CUDA events, stream waits and the device guard through the driver API, for the JPEG engine
   (nvjpeg_engine.c) and its hybrid lanes (nvjpeg_hybrid.c). The runtime's handles are the driver's, so
   they mix with the streams torch and nvjpeg use. Without CUDA in the build no decoder is ever made. */
#ifndef HOTLOOP_NVJPEG_CUDA_H
#define HOTLOOP_NVJPEG_CUDA_H

#include "cuda.h"
#include "module.h"

#ifdef HOTLOOP_WITH_CUDA
static inline int event_create(void **event) {
    return hl_cu.cuEventCreate((CUevent *)event, CU_EVENT_DISABLE_TIMING);
}
/* an event two of which time the work between their records (cuEventElapsedTime) */
static inline int event_create_timed(void **event) { return hl_cu.cuEventCreate((CUevent *)event, CU_EVENT_DEFAULT); }
static inline int event_destroy(void *event) { return hl_cu.cuEventDestroy((CUevent)event); }
/* 0 with *ms set; CUDA_ERROR_NOT_READY while either event's work is still queued */
static inline int event_elapsed(float *ms, void *start, void *end) {
    return hl_cu.cuEventElapsedTime(ms, (CUevent)start, (CUevent)end);
}
static inline int event_record(void *event, hl_stream_t stream) {
    return hl_cu.cuEventRecord((CUevent)event, (CUstream)stream);
}
static inline int event_synchronize(void *event) { return hl_cu.cuEventSynchronize((CUevent)event); }
static inline int stream_wait(hl_stream_t stream, void *event) {
    return hl_cu.cuStreamWaitEvent((CUstream)stream, (CUevent)event, 0);
}
static inline int stream_synchronize(hl_stream_t stream) { return hl_cu.cuStreamSynchronize((CUstream)stream); }
/* a stream that does not wait for the legacy default stream's work, as torch's side streams */
static inline int stream_create(hl_stream_t *stream) {
    return hl_cu.cuStreamCreate((CUstream *)stream, CU_STREAM_NON_BLOCKING);
}
static inline int stream_destroy(hl_stream_t stream) { return hl_cu.cuStreamDestroy((CUstream)stream); }
#define DEVICE_GUARD hl_device_guard
#define DEVICE_ENTER(guard, device, status) hl_device_enter(guard, device, status)
#define DEVICE_LEAVE(guard, status) hl_device_leave(guard, status)
#else
static inline int event_create(void **event) { *event = NULL; return 100; /* CUDA_ERROR_NO_DEVICE */ }
static inline int event_create_timed(void **event) { *event = NULL; return 100; }
static inline int event_destroy(void *event) { (void)event; return 0; }
static inline int event_elapsed(float *ms, void *start, void *end) { (void)start; (void)end; *ms = 0; return 100; }
static inline int event_record(void *event, hl_stream_t stream) { (void)event; (void)stream; return 100; }
static inline int event_synchronize(void *event) { (void)event; return 0; }
static inline int stream_wait(hl_stream_t stream, void *event) { (void)stream; (void)event; return 100; }
static inline int stream_synchronize(hl_stream_t stream) { (void)stream; return 100; }
static inline int stream_create(hl_stream_t *stream) { *stream = NULL; return 100; }
static inline int stream_destroy(hl_stream_t stream) { (void)stream; return 0; }
typedef int DEVICE_GUARD;
#define DEVICE_ENTER(guard, device, status) ((void)(guard), (void)(device), (void)(status))
#define DEVICE_LEAVE(guard, status) ((void)(guard), (void)(status))
#endif

#endif
