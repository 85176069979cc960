/*
 * The codebook codec's token groups in one pass per row, compiled C (see rows.py).
 *
 * Encode, per row of d float32 values: the random signs, zero padding to `width`, the
 * Walsh-Hadamard butterflies of each `block` (Fino and Algazi 1976) and the orthonormal factor,
 * the row's RMS (float64 squares, the pairwise fold of levels.row_rms) rounded up to the scale
 * dtype, the division by it, the level codes (how many midpoints a value exceeds) and the
 * bit-packing of bitpack.py's layout. Decode: unpack, level * scale, the butterflies, the factor,
 * the signs. The floating-point operations and their order are those of the reference steps, so
 * the bytes and the decoded values are bit for bit theirs. Built with -ffp-contract=fast: every product
 * the compiler can fuse with a sum is exact (a value times +-1, a float32 squared in float64), so a fused
 * multiply-add rounds as the two operations do; the one inexact product that meets a sum -- a level
 * times its scale, before the butterflies of blocks narrower than a vector -- is stored behind a
 * compiler barrier first. Keep it so when editing.
 *
 * Rows stay in row-major order, as vectors of 16 values: strides 1, 2, 4 and 8 are done inside a
 * vector with a lane permutation, partner + sign * value (the sign +-1 makes the product exact, so
 * the sum is a + b in the lower lane and a - b in the upper one, the reference's two results);
 * longer strides pair whole vectors, two stages per pass. Rows go in groups -- where the width
 * divides CHUNK, the rows of one chunk: their rotations and scales first, then their codes, which
 * are packed as they are found (the rows at the same place in each lane of the layout coded
 * together). The float64 squares of a power-of-two width are converted 16 at a time and folded in
 * vectors. A value's code is a binary search over the midpoints held in one vector (the second
 * midpoint picked by the first comparison). The decode rebuilds a row in vectors and applies the
 * signs as it writes the row out. Common widths (one block of 16, 32 or 64; 384 in blocks of 128)
 * are compiled as constants. The vectors and their helpers are in vectors.h, the rotation and the scale in
 * rotation.h. GCC's vector extensions (which clang shares) leave the instruction set to the compiler; on x86-64 the entry points are built as AVX-512, AVX2 and baseline variants (target
 * attributes; every helper is always_inline, so that it is compiled inside each), one picked per call by
 * the CPU's features. Where the machine's vectors are narrower than 16 floats, GCC keeps a 16-lane vector
 * in memory and lowers its comparisons, run-time permutes, broadcasts and narrowing lane by lane; there
 * they go in halves of 8 lanes (`wide`), the same operations on the same values, and the codes are found in
 * vectors of 8 throughout (code_half: no 16-lane result passes through memory), each level of the search
 * one permute of a table of the midpoints it can probe; a computed vector is stored in halves (the butterflies'
 * last stride, a decoded row) or quarters (the float64 squares and their fold), which GCC would otherwise pass
 * through general registers or the stack first. -DDGPIPE_ROWS_ONE_TARGET
 * builds one variant, for the -march given (benchmarks/rows_compilers.py measures AVX2 on an AVX-512
 * machine so). Builds with GCC 11+ and clang 14+, on x86-64 and aarch64.
 * Reference for the transform: Fino and Algazi, IEEE Trans. Computers 1976; for the levels:
 * Max 1960, Lloyd 1982.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layout.h"
#include "rotation.h"
#include "team.h"
#include "variants.h"
#include "vectors.h"

/* a > b, lane by lane (-1 or 0), whole or in halves (`wide`). */
static inline INLINE vi greater(vf a, vf b, int wide) {
    if (wide)
        return a > b;
    vf8 a2[2], b2[2];
    vi8 r[2];
    memcpy(a2, &a, sizeof a);
    memcpy(b2, &b, sizeof b);
    for (int h = 0; h < 2; h++)
        r[h] = a2[h] > b2[h];
    vi v;
    memcpy(&v, r, sizeof v);
    return v;
}

/* The codes (0 .. 2**bits - 1) of the V values at y divided by dv: how many of the 2**bits - 1 ascending
 * midpoints each exceeds (levels.nearest_level), found by a binary search over the midpoints held in one
 * vector `m` (mids, zero padded): `bits` comparisons per value instead of 2**bits - 1, the same count. */
static inline INLINE vi code_vector(const float *y, vf dv, vf m, int bits, int wide) {
    vf q = load(y) / dv;
    int top = 1 << (bits - 1);
    vi gt = greater(q, (vf){} + m[top - 1], wide), c = gt & ((vi){} + top);
    if (bits == 1)
        return c;
    /* the second midpoint is one of two: picked by the first comparison, no lookup */
    vi lo = (vi)((vf){} + m[top / 2 - 1]), hi = (vi)((vf){} + m[top + top / 2 - 1]);
    c |= greater(q, (vf)((hi & gt) | (lo & ~gt)), wide) & ((vi){} + top / 2);
    for (int k = bits - 3; k >= 0; k--) {
        vi probe = c + ((1 << k) - 1); /* the midpoint halfway through the codes left */
        c |= greater(q, lookup(m, probe, (1 << bits) - 1, wide), wide) & ((vi){} + (1 << k));
    }
    return c;
}

#if !NARROW_WIDE
/* code_vector on 8 values in vectors of 8 floats, the machine's width on AVX2, where a 16-lane vector lives in
 * memory and its halves' results would go through it. The same comparisons, so the same codes; the midpoint
 * of level k of the search is one of at most 8 (bits <= 4), picked from tab[k] (level_tables) by one
 * permute. */
static inline INLINE vi8 code_half(const float *y, vf8 dv, const float *mids, const vf8 *tab, int bits) {
    vf8 q;
    memcpy(&q, y, sizeof q);
    q /= dv;
    int top = 1 << (bits - 1);
    vi8 gt = q > (vf8){} + mids[top - 1], c = gt & ((vi8){} + top);
    if (bits == 1)
        return c;
    vi8 lo = (vi8)((vf8){} + mids[top / 2 - 1]), hi = (vi8)((vf8){} + mids[top + top / 2 - 1]);
    c |= (q > (vf8)((hi & gt) | (lo & ~gt))) & ((vi8){} + top / 2);
    for (int k = bits - 3; k >= 0; k--) /* the codes' bits above k are known: c = j * 2**(k + 1) */
        c |= (q > __builtin_shuffle(tab[k], c >> (k + 1))) & ((vi8){} + (1 << k));
    return c;
}

/* tab[k][j] = mids[j * 2**(k + 1) + 2**k - 1], the midpoints level k of code_half's search can probe. */
static inline INLINE void level_tables(const float *mids, int bits, vf8 *tab) {
    for (int k = 0; k < bits - 2; k++) {
        float t[8] = {0};
        for (int j = 0; j < 1 << (bits - k - 1); j++)
            t[j] = mids[(j << (k + 1)) + (1 << k) - 1];
        memcpy(tab + k, t, sizeof t);
    }
}
#endif

/* Codes of row `y` / div (code_vector; in halves where not `wide`), one byte each. */
static inline INLINE void row_codes(const float *y, long width, float div, vf m, const float *mids, int bits, int wide,
                                    uint8_t *codes) {
    int nm = (1 << bits) - 1;
    vf dv = splat(div, wide);
    long j = 0;
    if (wide)
        for (; j + V <= width; j += V) {
            vb cb = narrow(code_vector(y + j, dv, m, bits, wide), wide);
            memcpy(codes + j, &cb, V);
        }
#if !NARROW_WIDE
    else {
        vf8 dv8 = (vf8){} + div, tab[2];
        level_tables(mids, bits, tab);
        for (; j + 8 <= width; j += 8) {
            uint64_t b = narrow_half(code_half(y + j, dv8, mids, tab, bits));
            memcpy(codes + j, &b, 8);
        }
    }
#endif
    for (; j < width; j++) {
        float q = y[j] / div;
        int c = 0;
        for (int i = 0; i < nm; i++)
            c += q > mids[i];
        codes[j] = (uint8_t)c;
    }
}

/* The lanes of bitpack.py's layout of a chunk of CHUNK codes of `bits` <= 4 bits: g lanes of CHUNK / g codes,
 * word j holding code j of lane l at bits l * bits, in w byte planes. */
#define LANES(bits) (8 % (bits) == 0 ? 8 / (bits) : 8)

/* The codes of a chunk's rows (rows * width == CHUNK, width a multiple of V dividing CHUNK / LANES(bits);
 * row i at y + i * wpad, divided by div[i]) packed as they are found: the rows at the same place in each
 * lane are coded together and their codes shifted into the words' bit fields, with no pass over bytes. */
static inline INLINE void code_chunk(const float *y, long wpad, long width, const float *div, vf m,
                                     const float *mids, int bits, int wide, uint8_t *out) {
    int g = LANES(bits), w = g * bits / 8;
    long cg = CHUNK / g, per = cg / width; /* rows per lane */
#if !NARROW_WIDE
    if (!wide) { /* in halves (code_half) */
        vf8 tab[2];
        level_tables(mids, bits, tab);
        for (long o = 0; o < per; o++)
            for (long j = 0; j < width; j += 8) {
                vi8 word = (vi8){};
                for (int l = 0; l < g; l++) {
                    long i = l * per + o;
                    word |= code_half(y + i * wpad + j, (vf8){} + div[i], mids, tab, bits) << (l * bits);
                }
                for (int q = 0; q < w; q++) {
                    uint64_t b = narrow_half(word >> (8 * q));
                    memcpy(out + q * cg + o * width + j, &b, 8);
                }
            }
        return;
    }
#endif
    for (long o = 0; o < per; o++)
        for (long j = 0; j < width; j += V) {
            vi word = (vi){};
            for (int l = 0; l < g; l++) {
                long i = l * per + o;
                word |= code_vector(y + i * wpad + j, splat(div[i], wide), m, bits, wide) << (l * bits);
            }
            for (int q = 0; q < w; q++) {
                vb b = narrow(word >> (8 * q), wide);
                memcpy(out + q * cg + o * width + j, &b, V);
            }
        }
}

/* A chunk of CHUNK codes of 1-8 bits, one byte each, to layout.h's packed layout (LANES) and back: its byte-code
 * form, without the low-byte planes of wider codes. */
static inline INLINE void pack_byte_chunk(const uint8_t *codes, int bits, uint8_t *out) {
    int g = LANES(bits), w = g * bits / 8;
    long cg = CHUNK / g;
    for (long j = 0; j < cg; j++) {
        uint32_t word = 0;
        for (int l = 0; l < g; l++)
            word |= (uint32_t)codes[l * cg + j] << (l * bits);
        for (int q = 0; q < w; q++)
            out[q * cg + j] = (uint8_t)(word >> (8 * q));
    }
}

static inline INLINE void unpack_byte_chunk(const uint8_t *in, int bits, uint8_t *codes) {
    int g = LANES(bits), w = g * bits / 8;
    long cg = CHUNK / g;
    for (long j = 0; j < cg; j++) {
        uint32_t word = 0;
        for (int q = 0; q < w; q++)
            word |= (uint32_t)in[q * cg + j] << (8 * q);
        for (int l = 0; l < g; l++)
            codes[l * cg + j] = (uint8_t)((word >> (l * bits)) & ((1u << bits) - 1));
    }
}

/* Rows taken at a time: their rotations and scales first, then their codes, so that one row's chain of
 * dependent steps (the sums, the square root, the division) overlaps the next row's work. Where the width
 * divides CHUNK, a group is the rows of one chunk, whose codes are then packed where they were written. */
#define GROUP_VALUES 2048
#define MAX_GROUP (CHUNK / V)

static inline INLINE int encode_body(const float *x, const float *signs, long rows, long d, long width, long block,
                                     float inv_sqrt, const float *mids, int bits, int mant, int emin, double top,
                                     long start, long stop, long full, uint8_t *out, float *scales, uint8_t *tail, int wide) {
    long wpad = (width + V - 1) / V * V, g = CHUNK % width == 0 ? CHUNK / width : (GROUP_VALUES + width - 1) / width;
    g = g > MAX_GROUP ? MAX_GROUP : g;
    int pow2 = width >= V && (width & (width - 1)) == 0; /* squares and fold in vectors (sum_squares_pow2) */
    long half = pow2 ? 1 : (width + 1) / 2;
    float *y = aligned_alloc(64, g * wpad * sizeof(float)), scl[MAX_GROUP];
    double *s64 = malloc(g * half * sizeof(double)), sums[MAX_GROUP];
    uint8_t *rc = malloc(g * width), *chunk = malloc(CHUNK);
    int bad = 0;
    if (!y || !s64 || !rc || !chunk) {
        bad = 2;
        goto done;
    }
    long chunk_bytes = (long)CHUNK * bits / 8, rend = (stop + width - 1) / width;
    row_tail tl = signs ? make_tail(signs, d) : (row_tail){};
    float mp[V] = {0};
    memcpy(mp, mids, ((1 << bits) - 1) * sizeof(float));
    vf mv = load(mp);
    for (long r0 = start / width; r0 < rend; r0 += g) {
        long nr = rend - r0 < g ? rend - r0 : g;
        for (long i = 0; i < nr; i++) {
            long r = r0 + i;
            float *yr = y + i * wpad;
            if (signs)
                rotate_row(x + r * d, signs, &tl, (rows - r) * d, width, block, inv_sqrt, yr, wide);
            else
                memcpy(yr, x + r * d, d * sizeof(float));
            if (pow2)
                sums[i] = sum_squares_pow2(yr, width);
            else
                squares(yr, width, s64 + i * half);
        }
        if (!pow2) {
            fold(s64, half, nr, half);
            for (long i = 0; i < nr; i++)
                sums[i] = s64[i * half];
        }
        for (long i = 0; i < nr; i++) /* levels.row_rms (a loop of square roots the compiler vectorises) */
            scl[i] = (float)sqrt(sums[i] / (double)width);
        for (long i = 0; i < nr; i++) /* rounded up to the scale dtype */
            scl[i] = ceil_meta(scl[i], mant, emin, top);
        for (long i = 0; i < nr; i++) {
            float s = scl[i];
            if (!(s < INFINITY)) { /* inf/NaN in the row, or a scale overflowing the scale dtype */
                bad = 1;
                goto done;
            }
            if ((r0 + i) * width >= start)
                scales[r0 + i] = s;
            scl[i] = s > 0 ? s : 1.0f;
        }
        long p0 = r0 * width, p1 = (r0 + nr) * width;
        /* a whole chunk (CHUNK % width first: a constant width that does not divide it drops the branch) */
        if (CHUNK % width == 0 && p1 - p0 == CHUNK && p0 % CHUNK == 0 && p0 >= start && p1 <= stop && p1 <= full) {
            if (width % V == 0 && CHUNK / LANES(bits) % width == 0)
                code_chunk(y, wpad, width, scl, mv, mp, bits, wide, out + p0 / CHUNK * chunk_bytes);
            else {
                for (long i = 0; i < nr; i++)
                    row_codes(y + i * wpad, width, scl[i], mv, mids, bits, wide, rc + i * width);
                pack_byte_chunk(rc, bits, out + p0 / CHUNK * chunk_bytes);
            }
            continue;
        }
        for (long i = 0; i < nr; i++)
            row_codes(y + i * wpad, width, scl[i], mv, mids, bits, wide, rc + i * width);
        /* the codes at positions [max(p0, start), min(p1, stop)) to their chunk, or to the tail */
        for (long p = p0 > start ? p0 : start, e = p1 < stop ? p1 : stop; p < e;) {
            if (p >= full) {
                memcpy(tail + (p - full), rc + (p - p0), e - p);
                break;
            }
            long c = p / CHUNK, ce = (c + 1) * CHUNK < e ? (c + 1) * CHUNK : e;
            memcpy(chunk + (p - c * CHUNK), rc + (p - p0), ce - p);
            if (ce == (c + 1) * CHUNK)
                pack_byte_chunk(chunk, bits, out + c * chunk_bytes);
            p = ce;
        }
    }
done:
    free(y);
    free(s64);
    free(rc);
    free(chunk);
    return bad;
}

/* Row widths compiled as constants, so that the loops over a row unroll and its vectors stay in registers:
 * one Hadamard block of 16, 32 or 64 (a CNN feature map's rows: 14, 28, 56 padded) and MiniLM's 384 in
 * blocks of 128; others take the general loops (wider single blocks gain nothing measurable). The decode
 * keeps a row of up to REG_WIDTH values in a local array. */
#define REG_WIDTH 128
#define CONST_WIDTH(W, call) \
    if (signs && width == block) \
        switch (width) { \
        case 16: { const long W = 16, B = W; return call; } \
        case 32: { const long W = 32, B = W; return call; } \
        case 64: { const long W = 64, B = W; return call; } \
        } \
    if (signs && width == 384 && block == 128) { const long W = 384, B = 128; return call; }

static inline INLINE int encode_width(const float *x, const float *signs, long rows, long d, long width, long block,
                                      float inv_sqrt, const float *mids, int bits, int mant, int emin, double top,
                                      long start, long stop, long full, uint8_t *out, float *scales, uint8_t *tail, int wide) {
    CONST_WIDTH(W, encode_body(x, signs, rows, d, W, B, inv_sqrt, mids, bits, mant, emin, top, start, stop, full,
                               out, scales, tail, wide))
    return encode_body(x, signs, rows, d, width, block, inv_sqrt, mids, bits, mant, emin, top, start, stop, full, out,
                       scales, tail, wide);
}

/* Encode the codes at positions [start, stop) of the stream of rows * width codes (start a multiple
 * of CHUNK): chunks below `full` packed into `out`, codes from `full` on into `tail` (one byte each);
 * rows that start in [start, stop) get their scale. signs: NULL for no rotation (width == block == d).
 * Returns 0, 1 if a row holds inf/NaN or its scale overflows the scale dtype, 2 if out of memory.
 * The per-bits bodies are inlined so that the compiler sees the constants of the layout and of the
 * level comparisons. */
#define ENCODE_ROWS(name, attr, wide) \
    attr static int name(const float *x, const float *signs, long rows, long d, long width, long block, \
                         float inv_sqrt, const float *mids, int bits, int mant, int emin, double top, long start, \
                         long stop, long full, uint8_t *out, float *scales, uint8_t *tail) { \
        switch (bits) { \
        case 1: return ENCODE(1, wide); \
        case 2: return ENCODE(2, wide); \
        case 3: return ENCODE(3, wide); \
        case 4: return ENCODE(4, wide); \
        default: return 3; \
        } \
    }
#define ENCODE(b, w) encode_width(x, signs, rows, d, width, block, inv_sqrt, mids, b, mant, emin, top, start, stop, \
                                 full, out, scales, tail, w)


/* V values at y (times the V signs at s, unless NULL) stored at o, whole or in halves (`wide`): GCC would assemble
 * a computed 16-lane vector through general registers before storing it whole. */
static inline INLINE void signed_store(float *o, const float *y, const float *s, int wide) {
    if (wide) {
        store(o, s ? load(y) * load(s) : load(y));
        return;
    }
    for (int h = 0; h < V; h += 8) {
        vf8 a, b;
        memcpy(&a, y + h, sizeof a);
        if (s) {
            memcpy(&b, s + h, sizeof b);
            a *= b;
        }
        memcpy(o + h, &a, sizeof a);
    }
}

static inline INLINE void widen(int32_t *to, const uint8_t *from, long n) {
    for (long i = 0; i < n; i++)
        to[i] = from[i];
}

/* Decode rows [r0, r1) (see dgpipe_decode_rows). A row is rebuilt in vectors (in registers where the width
 * is a constant up to REG_WIDTH): level * scale, the butterflies with the factor in the last stage; then its
 * first d values times the signs are written out, the last partial vector whole where the next row of the
 * call will overwrite what it writes past the row. */
static inline INLINE int decode_body(const uint8_t *packed, int bits, const float *table, const float *scales, long d,
                                     long width, long block, float inv_sqrt, const float *signs, const uint8_t *tail,
                                     long full, long r0, long r1, float *out, int wide) {
    long n = (width + V - 1) / V;
    vf local[REG_WIDTH / V], *r = width <= REG_WIDTH ? local : aligned_alloc(64, n * sizeof(vf));
    vf *sg = aligned_alloc(64, n * sizeof(vf)); /* the signs (1 without a rotation), zero padded */
    int32_t *rc = malloc(n * V * sizeof(int32_t)); /* the row's codes */
    uint8_t *chunk = malloc(CHUNK);
    int bad = 0;
    if (!r || !sg || !rc || !chunk) {
        bad = 2;
        goto done;
    }
    for (long k = 0; k < n * V; k++)
        ((float *)sg)[k] = k >= d ? 0.0f : signs ? signs[k] : 1.0f;
    long chunk_bytes = (long)CHUNK * bits / 8, have = -1; /* the chunk unpacked in `chunk` */
    float lv[V] = {0};
    memcpy(lv, table, sizeof(float) << bits);
    vf levels = load(lv);
    for (long row = r0; row < r1; row++) {
        long p0 = row * width, p1 = p0 + width;
        for (long p = p0; p < p1;) {
            if (p >= full) {
                widen(rc + (p - p0), tail + (p - full), p1 - p);
                break;
            }
            long c = p / CHUNK, ce = (c + 1) * CHUNK < p1 ? (c + 1) * CHUNK : p1;
            if (c != have) {
                unpack_byte_chunk(packed + c * chunk_bytes, bits, chunk);
                have = c;
            }
            widen(rc + (p - p0), chunk + (p - c * CHUNK), ce - p);
            p = ce;
        }
        vf s = splat(scales[row], wide);
        float *o = out + row * d, *y = (float *)r, *ys = (float *)sg;
        long j = 0;
        for (; j + V <= width; j += V) {
            vi idx;
            memcpy(&idx, rc + j, sizeof idx);
            vf v = lookup(levels, idx, 1 << bits, wide) * s;
            if (signs && block >= V)
                short_strides(y + j, v, wide);
            else
                r[j / V] = v;
        }
        for (; j < width; j++)
            y[j] = table[rc[j]] * scales[row];
        if (signs && block >= V)
            long_strides(r, width / V, block / V, inv_sqrt);
        else if (signs) {
            __asm__("" ::: "memory"); /* the products rounded and stored: none is fused with a sum below */
            small_blocks(y, width, block, inv_sqrt);
        }
        long k = 0, room = (r1 - row) * d;
        for (; k + V <= room && k < d; k += V)
            signed_store(o + k, y + k, signs ? ys + k : NULL, wide);
        for (; k < d; k++)
            o[k] = signs ? y[k] * ys[k] : y[k];
    }
done:
    if (r != local)
        free(r);
    free(sg);
    free(rc);
    free(chunk);
    return bad;
}

static inline INLINE int decode_width(const uint8_t *packed, int bits, const float *table, const float *scales, long d,
                                      long width, long block, float inv_sqrt, const float *signs, const uint8_t *tail,
                                      long full, long r0, long r1, float *out, int wide) {
    CONST_WIDTH(W, decode_body(packed, bits, table, scales, d, W, B, inv_sqrt, signs, tail, full, r0, r1, out, wide))
    return decode_body(packed, bits, table, scales, d, width, block, inv_sqrt, signs, tail, full, r0, r1, out, wide);
}

/* Decode rows [r0, r1): out[r * d + k] for k < d. tail: the codes from position `full` on, one byte
 * each. Returns 0, or 2 if out of memory. */
#define DECODE_ROWS(name, attr, wide) \
    attr static int name(const uint8_t *packed, int bits, const float *table, const float *scales, long d, \
                         long width, long block, float inv_sqrt, const float *signs, const uint8_t *tail, long full, \
                         long r0, long r1, float *out) { \
        switch (bits) { \
        case 1: return DECODE(1, wide); \
        case 2: return DECODE(2, wide); \
        case 3: return DECODE(3, wide); \
        case 4: return DECODE(4, wide); \
        default: return 3; \
        } \
    }
#define DECODE(b, w) decode_width(packed, b, table, scales, d, width, block, inv_sqrt, signs, tail, full, r0, r1, out, w)

/* Both entry points in each variant (VARIANTS), or once for the one target. */
#if VARIANTS
#define EACH_VARIANT(ROWS, name) \
    ROWS(name##_avx512, TARGET_AVX512, 1) ROWS(name##_avx2, TARGET_AVX2, NARROW_WIDE) \
    ROWS(name##_baseline, , NARROW_WIDE)
#elif defined(__x86_64__) && !defined(__AVX512F__)
#define EACH_VARIANT(ROWS, name) ROWS(name, , NARROW_WIDE)
#else
#define EACH_VARIANT(ROWS, name) ROWS(name, , 1)
#endif
EACH_VARIANT(ENCODE_ROWS, encode_rows)
EACH_VARIANT(DECODE_ROWS, decode_rows)
#undef ENCODE
#undef DECODE


/* The exported entry points: the variant of the CPU's features where there are several (variants.h), on parts of
 * the work run by torch's threads (team.h). */
TEAM_ENTRY

#define ENCODE_ROWS_ARGS(X) X(const float *, x) X(const float *, signs) X(long, rows) X(long, d) X(long, width) \
    X(long, block) X(float, inv_sqrt) X(const float *, mids) X(int, bits) X(int, mant) X(int, emin) X(double, top) \
    X(long, full) X(uint8_t *, out) X(float *, scales) X(uint8_t *, tail)
struct encode_rows_args { ENCODE_ROWS_ARGS(TEAM_FIELD) };

/* Chunks [c0, c1) of the rows * width codes; the last part takes the n % CHUNK tail. */
static int encode_rows_part(const void *data, long k, long c0, long c1) {
    const struct encode_rows_args *a = data;
    const long n = a->rows * a->width;
    (void)k;
    return PICK(encode_rows, (a->x, a->signs, a->rows, a->d, a->width, a->block, a->inv_sqrt, a->mids, a->bits,
                               a->mant, a->emin, a->top, c0 * CHUNK, c1 == n / CHUNK ? n : c1 * CHUNK, a->full,
                               a->out, a->scales, a->tail));
}

/* Code the rows * width values of x in `parts` parts of whole chunks on up to `threads` threads. */
int dgpipe_encode_rows(ENCODE_ROWS_ARGS(TEAM_PARAM) long parts, int threads) {
    const struct encode_rows_args a = {ENCODE_ROWS_ARGS(TEAM_ARG)};
    return team_run(encode_rows_part, &a, 0, rows * width / CHUNK, parts, threads);
}

#define DECODE_ROWS_ARGS(X) X(const uint8_t *, packed) X(int, bits) X(const float *, table) X(const float *, scales) \
    X(long, d) X(long, width) X(long, block) X(float, inv_sqrt) X(const float *, signs) X(const uint8_t *, tail) \
    X(long, full) X(float *, out)
struct decode_rows_args { DECODE_ROWS_ARGS(TEAM_FIELD) };

static int decode_rows_part(const void *data, long k, long r0, long r1) {
    const struct decode_rows_args *a = data;
    (void)k;
    return PICK(decode_rows, (a->packed, a->bits, a->table, a->scales, a->d, a->width, a->block, a->inv_sqrt,
                               a->signs, a->tail, a->full, r0, r1, a->out));
}

/* Decode rows [r0, r1) in `parts` parts on up to `threads` threads. */
int dgpipe_decode_rows(DECODE_ROWS_ARGS(TEAM_PARAM) long r0, long r1, long parts, int threads) {
    const struct decode_rows_args a = {DECODE_ROWS_ARGS(TEAM_ARG)};
    return team_run(decode_rows_part, &a, r0, r1, parts, threads);
}
