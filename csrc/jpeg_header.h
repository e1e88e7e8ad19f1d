/* JPEG headers read in C: what jpeg_header.c finds in a JPEG's markers, for Python and for nvjpeg.c. */
#ifndef HOTLOOP_JPEG_HEADER_H
#define HOTLOOP_JPEG_HEADER_H

#include <stddef.h>
#include <stdint.h>

/* the coding process, from the SOF marker's number */
enum {
    HL_JPEG_BASELINE = 0,    /* SOF0 */
    HL_JPEG_EXTENDED = 1,    /* SOF1: extended sequential, Huffman */
    HL_JPEG_PROGRESSIVE = 2, /* SOF2: progressive, Huffman */
    HL_JPEG_OTHER = 3,       /* SOF3 and SOF5..15: lossless, hierarchical or arithmetic coding */
};

#define HL_JPEG_MAX_COMPONENTS 4 /* component ids and sampling kept for the first four */

typedef struct {
    int width, height;
    int components;
    int precision;       /* bits per sample: 8 (12 and 16 exist; PIL opens only 8) */
    int process;         /* HL_JPEG_BASELINE... */
    int adobe_transform; /* -1 without an APP14 "Adobe" marker, else its transform byte */
    int jfif;            /* an APP0 "JFIF" marker was seen */
    int component_id[HL_JPEG_MAX_COMPONENTS];
    int sampling[HL_JPEG_MAX_COMPONENTS]; /* horizontal << 4 | vertical, as in the SOF */
    int scan;            /* a start-of-scan marker follows the frame header: the header is complete */
    int ends_with_eoi;   /* the data ends with FF D9, after any trailing 00 or FF padding */
} hl_jpeg_info;

/* what hl_jpeg_parse found */
enum {
    HL_JPEG_OK = 0,       /* *info holds the frame */
    HL_JPEG_NOT_JPEG = 1, /* no SOI (FF D8) at the start */
    HL_JPEG_CORRUPT = 2,  /* a JPEG whose header is corrupt or ends before the frame header; *why says how */
};

/* Walk the markers of `data[0..size)` up to the first start of scan, never reading outside it, and
   look at the last bytes for EOI; the entropy-coded data is not read. Markers after the frame header
   that cannot be walked (truncated, corrupt) end the walk with info->scan = 0. Safe without the GIL. */
int hl_jpeg_parse(const uint8_t *data, size_t size, hl_jpeg_info *info, const char **why);

/* Whether libjpeg (so PIL) takes a three-component JPEG as RGB rather than YCbCr: an Adobe marker
   with transform 0 and no JFIF marker, or neither marker and component ids 'R', 'G', 'B'. */
int hl_jpeg_is_rgb(const hl_jpeg_info *info);

#endif
