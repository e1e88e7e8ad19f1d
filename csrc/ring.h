/* The shared batch ring of hotloop.DataLoader: memfd shared memory, slot states, futex waits. */
#ifndef HOTLOOP_RING_H
#define HOTLOOP_RING_H

#include "module.h"

/* Slot states, stored in the shared memory and changed with C11 atomics. The main process moves a
   slot FREE -> ASSIGNED (a task holds it) and READY/ERROR -> FREE (consumed); a worker moves it
   ASSIGNED -> READY (or ERROR) once every byte of the batch is written. */
enum hl_slot_state {
    HL_SLOT_FREE = 0,
    HL_SLOT_ASSIGNED = 1,
    HL_SLOT_READY = 2,
    HL_SLOT_ERROR = 3,
};

/* slot flags set by the worker with the state */
#define HL_SLOT_FLAG_OVERFLOW 1u /* the metadata did not fit; it follows through the worker's pipe */

#endif
