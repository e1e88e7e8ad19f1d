/* The launch shape of kernels/optim.cu's entry points: their loops are built for it, and csrc/launch_optim.c launches with it. */
#ifndef HOTLOOP_KERNELS_OPTIM_H
#define HOTLOOP_KERNELS_OPTIM_H

#include "optim_math.h"
#include "tensor_table.h"

/* threads of a block of the Adam and SGD updates: their chunk walks stride by it */
#define HL_OPTIM_THREADS 512

#endif
