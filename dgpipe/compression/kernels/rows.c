/*
 * The codebook codec's token groups in one pass per row, compiled C (see rows.py).
 *
 * Encode, per row of d float32 values: the random signs, zero padding to `width`, the
 * Walsh-Hadamard butterflies of each `block` (Fino and Algazi 1976) and the orthonormal factor,
 * the row's RMS (float64 squares, the pairwise fold of levels.row_rms) rounded up to the scale
 * dtype, the division by it, the level codes (how many midpoints a value exceeds) and the
 * bit-packing of bitpack.py's layout. Decode: unpack, level * scale, the butterflies, the factor,
 * the signs. The floating-point operations and their order are those of the reference steps, so
 * the bytes and the decoded values are bit for bit theirs: build with -ffp-contract=off.
 *
 * Rows stay in row-major order: butterflies of stride >= 16 are loops over contiguous runs of
 * 16 values; strides 1, 2, 4 and 8 are done inside each run with a lane permutation,
 * partner + sign * value (the sign +-1 makes the product exact, so the sum is a + b in the lower
 * lane and a - b in the upper one, the reference's two results). Rows go in groups: their
 * rotations and scales first, then their codes. A value's code is a binary search over the
 * midpoints held in one vector. GCC's vector extensions leave the instruction set to the
 * compiler; target_clones builds AVX-512, AVX2 and baseline x86-64 variants and picks one at
 * load time (every helper is always_inline, so that it is compiled inside each variant).
 * Reference for the transform: Fino and Algazi, IEEE Trans. Computers 1976; for the levels:
 * Max 1960, Lloyd 1982.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 4096 /* codes per chunk of the packed layout (bitpack.CHUNK) */
#define V 16       /* floats per vector */
#define INLINE __attribute__((always_inline))

typedef float vf __attribute__((vector_size(4 * V)));
typedef int32_t vi __attribute__((vector_size(4 * V)));
typedef uint8_t vb __attribute__((vector_size(V)));
typedef double vd __attribute__((vector_size(4 * V)));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

static inline INLINE vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline INLINE void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* Stride-h butterflies (h = 1, 2, 4, 8) inside one vector: lane i pairs with lane i ^ h. */
#define SWAP(v, h) __builtin_shufflevector(v, v, 0 ^ h, 1 ^ h, 2 ^ h, 3 ^ h, 4 ^ h, 5 ^ h, 6 ^ h, 7 ^ h, \
                                           8 ^ h, 9 ^ h, 10 ^ h, 11 ^ h, 12 ^ h, 13 ^ h, 14 ^ h, 15 ^ h)
static const vf SIGN1 = {1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1};
static const vf SIGN2 = {1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1};
static const vf SIGN4 = {1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1};
static const vf SIGN8 = {1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1};

static inline INLINE vf short_strides(vf v) {
    v = SWAP(v, 1) + v * SIGN1;
    v = SWAP(v, 2) + v * SIGN2;
    v = SWAP(v, 4) + v * SIGN4;
    return SWAP(v, 8) + v * SIGN8;
}

/* The butterflies of stride >= `h0` (a power of two) of fwht.fwht on each block of `b` values of row `y`
 * (`width` values, a multiple of `b`), in the reference's order, then the orthonormal factor `f`
 * (1 to leave it out). Strides >= V run on whole vectors, two stages per pass where they pair up. */
static inline INLINE void long_strides(float *y, long width, long b, long h0, float f) {
    vf fv = (vf){} + f;
    long h = h0;
    for (; 4 * h <= b && h >= V; h *= 4) {
        int last = 4 * h == b;
        for (long i = 0; i < width; i += 4 * h)
            for (long j = i; j < i + h; j += V) {
                vf a = load(y + j), c = load(y + j + h), e = load(y + j + 2 * h), g = load(y + j + 3 * h);
                vf a1 = a + c, c1 = a - c, e1 = e + g, g1 = e - g; /* stage h */
                vf a2 = a1 + e1, e2 = a1 - e1, c2 = c1 + g1, g2 = c1 - g1; /* stage 2h */
                if (last) {
                    a2 *= fv, c2 *= fv, e2 *= fv, g2 *= fv;
                }
                store(y + j, a2), store(y + j + h, c2), store(y + j + 2 * h, e2), store(y + j + 3 * h, g2);
            }
    }
    for (; h < b; h *= 2) {
        int last = 2 * h == b;
        for (long i = 0; i < width; i += 2 * h) {
            float *p = y + i, *q = y + i + h;
            if (h >= V) {
                for (long j = 0; j < h; j += V) {
                    vf a = load(p + j), c = load(q + j), s = a + c, t = a - c;
                    if (last)
                        s *= fv, t *= fv;
                    store(p + j, s);
                    store(q + j, t);
                }
            } else {
                for (long j = 0; j < h; j++) {
                    float a = p[j], c = q[j];
                    p[j] = last ? (a + c) * f : a + c;
                    q[j] = last ? (a - c) * f : a - c;
                }
            }
        }
    }
    if (h0 >= b && f != 1.0f) /* no stage left to carry the factor */
        for (long j = 0; j < width; j += V)
            store(y + j, load(y + j) * fv);
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

/* The rotation of one row: y = fwht(pad(x * signs, width)) in blocks of `b`, orthonormal. */
static inline INLINE void rotate_row(const float *x, const float *signs, const row_tail *t, long room, long width,
                                     long b, float f, float *y) {
    if (b >= V) {
        for (long j = 0; j < width; j += V)
            store(y + j, short_strides(signed_load(x, signs, t, room, j)));
        long_strides(y, width, b, V, f);
    } else {
        for (long j = 0; j < width; j++)
            y[j] = j < t->d ? x[j] * signs[j] : 0.0f;
        long_strides(y, width, b, 1, f);
    }
}

/* The inverse rotation of one row, in place: y = fwht(y) (orthonormal), then out = y[:d] * signs; the
 * strides below V are done already where b >= V (the decode runs them as it reads the levels). */
static inline INLINE void unrotate_row(float *y, long width, long b, float f, const float *signs, long d, float *out) {
    long_strides(y, width, b, b >= V ? V : 1, f);
    long k = 0;
    for (; k + V <= d; k += V)
        store(out + k, load(y + k) * load(signs + k));
    for (; k < d; k++)
        out[k] = y[k] * signs[k];
}

/* levels.row_rms's fold, first level: s64[j] = y[j]**2 + y[h + j]**2 (h = ceil(width / 2)), in float64. */
static inline INLINE void squares(const float *y, long width, double *s64) {
    long m = width, h = (m + 1) / 2, j = 0;
    for (; j + V / 2 <= m - h; j += V / 2) {
        typedef float v8 __attribute__((vector_size(2 * V)));
        v8 a, c;
        memcpy(&a, y + j, sizeof a);
        memcpy(&c, y + h + j, sizeof c);
        vd a64 = __builtin_convertvector(a, vd), c64 = __builtin_convertvector(c, vd);
        vd s = a64 * a64 + c64 * c64;
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
 * in s64[i * stride]. */
static inline INLINE void fold(double *s64, long stride, long nr, long m) {
    for (long h; m > 1; m = h) {
        h = (m + 1) / 2;
        for (long i = 0; i < nr; i++) {
            double *s = s64 + i * stride;
            long j = 0;
            for (; j + V / 2 <= m - h; j += V / 2) {
                vd a, c;
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
 * mant: explicit mantissa bits (0: float32, no rounding); emin: least normal exponent. */
static inline INLINE float ceil_meta(float t, int mant, int emin, double top) {
    if (mant == 0 || !(t > 0 && t < INFINITY))
        return t;
    int e;
    frexp((double)t, &e);
    e = e - 1 > emin ? e - 1 : emin;
    double ulp = ldexp(1.0, e - mant);
    double r = ceil((double)t / ulp) * ulp;
    return r <= top ? (float)r : INFINITY;
}

/* Codes (0 .. 2**bits - 1) of row `y` / div: how many of the 2**bits - 1 ascending midpoints each
 * exceeds (levels.nearest_level), found by a binary search over the midpoints held in one vector `m`
 * (mids, zero padded): `bits` comparisons per value instead of 2**bits - 1, the same count. */
static inline INLINE void row_codes(const float *y, long width, float div, vf m, const float *mids, int bits,
                                    uint8_t *codes) {
    int nm = (1 << bits) - 1;
    vf dv = (vf){} + div;
    long j = 0;
    for (; j + V <= width; j += V) {
        vf q = load(y + j) / dv;
        vi c = (vi){};
        for (int k = bits - 1; k >= 0; k--) {
            vi probe = c + ((1 << k) - 1); /* the midpoint halfway through the codes left */
            c |= (q > __builtin_shuffle(m, probe)) & ((vi){} + (1 << k));
        }
        vb cb = __builtin_convertvector(c, vb);
        memcpy(codes + j, &cb, V);
    }
    for (; j < width; j++) {
        float q = y[j] / div;
        int c = 0;
        for (int i = 0; i < nm; i++)
            c += q > mids[i];
        codes[j] = (uint8_t)c;
    }
}

/* bitpack.py's layout of one chunk of CHUNK codes of `bits` <= 4 bits: g lanes of CHUNK / g codes,
 * word j holds code j of lane l at bits l * bits; w byte planes of the words. */
static inline INLINE void pack_chunk(const uint8_t *codes, int bits, uint8_t *out) {
    if (8 % bits == 0) {
        int g = 8 / bits;
        long cg = CHUNK / g;
        for (long j = 0; j < cg; j++) {
            unsigned byte = 0;
            for (int l = 0; l < g; l++)
                byte |= (unsigned)codes[l * cg + j] << (l * bits);
            out[j] = (uint8_t)byte;
        }
    } else {
        int g = 8, w = bits;
        long cg = CHUNK / g;
        for (long j = 0; j < cg; j++) {
            uint64_t word = 0;
            for (int l = 0; l < g; l++)
                word |= (uint64_t)codes[l * cg + j] << (l * bits);
            for (int q = 0; q < w; q++)
                out[q * cg + j] = (uint8_t)(word >> (8 * q));
        }
    }
}

static inline INLINE void unpack_chunk(const uint8_t *in, int bits, uint8_t *codes) {
    unsigned mask = (1u << bits) - 1;
    if (8 % bits == 0) {
        int g = 8 / bits;
        long cg = CHUNK / g;
        for (int l = 0; l < g; l++)
            for (long j = 0; j < cg; j++)
                codes[l * cg + j] = (uint8_t)((in[j] >> (l * bits)) & mask);
    } else {
        int g = 8, w = bits;
        long cg = CHUNK / g;
        for (long j = 0; j < cg; j++) {
            uint64_t word = 0;
            for (int q = 0; q < w; q++)
                word |= (uint64_t)in[q * cg + j] << (8 * q);
            for (int l = 0; l < g; l++)
                codes[l * cg + j] = (uint8_t)((word >> (l * bits)) & mask);
        }
    }
}

/* The per-bits bodies are inlined into one function per width so that the compiler sees the
 * constants of the layout and of the level comparisons. */
/* Rows taken at a time: their rotations and scales first, then their codes, so that one row's chain of
 * dependent steps (the sums, the square root, the division) overlaps the next row's work. */
#define GROUP_VALUES 2048
#define MAX_GROUP 64

static inline INLINE int encode_body(const float *x, const float *signs, long rows, long d, long width, long block,
                              float inv_sqrt, const float *mids, int bits, int mant, int emin, double top,
                              long start, long stop, long full, uint8_t *out, float *scales, uint8_t *tail) {
    long wpad = (width + V - 1) / V * V, g = width >= GROUP_VALUES ? 1 : GROUP_VALUES / width;
    g = g > MAX_GROUP ? MAX_GROUP : g;
    float *y = aligned_alloc(64, g * wpad * sizeof(float)), scl[MAX_GROUP];
    long half = (width + 1) / 2;
    double *s64 = malloc(g * half * sizeof(double));
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
                rotate_row(x + r * d, signs, &tl, (rows - r) * d, width, block, inv_sqrt, yr);
            else
                memcpy(yr, x + r * d, d * sizeof(float));
            squares(yr, width, s64 + i * half);
        }
        fold(s64, half, nr, half);
        for (long i = 0; i < nr; i++) { /* levels.row_rms, rounded up to the scale dtype */
            float s = ceil_meta((float)sqrt(s64[i * half] / (double)width), mant, emin, top);
            if (!(s < INFINITY)) { /* inf/NaN in the row, or a scale overflowing the scale dtype */
                bad = 1;
                goto done;
            }
            if ((r0 + i) * width >= start)
                scales[r0 + i] = s;
            scl[i] = s > 0 ? s : 1.0f;
        }
        for (long i = 0; i < nr; i++)
            row_codes(y + i * wpad, width, scl[i], mv, mids, bits, rc + i * width);
        /* the codes at positions [max(p0, start), min(p1, stop)) to their chunk, or to the tail */
        long p0 = r0 * width, p1 = (r0 + nr) * width;
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

/* Encode the codes at positions [start, stop) of the stream of rows * width codes (start a multiple
 * of CHUNK): chunks below `full` packed into `out`, codes from `full` on into `tail` (one byte each);
 * rows that start in [start, stop) get their scale. signs: NULL for no rotation (width == block == d).
 * Returns 0, 1 if a row holds inf/NaN or its scale overflows the scale dtype, 2 if out of memory. */
CLONES int dgpipe_encode_rows(const float *x, const float *signs, long rows, long d, long width, long block,
                              float inv_sqrt, const float *mids, int bits, int mant, int emin, double top,
                              long start, long stop, long full, uint8_t *out, float *scales, uint8_t *tail) {
    switch (bits) {
    case 1: return encode_body(x, signs, rows, d, width, block, inv_sqrt, mids, 1, mant, emin, top, start, stop, full, out, scales, tail);
    case 2: return encode_body(x, signs, rows, d, width, block, inv_sqrt, mids, 2, mant, emin, top, start, stop, full, out, scales, tail);
    case 3: return encode_body(x, signs, rows, d, width, block, inv_sqrt, mids, 3, mant, emin, top, start, stop, full, out, scales, tail);
    case 4: return encode_body(x, signs, rows, d, width, block, inv_sqrt, mids, 4, mant, emin, top, start, stop, full, out, scales, tail);
    default: return 3;
    }
}

static inline INLINE void widen(int32_t *to, const uint8_t *from, long n) {
    for (long i = 0; i < n; i++)
        to[i] = from[i];
}

static inline INLINE int decode_body(const uint8_t *packed, int bits, const float *table, const float *scales, long d,
                              long width, long block, float inv_sqrt, const float *signs, const uint8_t *tail,
                              long full, long r0, long r1, float *out) {
    float *y = aligned_alloc(64, ((width + V - 1) / V * V) * sizeof(float));
    int32_t *rc = malloc(width * sizeof(int32_t)); /* the row's codes */
    uint8_t *chunk = malloc(CHUNK);
    if (!y || !rc || !chunk) {
        free(y);
        free(rc);
        free(chunk);
        return 2;
    }
    long chunk_bytes = (long)CHUNK * bits / 8, have = -1; /* the chunk unpacked in `chunk` */
    float lv[V] = {0};
    memcpy(lv, table, sizeof(float) << bits);
    vf levels = load(lv);
    for (long r = r0; r < r1; r++) {
        long p0 = r * width, p1 = p0 + width;
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
        vf s = (vf){} + scales[r];
        long j = 0;
        for (; j + V <= width; j += V) {
            vi idx;
            memcpy(&idx, rc + j, sizeof idx);
            vf v = __builtin_shuffle(levels, idx) * s;
            store(y + j, signs && block >= V ? short_strides(v) : v);
        }
        for (; j < width; j++)
            y[j] = table[rc[j]] * scales[r];
        float *o = out + r * d;
        if (signs) {
            unrotate_row(y, width, block, inv_sqrt, signs, d, o);
        } else {
            memcpy(o, y, d * sizeof(float));
        }
    }
    free(y);
    free(rc);
    free(chunk);
    return 0;
}

/* Decode rows [r0, r1): out[r * d + k] for k < d. tail: the codes from position `full` on, one byte
 * each. Returns 0, or 2 if out of memory. */
CLONES int dgpipe_decode_rows(const uint8_t *packed, int bits, const float *table, const float *scales, long d,
                              long width, long block, float inv_sqrt, const float *signs, const uint8_t *tail,
                              long full, long r0, long r1, float *out) {
    switch (bits) {
    case 1: return decode_body(packed, 1, table, scales, d, width, block, inv_sqrt, signs, tail, full, r0, r1, out);
    case 2: return decode_body(packed, 2, table, scales, d, width, block, inv_sqrt, signs, tail, full, r0, r1, out);
    case 3: return decode_body(packed, 3, table, scales, d, width, block, inv_sqrt, signs, tail, full, r0, r1, out);
    case 4: return decode_body(packed, 4, table, scales, d, width, block, inv_sqrt, signs, tail, full, r0, r1, out);
    default: return 3;
    }
}
