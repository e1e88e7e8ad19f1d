/* Host-side helpers for kernels that walk a tensor table: grid sizing from the device's multiprocessors. */
#include "table.cuh"

#define HL_MAX_DEVICES 64

int hl_grid_for_chunks(int64_t chunks, int device, int blocks_per_sm) {
    /* the multiprocessor count is a constant of the hardware; ask the runtime once per device */
    static int sm_count[HL_MAX_DEVICES];
    int sms = device >= 0 && device < HL_MAX_DEVICES ? sm_count[device] : 0;
    if (sms == 0) {
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
            /* the failed query is also the runtime's last error: take it back, or the caller's
               cudaGetLastError() after its launch would report it as the launch's */
            (void)cudaGetLastError();
            sms = 0;
        }
        if (sms <= 0)
            sms = 32;
        if (device >= 0 && device < HL_MAX_DEVICES)
            sm_count[device] = sms;
    }
    int64_t grid = (int64_t)sms * blocks_per_sm;
    if (chunks < grid)
        grid = chunks;
    return grid > 0 ? (int)grid : 1;
}
