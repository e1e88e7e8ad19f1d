/* Batched crop, antialiased bilinear resize, flip and normalise of differently sized uint8 images into one NCHW or channels_last batch. */
#include "half.cuh"
#include "image_resize.h"
#include "image_resize_math.h"

/* A block makes one tile of one image's output: TILE_H rows x TILE_W columns x 3 channels. It
   resamples the crop's rows the tile needs horizontally (Pillow's first pass, rounded to uint8)
   into shared memory, CHUNK_ROWS at a time, and each thread sums the vertical pass for its two
   pixels from there. Every image has its own filters; the grid (csrc/launch_image_resize.c) walks
   images x tiles. */
#define TILE_W HL_RESIZE_TILE_W /* one warp's lanes: consecutive columns, so NCHW stores coalesce */
#define TILE_H HL_RESIZE_TILE_H
#define THREADS HL_RESIZE_THREADS
#define ROW_STEP (THREADS / TILE_W)        /* a thread makes rows ty and ty + ROW_STEP of the tile */
#define ROWS_PER_THREAD (TILE_H / ROW_STEP)
#define CHUNK_ROWS 64 /* a 640 -> 224 shrink needs ~52 rows for 16 output rows: one chunk */
/* Fixed-point weights of the tile's columns and rows, computed once per tile. Up to 64 taps per
   column (a 1/31 shrink) and 128 per row; a stronger shrink computes its weights as it goes. */
#define CACHE_X (TILE_W * 64)
#define CACHE_Y (TILE_H * 128)

/* tap k of filter f: from the tile's cache, or computed (the same function filled the cache) */
__device__ inline int32_t tap_weight(const int32_t *cached, const hl_resize_taps &f, int k) {
    return cached != nullptr ? cached[k] : hl_resize_weight(&f, k);
}

/* Pillow's horizontal pass for one output column of one crop row: `channels` values into dst */
__device__ inline void resample_row(const hl_image_entry &e, int crop_row, const hl_resize_taps &f,
                                    const int32_t *cached, uint8_t *dst) {
    const uint8_t *src = (const uint8_t *)(uintptr_t)e.src + (size_t)(e.box_top + crop_row) * (size_t)e.src_pitch +
                         (size_t)(e.box_left + f.first) * (size_t)e.channels;
    if (e.channels == 3) {
        int32_t s0 = HL_RESIZE_HALF, s1 = HL_RESIZE_HALF, s2 = HL_RESIZE_HALF;
        for (int k = 0; k < f.count; k++) {
            int32_t w = tap_weight(cached, f, k);
            s0 += w * src[3 * k];
            s1 += w * src[3 * k + 1];
            s2 += w * src[3 * k + 2];
        }
        dst[0] = hl_resize_clip8(s0);
        dst[1] = hl_resize_clip8(s1);
        dst[2] = hl_resize_clip8(s2);
    } else {
        int32_t s = HL_RESIZE_HALF;
        for (int k = 0; k < f.count; k++)
            s += tap_weight(cached, f, k) * src[k];
        dst[0] = hl_resize_clip8(s);
    }
}

__device__ inline void store(void *out, size_t i, uint8_t q, int c, int dtype, const hl_image_resize_params &p) {
    if (dtype == HL_UINT8) {
        ((uint8_t *)out)[i] = q;
        return;
    }
    float y = hl_resize_normalize(q, p.scale, p.mean[c], p.std[c]);
    if (dtype == HL_FLOAT32)
        ((float *)out)[i] = y;
    else if (dtype == HL_FLOAT16)
        ((uint16_t *)out)[i] = hl_float2half_rn(y).bits;
    else
        ((uint16_t *)out)[i] = hl_float2bfloat16_rn(y).bits;
}

extern "C" __global__ void __launch_bounds__(THREADS)
    hl_image_resize(const hl_image_entry *entries, int64_t tiles_x, int64_t tiles_per_image, int64_t total_tiles,
                    void *out, int dtype, int h, int w, int channels_last, hl_image_resize_params p) {
    __shared__ hl_resize_taps cols[TILE_W], rows[TILE_H];
    __shared__ int32_t wx[CACHE_X], wy[CACHE_Y];
    __shared__ uint8_t inter[CHUNK_ROWS][TILE_W][3];
    __shared__ int stride_x, stride_y, row_begin, row_end; /* stride 0: weights not cached */
    const int tx = threadIdx.x % TILE_W, ty = threadIdx.x / TILE_W;

    for (int64_t tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
        const int64_t n = tile / tiles_per_image, t = tile % tiles_per_image;
        const int y0 = (int)(t / tiles_x) * TILE_H, x0 = (int)(t % tiles_x) * TILE_W;
        const int ncols = min(TILE_W, w - x0), nrows = min(TILE_H, h - y0);
        const hl_image_entry e = entries[n];

        __syncthreads(); /* the previous tile is done with the filters and caches */
        if (threadIdx.x < ncols) {
            int x = x0 + threadIdx.x;
            cols[threadIdx.x] = hl_resize_taps_of(e.box_w, e.resized_w, e.out_left + (e.flip ? w - 1 - x : x));
        } else if (threadIdx.x >= TILE_W && threadIdx.x < TILE_W + nrows) {
            int r = threadIdx.x - TILE_W;
            rows[r] = hl_resize_taps_of(e.box_h, e.resized_h, e.out_top + y0 + r);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int most_x = 0, most_y = 0, begin = rows[0].first, end = 0;
            for (int i = 0; i < ncols; i++)
                most_x = max(most_x, cols[i].count);
            for (int i = 0; i < nrows; i++) {
                most_y = max(most_y, rows[i].count);
                begin = min(begin, rows[i].first);
                end = max(end, rows[i].first + rows[i].count);
            }
            stride_x = TILE_W * most_x <= CACHE_X ? most_x : 0;
            stride_y = TILE_H * most_y <= CACHE_Y ? most_y : 0;
            row_begin = begin;
            row_end = end;
        }
        __syncthreads();
        const int sx = stride_x, sy = stride_y, begin = row_begin, end = row_end;
        for (int i = threadIdx.x; i < ncols * sx; i += THREADS)
            if (i % sx < cols[i / sx].count)
                wx[i] = hl_resize_weight(&cols[i / sx], i % sx);
        for (int i = threadIdx.x; i < nrows * sy; i += THREADS)
            if (i % sy < rows[i / sy].count)
                wy[i] = hl_resize_weight(&rows[i / sy], i % sy);

        int32_t acc[ROWS_PER_THREAD][3];
#pragma unroll
        for (int k = 0; k < ROWS_PER_THREAD; k++)
            acc[k][0] = acc[k][1] = acc[k][2] = HL_RESIZE_HALF;
        for (int c0 = begin; c0 < end; c0 += CHUNK_ROWS) {
            const int chunk = min(CHUNK_ROWS, end - c0);
            __syncthreads(); /* the weights are written; the previous chunk is summed */
            for (int i = threadIdx.x; i < chunk * TILE_W; i += THREADS) {
                int r = i / TILE_W, c = i % TILE_W;
                if (c < ncols)
                    resample_row(e, c0 + r, cols[c], sx ? &wx[c * sx] : nullptr, inter[r][c]);
            }
            __syncthreads();
            if (tx >= ncols)
                continue;
#pragma unroll
            for (int k = 0; k < ROWS_PER_THREAD; k++) { /* constant indices: acc stays in registers */
                const int yl = ty + k * ROW_STEP;
                if (yl >= nrows)
                    break;
                const hl_resize_taps &f = rows[yl];
                const int lo = max(c0, f.first), hi = min(c0 + chunk, f.first + f.count);
                const int32_t *cached = sy ? &wy[yl * sy] : nullptr;
                for (int r = lo; r < hi; r++) {
                    const int32_t wgt = tap_weight(cached, f, r - f.first);
                    const uint8_t *v = inter[r - c0][tx];
                    acc[k][0] += wgt * v[0];
                    if (e.channels == 3) {
                        acc[k][1] += wgt * v[1];
                        acc[k][2] += wgt * v[2];
                    }
                }
            }
        }

        if (tx >= ncols)
            continue;
#pragma unroll
        for (int k = 0; k < ROWS_PER_THREAD; k++) {
            const int y = y0 + ty + k * ROW_STEP, x = x0 + tx;
            if (y >= y0 + nrows)
                break;
#pragma unroll
            for (int c = 0; c < 3; c++) {
                uint8_t q = hl_resize_clip8(acc[k][e.channels == 3 ? c : 0]);
                size_t i = channels_last ? (((size_t)n * h + y) * w + x) * 3 + c : (((size_t)n * 3 + c) * h + y) * w + x;
                store(out, i, q, c, dtype, p);
            }
        }
    }
}
