/* Times a JPEG's whole decode against a decode of only the rows and columns a crop box needs, with
 * libjpeg-turbo's partial decoding: jpeg_crop_scanline (colour conversion and upsampling, and the IDCT
 * of the blocks, for the box's columns only, widened to iMCU boundaries), jpeg_skip_scanlines (rows
 * above the box: Huffman-decoded, since the entropy stream has to be walked, but not transformed) and
 * stopping after the box's last row (rows below it: not read at all). Driven by crop_decode_eval.py,
 * which builds this file with the system's libjpeg-turbo (a tool only: hotloop does not link it).
 *
 * stdin: one line per image, "path top left height width" (the box in pixels of the full image).
 * stdout: one line per image, "whole_us crop_us", each the least of `repeats` decodes, the two
 * alternated so that a busy machine slows both alike; "error" for a file libjpeg refuses.
 */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jpeglib.h>

struct error_exit {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
};

static void on_error(j_common_ptr cinfo) {
    longjmp(((struct error_exit *)cinfo->err)->jump, 1);
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

/* Decodes `data` to RGB: the rows [top, top + height) and the columns around [left, left + width) when
 * crop is set, else all of it. Returns 0, or -1 where libjpeg failed. */
static int decode(const unsigned char *data, unsigned long size, int crop, JDIMENSION top, JDIMENSION left,
                  JDIMENSION height, JDIMENSION width, unsigned char *row) {
    struct jpeg_decompress_struct cinfo;
    struct error_exit err;
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, size);
    jpeg_read_header(&cinfo, TRUE);
    cinfo.out_color_space = JCS_RGB;
    jpeg_start_decompress(&cinfo);
    JDIMENSION last = cinfo.output_height;
    if (crop) {
        JDIMENSION x = left, w = width;
        jpeg_crop_scanline(&cinfo, &x, &w);
        if (top > 0)
            jpeg_skip_scanlines(&cinfo, top);
        last = top + height;
    }
    while (cinfo.output_scanline < last) {
        JSAMPROW rows[1] = {row};
        jpeg_read_scanlines(&cinfo, rows, 1);
    }
    if (cinfo.output_scanline < cinfo.output_height)
        jpeg_abort_decompress(&cinfo); /* the rows below the box are never read */
    else
        jpeg_finish_decompress(&cinfo);
    jpeg_destroy_decompress(&cinfo);
    return 0;
}

static unsigned char *read_file(const char *path, unsigned long *size) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *data = n > 0 ? malloc((size_t)n) : NULL;
    if (data && fread(data, 1, (size_t)n, f) != (size_t)n) {
        free(data);
        data = NULL;
    }
    fclose(f);
    *size = (unsigned long)n;
    return data;
}

int main(int argc, char **argv) {
    int repeats = argc > 1 ? atoi(argv[1]) : 3;
    char path[4096];
    unsigned top, left, height, width;
    unsigned char *row = malloc(3u << 16); /* one RGB row of up to 65,536 pixels */
    if (!row)
        return 1;
    while (scanf("%4095s %u %u %u %u", path, &top, &left, &height, &width) == 5) {
        unsigned long size;
        unsigned char *data = read_file(path, &size);
        double best[2] = {1e300, 1e300};
        int failed = data == NULL;
        for (int r = 0; r < repeats && !failed; r++) {
            for (int k = 0; k < 2; k++) {
                int crop = (r + k) % 2; /* the order flips each repeat */
                double t0 = now_us();
                failed |= decode(data, size, crop, top, left, height, width, row) != 0;
                double t = now_us() - t0;
                if (t < best[crop])
                    best[crop] = t;
            }
        }
        if (failed)
            printf("error\n");
        else
            printf("%.1f %.1f\n", best[0], best[1]);
        free(data);
    }
    free(row);
    return 0;
}
