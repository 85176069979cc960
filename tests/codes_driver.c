/*
 * A stand-alone caller of the per-value kernels (dgpipe/compression/kernels/codes.c) for a machine without
 * Python: tests/test_rows_compilers.py cross-compiles it with codes.c (aarch64) and runs it under qemu-user.
 * Reads from stdin, in the machine's byte order:
 *   int64 n (a multiple of 4096), m; float32 x[n]; int64 positions[m], ranks[3]; float32 lo, hi, mids[3],
 *   levels[4], scale
 * runs, on all of x: uniform_message (8 bits) and message_values; sampled_grid (6+2 bits, packed) and
 * message_values; encode_levels and decode_levels (2 bits, one scale); fwht of rows of 64 -- the last three in
 * three parts, on the calling thread (no OpenMP runtime is handed to the library); and writes to stdout:
 *   float32 meta[2], uint8 codes8[n], float32 y8[n], float32 grid[4 * 4] (zeros where unused), uint8 codes62[n],
 *   float32 y62[n], uint8 codes2[n / 4], float32 y2[n], float32 rotated[n]
 * Exit status: the kernels' return code, or 9 on short input or out of memory.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "driver_io.h"

int dgpipe_uniform_message(const float *x, long n, float lo, float hi, int bits, float *meta, uint8_t *out);
int dgpipe_message_values(const uint8_t *packed, int quant_bits, int split_bits, const float *meta, long n,
                          float *y);
int dgpipe_sampled_grid(const float *x, long n, const int64_t *pos, long m, const int64_t *ranks, int split_bits,
                        int quant_bits, float *sample, float *grid, long chunks, uint8_t *out);
int dgpipe_encode_levels(const float *v, const float *mids, int bits, long n, uint8_t *out, long c0, long c1,
                         long parts, int threads);
int dgpipe_decode_levels(const uint8_t *packed, int bits, const float *table, const float *scale, long group_len,
                         long n, float *y, long c0, long c1, long parts, int threads);
int dgpipe_fwht(float *y, long b, float scale, long r0, long r1, long parts, int threads);

#define CHECK(call)          \
    do {                     \
        int rc_ = (call);    \
        if (rc_)             \
            return rc_;      \
    } while (0)

int main(void) {
    int64_t h[2];
    if (fread(h, sizeof h[0], 2, stdin) != 2)
        return 9;
    const long n = h[0], m = h[1];
    float *x = read_n(4, n);
    int64_t *pos = read_n(8, m), *ranks = read_n(8, 3);
    float *tail = read_n(4, 2 + 3 + 4 + 1);
    uint8_t *codes = malloc(n), *codes2 = malloc(n / 4);
    float *y = malloc(4 * n), *sample = malloc(4 * m), *rotated = malloc(4 * n), meta[2], grid[16];
    if (!x || !tail || !pos || !ranks || !codes || !codes2 || !y || !sample || !rotated)
        return 9;
    const float lo = tail[0], hi = tail[1], *mids = tail + 2, *levels = tail + 5, *scale = tail + 9;
    CHECK(dgpipe_uniform_message(x, n, lo, hi, 8, meta, codes));
    CHECK(dgpipe_message_values(codes, 8, 0, meta, n, y));
    fwrite(meta, 4, 2, stdout);
    fwrite(codes, 1, n, stdout);
    fwrite(y, 4, n, stdout);
    memset(grid, 0, sizeof grid); /* row 3 holds the min and max in its first two entries only */
    CHECK(dgpipe_sampled_grid(x, n, pos, m, ranks, 2, 6, sample, grid, n / 4096, codes));
    CHECK(dgpipe_message_values(codes, 6, 2, grid, n, y));
    fwrite(grid, 4, 16, stdout);
    fwrite(codes, 1, n, stdout);
    fwrite(y, 4, n, stdout);
    CHECK(dgpipe_encode_levels(x, mids, 2, n, codes2, 0, n / 4096, 3, 1));
    CHECK(dgpipe_decode_levels(codes2, 2, levels, scale, n, n, y, 0, n / 4096, 3, 1));
    fwrite(codes2, 1, n / 4, stdout);
    fwrite(y, 4, n, stdout);
    memcpy(rotated, x, 4 * n);
    CHECK(dgpipe_fwht(rotated, 64, 0.125f, 0, n / 64, 3, 1));
    fwrite(rotated, 4, n, stdout);
    return 0;
}
