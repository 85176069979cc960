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
 * are compiled as constants. GCC's vector extensions (which clang shares) leave the instruction set to
 * the compiler; on x86-64 the entry points are built as AVX-512, AVX2 and baseline variants (target
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

#include "team.h"
#include "variants.h"

#define CHUNK 4096 /* codes per chunk of the packed layout (bitpack.CHUNK) */
#define V 16       /* floats per vector */

typedef float vf __attribute__((vector_size(4 * V)));
typedef int32_t vi __attribute__((vector_size(4 * V)));
typedef uint8_t vb __attribute__((vector_size(V)));
typedef double vd __attribute__((vector_size(4 * V)));
typedef double vd2 __attribute__((vector_size(8 * V))); /* the 16 float64 of one vf */
typedef float vf8 __attribute__((vector_size(32)));  /* half a vf */
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef uint8_t vb32 __attribute__((vector_size(32))); /* the bytes of a vi8 */
typedef double vd4 __attribute__((vector_size(32)));  /* a quarter of a vf in float64 */


/* `wide`: whether comparisons, run-time permutes, broadcasts and narrowing take the 16 lanes whole, or in
 * halves of 8 lanes. GCC keeps a vector wider than the machine's in memory and lowers those lane by lane
 * (AVX2 and below: 2-4x slower than AVX-512), but not halves that fit; on AVX-512 halves cost 1.5-2x.
 * NARROW_WIDE: `wide` where the machine's vectors are narrower -- clang splits wide vectors itself. */
#if defined(__clang__) || !defined(__x86_64__)
#define NARROW_WIDE 1
#else
#define NARROW_WIDE 0
#endif

static inline INLINE vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline INLINE void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* x in every lane, whole or through a half (`wide`, above). */
static inline INLINE vf splat(float x, int wide) {
    if (wide)
        return (vf){} + x;
    vf8 h[2] = {(vf8){} + x, (vf8){} + x};
    vf v;
    memcpy(&v, h, sizeof v);
    return v;
}

#if !defined(__clang__)
/* The low bytes of 8 lanes, by a byte permute with constant lanes (GCC converts 8 lanes to 8 bytes one lane
 * at a time); little endian: a lane's low byte comes first. */
static inline INLINE uint64_t narrow_half(vi8 v) {
    const vb32 low = {0, 4, 8, 12, 16, 20, 24, 28};
    vb32 b = __builtin_shuffle((vb32)v, low);
    uint64_t r;
    memcpy(&r, &b, sizeof r);
    return r;
}
#endif

/* The low byte of each lane, whole or in halves (`wide`, above). */
static inline INLINE vb narrow(vi v, int wide) {
#if defined(__clang__) /* always wide */
    (void)wide;
    return __builtin_convertvector(v, vb);
#else
    if (wide)
        return __builtin_convertvector(v, vb);
    /* the low bytes of each half gathered by a byte permute with constant lanes (GCC converts 8 lanes to 8
     * bytes one lane at a time); little endian: a lane's low byte comes first */
    vi8 h[2];
    vb r;
    memcpy(h, &v, sizeof v);
    for (int k = 0; k < 2; k++) {
        uint64_t b = narrow_half(h[k]);
        memcpy((uint8_t *)&r + 8 * k, &b, 8);
    }
    return r;
#endif
}

/* Lane permutations in each compiler's spelling. Constant lanes: __builtin_shufflevector (clang, GCC 12+),
 * __builtin_shuffle with a constant mask vector (GCC 11). Lanes chosen at run time: lookup (below). */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(v, mask_type, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE(v, mask_type, ...) __builtin_shuffle(v, (mask_type){__VA_ARGS__})
#endif
typedef int64_t vl __attribute__((vector_size(4 * V))); /* lane numbers of a vd */

/* Lane idx[i] of m for each lane i, where idx[i] < n. GCC: a permute with run-time lanes. clang has no
 * such builtin: a select per candidate lane, which it vectorises on every instruction set (a loop over the
 * lanes would be scalar; on GCC the selects cost up to 2x the permute at 4 bits). */
static inline INLINE vf lookup(vf m, vi idx, int n, int wide) {
    (void)wide;
#if defined(__clang__)
    vi r = (vi){};
    for (int k = 0; k < n; k++)
        r |= (idx == k) & (vi)((vf){} + m[k]);
    return (vf)r;
#else
    if (wide) /* one instruction on AVX-512; else one 256-bit permute per half (two and a select for n > 8) */
        return __builtin_shuffle(m, idx);
    vf8 m0, m1, r[2];
    vi8 i[2];
    memcpy(&m0, &m, sizeof m0);
    memcpy(&m1, (char *)&m + sizeof m0, sizeof m1);
    memcpy(i, &idx, sizeof idx);
    for (int h = 0; h < 2; h++)
        r[h] = n <= 8 ? __builtin_shuffle(m0, i[h]) : __builtin_shuffle(m0, m1, i[h]);
    vf v;
    memcpy(&v, r, sizeof v);
    return v;
#endif
}

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

/* A chunk of CHUNK codes, one byte each, to bitpack.py's layout (LANES) and back. */
static inline INLINE void pack_chunk(const uint8_t *codes, int bits, uint8_t *out) {
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

static inline INLINE void unpack_chunk(const uint8_t *in, int bits, uint8_t *codes) {
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
                pack_chunk(rc, bits, out + p0 / CHUNK * chunk_bytes);
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
                pack_chunk(chunk, bits, out + c * chunk_bytes);
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
                unpack_chunk(packed + c * chunk_bytes, bits, chunk);
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
