/* Launcher of kernels/image_resize.cu: one block per output tile, a grid that loops when there are more tiles than it has blocks. */
#include "launch.h"

#include "kernels.h"

#ifdef HOTLOOP_WITH_CUDA

#define MAX_BLOCKS (1 << 16) /* more tiles than this: blocks loop */

CUresult hl_launch_image_resize(const hl_image_entry *entries, int64_t count, void *out, int out_dtype, int64_t h,
                                int64_t w, int channels_last, hl_image_resize_params params, int device,
                                CUstream stream) {
    if (count == 0 || h == 0 || w == 0)
        return CUDA_SUCCESS;
    int64_t tiles_x = (w + HL_RESIZE_TILE_W - 1) / HL_RESIZE_TILE_W, tiles_y = (h + HL_RESIZE_TILE_H - 1) / HL_RESIZE_TILE_H;
    int64_t tiles_per_image = tiles_x * tiles_y, total = count * tiles_per_image;
    unsigned blocks = (unsigned)(total < MAX_BLOCKS ? total : MAX_BLOCKS);
    int height = (int)h, width = (int)w;
    void *args[] = {&entries, &tiles_x, &tiles_per_image, &total, &out, &out_dtype, &height, &width, &channels_last,
                    &params};
    return hl_kernel_launch(device, HL_KERNEL_IMAGE_RESIZE, blocks, HL_RESIZE_THREADS, 0, stream, args);
}

#endif
