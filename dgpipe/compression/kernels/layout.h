/*
 * The packed layout of bitpack.py in compiled C, for codes.c and rows.c: a chunk of CHUNK codes of 1-16 bits packed into
 * a stream of n codes -- k = (bits - 1) / 8 planes of low bytes (n bytes each), then per chunk the r = bits - 8k
 * high bits of each code, g = 8 / gcd(r, 8) lanes of CHUNK / g codes sharing a word of w = g * r / 8 bytes,
 * stored as w byte planes -- and back. The code width is a constant inside each specialised body (pack_any,
 * unpack_any: a switch over always_inline functions), so the lane and plane loops unroll.
 */
#ifndef DGPIPE_LAYOUT_H
#define DGPIPE_LAYOUT_H

#include <stdint.h>
#include <string.h>

#include "variants.h"

/* Codes per chunk of the packed layout: defined once, as bitpack.CHUNK, and given by the build (setup.py). */
#ifndef DGPIPE_CHUNK
#error "build with -DDGPIPE_CHUNK=<dgpipe.compression.kernels.bitpack.CHUNK>, as setup.py does"
#endif
#define CHUNK DGPIPE_CHUNK

/* Codes (each < 2**bits, bits 1..16) of chunk c into the stream `out` of n codes. */
static inline INLINE void pack_chunk(const uint16_t *codes, int bits, uint8_t *out, long n, long c) {
    const int k = (bits - 1) / 8, r = bits - 8 * k, g = 8 >> __builtin_ctz(r), w = g * r / 8, cg = CHUNK / g;
    uint8_t *high = out + k * n + c * (CHUNK * r / 8);
    if (k) {
        uint8_t *low = out + c * CHUNK;
        for (int t = 0; t < CHUNK; t++)
            low[t] = (uint8_t)codes[t];
    }
    const int s = 8 * k;
    if (g == 1) {
        for (int t = 0; t < CHUNK; t++)
            high[t] = (uint8_t)(codes[t] >> s);
    } else if (w <= 4) {
        for (int j = 0; j < cg; j++) {
            uint32_t word = 0;
            for (int l = 0; l < g; l++)
                word |= (uint32_t)(codes[l * cg + j] >> s) << (l * r);
            for (int q = 0; q < w; q++)
                high[q * cg + j] = (uint8_t)(word >> (8 * q));
        }
    } else {
        for (int j = 0; j < cg; j++) {
            uint64_t word = 0;
            for (int l = 0; l < g; l++)
                word |= (uint64_t)(codes[l * cg + j] >> s) << (l * r);
            for (int q = 0; q < w; q++)
                high[q * cg + j] = (uint8_t)(word >> (8 * q));
        }
    }
}

/* Inverse of pack_chunk: the codes of chunk c of the stream `packed` of n codes. */
static inline INLINE void unpack_chunk(const uint8_t *packed, int bits, long n, long c, uint16_t *codes) {
    const int k = (bits - 1) / 8, r = bits - 8 * k, g = 8 >> __builtin_ctz(r), w = g * r / 8, cg = CHUNK / g;
    const uint8_t *high = packed + k * n + c * (CHUNK * r / 8);
    const uint32_t mask = (1u << r) - 1;
    if (g == 1) {
        for (int t = 0; t < CHUNK; t++)
            codes[t] = high[t];
    } else if (w <= 4) {
        for (int j = 0; j < cg; j++) {
            uint32_t word = 0;
            for (int q = 0; q < w; q++)
                word |= (uint32_t)high[q * cg + j] << (8 * q);
            for (int l = 0; l < g; l++)
                codes[l * cg + j] = (uint16_t)((word >> (l * r)) & mask);
        }
    } else {
        for (int j = 0; j < cg; j++) {
            uint64_t word = 0;
            for (int q = 0; q < w; q++)
                word |= (uint64_t)high[q * cg + j] << (8 * q);
            for (int l = 0; l < g; l++)
                codes[l * cg + j] = (uint16_t)((word >> (l * r)) & mask);
        }
    }
    if (k) {
        const uint8_t *low = packed + c * CHUNK;
        for (int t = 0; t < CHUNK; t++)
            codes[t] = (uint16_t)(codes[t] << 8 | low[t]);
    }
}

/* pack_chunk / unpack_chunk with the width a constant in each case (bits 1..16: checked by the entry points). */
#define EACH_WIDTH(bits, CALL)                                                                              \
    switch (bits) {                                                                                         \
    case 1: CALL(1); break;   case 2: CALL(2); break;   case 3: CALL(3); break;   case 4: CALL(4); break;   \
    case 5: CALL(5); break;   case 6: CALL(6); break;   case 7: CALL(7); break;   case 8: CALL(8); break;   \
    case 9: CALL(9); break;   case 10: CALL(10); break; case 11: CALL(11); break; case 12: CALL(12); break; \
    case 13: CALL(13); break; case 14: CALL(14); break; case 15: CALL(15); break; default: CALL(16); break; \
    }

static inline INLINE void pack_any(const uint16_t *codes, int bits, uint8_t *out, long n, long c) {
#define CALL(b) pack_chunk(codes, b, out, n, c)
    EACH_WIDTH(bits, CALL)
#undef CALL
}

static inline INLINE void unpack_any(const uint8_t *packed, int bits, long n, long c, uint16_t *codes) {
#define CALL(b) unpack_chunk(packed, b, n, c, codes)
    EACH_WIDTH(bits, CALL)
#undef CALL
}

#endif
