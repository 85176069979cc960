/*
 * A stand-alone caller of the row kernels (dgpipe/compression/kernels/rows.c) for a machine without
 * Python: tests/test_rows_compilers.py cross-compiles it with rows.c (aarch64) and runs it under
 * qemu-user. Reads from stdin, in the machine's byte order:
 *   int64 rows, d, width, block, bits, mant, emin, packed_bytes, has_signs; float64 top; float32 inv_sqrt;
 *   float32 x[rows * d], signs[d] (if has_signs), mids[2**bits - 1], levels[2**bits]
 * encodes all rows in one call, decodes them from its own output (each in three parts, on the calling thread),
 * and writes to stdout:
 *   uint8 packed[packed_bytes], float32 scales[rows], uint8 tail[rows * width % 4096], float32 y[rows * d]
 * Exit status: the kernels' return code, or 9 on short input or out of memory.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "driver_io.h"

int dgpipe_encode_rows(const float *x, const float *signs, long rows, long d, long width, long block,
                       float inv_sqrt, const float *mids, int bits, int mant, int emin, double top, long full,
                       uint8_t *out, float *scales, uint8_t *tail, long parts, int threads);
int dgpipe_decode_rows(const uint8_t *packed, int bits, const float *table, const float *scales, long d,
                       long width, long block, float inv_sqrt, const float *signs, const uint8_t *tail,
                       long full, float *out, long r0, long r1, long parts, int threads);

int main(void) {
    int64_t h[9];
    double top;
    float inv_sqrt;
    if (fread(h, sizeof h[0], 9, stdin) != 9 || fread(&top, sizeof top, 1, stdin) != 1
        || fread(&inv_sqrt, sizeof inv_sqrt, 1, stdin) != 1)
        return 9;
    long rows = h[0], d = h[1], width = h[2], block = h[3], n = rows * width, full = n - n % 4096;
    int bits = (int)h[4];
    float *x = read_n(sizeof(float), rows * d), *signs = h[8] ? read_n(sizeof(float), d) : NULL;
    float *mids = read_n(sizeof(float), (1 << bits) - 1), *levels = read_n(sizeof(float), 1 << bits);
    uint8_t *packed = malloc(h[7] + 1), *tail = malloc(n - full + 1);
    float *scales = malloc(sizeof(float) * rows), *y = malloc(sizeof(float) * rows * d);
    if (!x || (h[8] && !signs) || !mids || !levels || !packed || !tail || !scales || !y)
        return 9;
    int rc = dgpipe_encode_rows(x, signs, rows, d, width, block, inv_sqrt, mids, bits, (int)h[5], (int)h[6], top,
                                full, packed, scales, tail, 3, 1);
    if (rc)
        return rc;
    rc = dgpipe_decode_rows(packed, bits, levels, scales, d, width, block, inv_sqrt, signs, tail, full, y, 0, rows, 3,
                            1);
    if (rc)
        return rc;
    fwrite(packed, 1, h[7], stdout);
    fwrite(scales, sizeof(float), rows, stdout);
    fwrite(tail, 1, n - full, stdout);
    fwrite(y, sizeof(float), rows * d, stdout);
    return 0;
}
