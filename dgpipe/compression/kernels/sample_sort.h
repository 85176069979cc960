/*
 * The sort of sort quantization's boundary sample, for codes.c: an LSD radix sort of float32 keys, three
 * passes of 11-bit digits (Knuth, TAOCP vol. 3, 5.2.5), 2-3x numpy's sort on the 2k-16k values of a sample.
 */
#ifndef DGPIPE_SAMPLE_SORT_H
#define DGPIPE_SAMPLE_SORT_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "variants.h"

#define RADIX_BITS 11 /* bits per digit */

/* out[0, m) = the values x[pos[i]] (x[i] where pos is NULL) in ascending order of their float32 bits made
 * unsigned-monotone (negatives flipped, positives' sign bit set): numpy's order but for -0.0 before +0.0 and
 * NaN at the end of its sign; m < 2**32. Returns 2 where memory runs out. */
static inline INLINE int sort_sample(const float *x, const int64_t *pos, long m, float *out) {
    enum { D = 1 << RADIX_BITS };
    const uint32_t sign = 1u << 31, mask = D - 1;
    uint32_t *keys = malloc(2 * (size_t)m * sizeof *keys), hist[3 * D];
    if (!keys)
        return 2;
    memset(hist, 0, sizeof hist);
    uint32_t *tmp = keys + m;
    for (long i = 0; i < m; i++) {
        uint32_t u;
        memcpy(&u, x + (pos ? pos[i] : i), 4);
        const uint32_t k = u & sign ? ~u : u | sign;
        keys[i] = k;
        for (int p = 0; p < 3; p++)
            hist[p * D + ((k >> (p * RADIX_BITS)) & mask)]++;
    }
    for (int p = 0; p < 3; p++) { /* least significant digit first; each pass is stable */
        uint32_t *h = hist + p * D;
        const int shift = p * RADIX_BITS;
        if (h[(keys[0] >> shift) & mask] == (uint32_t)m)
            continue; /* one digit for all keys: the pass would move nothing */
        uint32_t total = 0;
        for (int d = 0; d < D; d++) {
            const uint32_t count = h[d];
            h[d] = total;
            total += count;
        }
        for (long i = 0; i < m; i++)
            tmp[h[(keys[i] >> shift) & mask]++] = keys[i];
        uint32_t *swap = keys;
        keys = tmp;
        tmp = swap;
    }
    for (long i = 0; i < m; i++) {
        const uint32_t k = keys[i], u = k & sign ? k ^ sign : ~k;
        memcpy(out + i, &u, 4);
    }
    free(keys < tmp ? keys : tmp);
    return 0;
}

#endif
