/* The sample layouts monitor.c's sampler writes (and snapshot() hands to Python as packed records). */
#ifndef HOTLOOP_MONITOR_H
#define HOTLOOP_MONITOR_H

#include <stddef.h>
#include <stdint.h>

/* One memory reading, taken every tick. Times are CLOCK_MONOTONIC seconds (Python's
   time.monotonic() on Linux), so Python can place its own events on the same axis. */
typedef struct {
    double t;
    uint64_t used;     /* bytes; NVML v2: without the driver's reservation */
    uint64_t reserved; /* bytes the driver/firmware set aside (0 with the v1 call) */
    uint64_t free;
} hl_memory_sample;

#define HL_UNSUPPORTED UINT32_MAX /* a reading the device does not offer */

/* Readings taken on the slower tick. */
typedef struct {
    double t;
    uint32_t util_gpu, util_memory; /* percent */
    uint32_t power_mw;
    uint32_t temperature_c;
    uint32_t sm_clock_mhz, memory_clock_mhz;
    uint64_t reasons;   /* clock-event (throttle) reason bits */
    uint32_t util_jpeg; /* percent: the JPEG engines (nvjpeg's hardware backend) */
    uint32_t unused;    /* explicit padding: the record is 48 bytes */
} hl_slow_sample;

/* PCIe throughput, read on its own thread because each reading blocks ~20 ms. */
typedef struct {
    double t;
    uint32_t rx_kb_per_s, tx_kb_per_s;
} hl_pcie_sample;

#endif
