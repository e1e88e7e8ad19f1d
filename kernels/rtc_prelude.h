/* The C library names the shared headers use, for both compilers: NVRTC's own definitions where it has no C headers, the standard headers elsewhere. */
#ifndef HOTLOOP_RTC_PRELUDE_H
#define HOTLOOP_RTC_PRELUDE_H

#ifdef __CUDACC_RTC__
/* NVRTC brings CUDA's maths functions and size_t but not <stdint.h>, <float.h> or <limits.h>: the
   types are defined as x86-64 and aarch64 Linux define them (LP64), so that every struct the C side
   packs and the kernels read has the same size and offsets on both sides. */
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef unsigned long long uintptr_t;

static_assert(sizeof(int64_t) == 8 && sizeof(uintptr_t) == sizeof(void *) && sizeof(size_t) == 8,
              "kernels are built for 64-bit devices only");

#define INT32_MAX 2147483647
#define INT64_MAX 9223372036854775807LL
#define LLONG_MAX 9223372036854775807LL
#define FLT_MAX 3.402823466e+38F
#else
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#endif

#endif
