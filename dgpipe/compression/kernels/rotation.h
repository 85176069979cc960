/*
 * The rotation of the codebook codec's rows (rows.c) and their scale: the random signs, zero padding, the
 * Walsh-Hadamard butterflies in blocks and the orthonormal factor (fwht.py's order: strides 1, 2, 4 and 8
 * inside a vector with a lane permutation, longer strides pairing whole vectors, two stages per pass), the
 * row's float64 sum of squares folded pairwise as levels.row_rms folds it, and the rounding of a scale up
 * to the scale dtype. Every product that meets a sum is exact (a value times +-1, a float32 squared in
 * float64), so a fused multiply-add changes nothing (rows.c is built with -ffp-contract=fast).
 * Reference: Fino and Algazi, IEEE Trans. Computers 1976.
 */
#ifndef DGPIPE_ROTATION_H
#define DGPIPE_ROTATION_H

#include <math.h>

#include "vectors.h"

/* Stride-h butterflies (h = 1, 2, 4, 8) inside one vector: lane i pairs with lane i ^ h. */
#define SWAP(v, h) SHUFFLE(v, vi, 0 ^ h, 1 ^ h, 2 ^ h, 3 ^ h, 4 ^ h, 5 ^ h, 6 ^ h, 7 ^ h, \
                           8 ^ h, 9 ^ h, 10 ^ h, 11 ^ h, 12 ^ h, 13 ^ h, 14 ^ h, 15 ^ h)
static const vf SIGN1 = {1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1};
static const vf SIGN2 = {1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1};
static const vf SIGN4 = {1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1};
static const vf SIGN8 = {1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1};

/* The butterflies of strides 1, 2, 4 and 8 of v, stored at dst: partner + value * sign, one fused multiply-add
 * where the machine has one (the product is exact). Where a vector is wider than the machine's (not `wide`),
 * the stride-8 results go out as two halves (partner + value * 1 is their sum, partner + value * -1 the lower
 * minus the upper, exactly): GCC would assemble the 16-lane result through general registers first. */
static inline INLINE void short_strides(float *dst, vf v, int wide) {
    v = SWAP(v, 1) + v * SIGN1;
    v = SWAP(v, 2) + v * SIGN2;
    v = SWAP(v, 4) + v * SIGN4;
#if !NARROW_WIDE
    if (!wide) {
        vf8 h[2];
        memcpy(h, &v, sizeof v);
        vf8 r[2] = {h[1] + h[0], h[0] - h[1]};
        memcpy(dst, r, sizeof r);
        return;
    }
#endif
    (void)wide;
    store(dst, SWAP(v, 8) + v * SIGN8);
}

/* The butterflies of stride >= V of fwht.fwht on a row of `n` vectors in blocks of `bn` vectors, in the
 * reference's order, then the orthonormal factor f. The strides below V are done (short_strides). Two
 * stages per pass where they pair up; the factor rides on the last stage (a product of the stage's sum,
 * as the reference's). */
static inline INLINE void long_strides(vf *r, long n, long bn, float f) {
    vf fv = (vf){} + f;
    long h = 1;
    for (; 4 * h <= bn; h *= 4) {
        int last = 4 * h == bn;
        for (long i = 0; i < n; i += 4 * h)
            for (long j = i; j < i + h; j++) {
                vf a = r[j], c = r[j + h], e = r[j + 2 * h], g = r[j + 3 * h];
                vf a1 = a + c, c1 = a - c, e1 = e + g, g1 = e - g; /* stage h */
                vf a2 = a1 + e1, e2 = a1 - e1, c2 = c1 + g1, g2 = c1 - g1; /* stage 2h */
                if (last)
                    a2 *= fv, c2 *= fv, e2 *= fv, g2 *= fv;
                r[j] = a2, r[j + h] = c2, r[j + 2 * h] = e2, r[j + 3 * h] = g2;
            }
    }
    for (; h < bn; h *= 2) {
        int last = 2 * h == bn;
        for (long i = 0; i < n; i += 2 * h)
            for (long j = i; j < i + h; j++) {
                vf a = r[j], c = r[j + h], s = a + c, t = a - c;
                if (last)
                    s *= fv, t *= fv;
                r[j] = s, r[j + h] = t;
            }
    }
    if (bn == 1) /* no stage left to carry the factor */
        for (long k = 0; k < n; k++)
            r[k] *= fv;
}

/* fwht.fwht on blocks of b < V values of a row of `width` values, then the factor f: one value at a time,
 * for rows too narrow for the vector passes. */
static inline INLINE void small_blocks(float *y, long width, long b, float f) {
    for (long h = 1; h < b; h *= 2)
        for (long i = 0; i < width; i += 2 * h)
            for (long j = i; j < i + h; j++) {
                float a = y[j], c = y[j + h];
                y[j] = a + c, y[j + h] = a - c;
            }
    for (long k = 0; k < width; k++)
        y[k] *= f;
}

/* A row's values times the signs, zero padded to `width`, in vectors: the last partial vector of a
 * row (from `part` on) reads past the row's end where the tensor has room (`room` floats from the
 * row's start) and clears the lanes past d with a mask -- a product with zero would keep a NaN. */
typedef struct {
    long d, part;
    vi keep;  /* lanes < d - part */
    vf signs; /* signs[part:d], zero padded */
} row_tail;

static inline INLINE row_tail make_tail(const float *signs, long d) {
    row_tail t = {d, d / V * V, {}, {}};
    float s[V] = {0};
    for (long k = t.part; k < d; k++)
        s[k - t.part] = signs[k];
    t.signs = load(s);
    for (int k = 0; k < V; k++)
        t.keep[k] = t.part + k < d ? -1 : 0;
    return t;
}

static inline INLINE vf signed_load(const float *x, const float *signs, const row_tail *t, long room, long j) {
    if (j < t->part)
        return load(x + j) * load(signs + j);
    if (j > t->part || t->part == t->d)
        return (vf){};
    if (j + V <= room)
        return (vf)((vi)load(x + j) & t->keep) * t->signs;
    float v[V] = {0};
    for (long k = j; k < t->d; k++)
        v[k - j] = x[k];
    return load(v) * t->signs;
}

/* The rotation of one row: y = fwht(pad(x * signs, width)) in blocks of `b`, orthonormal (factor f);
 * y is 64-byte aligned. */
static inline INLINE void rotate_row(const float *x, const float *signs, const row_tail *t, long room, long width,
                                     long b, float f, float *y, int wide) {
    if (b >= V) {
        for (long k = 0; k < width / V; k++)
            short_strides(y + k * V, signed_load(x, signs, t, room, k * V), wide);
        long_strides((vf *)y, width / V, b / V, f);
    } else {
        for (long j = 0; j < width; j++)
            y[j] = j < t->d ? x[j] * signs[j] : 0.0f;
        small_blocks(y, width, b, f);
    }
}

/* levels.row_rms's squares and fold of a row of a power-of-two width w >= V, in vectors of 8 float64:
 * the first level pairs y[j] with y[w / 2 + j]; then vector k takes vector k + m / 2 while m vectors
 * remain; then the lanes of the last one, 4 -> 2 -> 1. */
static inline INLINE double sum_squares_pow2(const float *y, long w) {
    long n = w / V; /* float64 vectors after the first level */
    vd s[n > 1 ? n : 2];
    if (n == 1) {
        vd2 a = __builtin_convertvector(load(y), vd2);
        memcpy(s, &a, sizeof a);
        s[0] = s[0] * s[0] + s[1] * s[1];
    }
    for (long k = 0; k + 1 < n; k += 2) {
        vd2 a = __builtin_convertvector(load(y + 8 * k), vd2), c = __builtin_convertvector(load(y + w / 2 + 8 * k), vd2);
        vd2 q = a * a + c * c;
        memcpy(s + k, &q, sizeof q);
    }
    for (long m = n; m > 1; m /= 2)
        for (long k = 0; k < m / 2; k++)
            s[k] += s[k + m / 2];
    vd v = s[0];
    v += SHUFFLE(v, vl, 4, 5, 6, 7, 4, 5, 6, 7);
    v += SHUFFLE(v, vl, 2, 3, 2, 3, 2, 3, 2, 3);
    return v[0] + v[1];
}

/* levels.row_rms's fold, first level: s64[j] = y[j]**2 + y[h + j]**2 (h = ceil(width / 2)), in float64, 4 values
 * at a time: GCC would assemble a computed vector of 16 float64 in general registers on a machine without
 * AVX-512, and the AVX-512 build runs as fast this way. */
static inline INLINE void squares(const float *y, long width, double *s64) {
    long m = width, h = (m + 1) / 2, j = 0;
    for (; j + 4 <= m - h; j += 4) { /* lane by lane: GCC converts a loaded 4-float vector via the stack */
        const float *a4 = y + j, *c4 = y + h + j;
        vd4 a = {a4[0], a4[1], a4[2], a4[3]}, c = {c4[0], c4[1], c4[2], c4[3]}, s = a * a + c * c;
        memcpy(s64 + j, &s, sizeof s);
    }
    for (; j < m - h; j++)
        s64[j] = (double)y[j] * y[j] + (double)y[h + j] * y[h + j];
    for (; j < h; j++) /* the middle value of an odd width: no partner yet */
        s64[j] = (double)y[j] * y[j];
}

/* The rest of the fold on `nr` rows of first-level sums at once (row i at s64 + i * stride, m values):
 * while m > 1 values remain, the upper m - ceil(m / 2) are added to the lower ones. A level of every row
 * before the next level of any, so that the rows' chains of dependent sums overlap. Leaves the sums
 * in s64[i * stride]. 4 values at a time (GCC would store a sum of 8 float64 through the stack on a
 * machine without AVX-512). */
static inline INLINE void fold(double *s64, long stride, long nr, long m) {
    for (long h; m > 1; m = h) {
        h = (m + 1) / 2;
        for (long i = 0; i < nr; i++) {
            double *s = s64 + i * stride;
            long j = 0;
            for (; j + 4 <= m - h; j += 4) {
                vd4 a, c;
                memcpy(&a, s + j, sizeof a);
                memcpy(&c, s + h + j, sizeof c);
                a += c;
                memcpy(s + j, &a, sizeof a);
            }
            for (; j < m - h; j++)
                s[j] += s[h + j];
        }
    }
}

/* The smallest value of the scale dtype >= t (grouping.round_meta rounding up); inf if none.
 * mant: explicit mantissa bits (0: float32, no rounding); emin: least normal exponent. The dtype's spacing
 * at t is 2**e, e = max(t's exponent, emin) - mant, and t / 2**e, its ceiling and the product are exact in
 * float64; no library calls, so that a loop of them vectorises. */
static inline INLINE float ceil_meta(float t, int mant, int emin, double top) {
    uint32_t b;
    memcpy(&b, &t, sizeof b);
    int e = (int)(b >> 23 & 0xff) - 127; /* -127 for a subnormal t: below every emin */
    e = (e > emin ? e : emin) - mant;
    uint64_t up = (uint64_t)(1023 + e) << 52, down = (uint64_t)(1023 - e) << 52;
    double spacing, inverse;
    memcpy(&spacing, &up, sizeof spacing);
    memcpy(&inverse, &down, sizeof inverse);
    double r = ceil((double)t * inverse) * spacing;
    float rounded = r <= top ? (float)r : INFINITY;
    return mant == 0 || !(t > 0 && t < INFINITY) ? t : rounded;
}

#endif
