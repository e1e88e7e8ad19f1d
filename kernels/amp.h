/* The launch shape of kernels/amp.cu's entry points: their loops and reductions are built for it, and csrc/launch_amp.c launches with it. */
#ifndef HOTLOOP_KERNELS_AMP_H
#define HOTLOOP_KERNELS_AMP_H

#include "amp_layout.h"
#include "tensor_table.h"

/* threads of a block of the non-finite check, the check and apply passes: their loops stride by it */
#define HL_AMP_THREADS 512
/* blocks of those passes per multiprocessor: the launcher's grid, and the kernels' __launch_bounds__ */
#define HL_AMP_BLOCKS_PER_SM 2
/* threads of the one-block epilogue: its fixed reduction tree is built for this many */
#define HL_AMP_EPILOGUE_THREADS 1024

#endif
