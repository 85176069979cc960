/*
 * The per-value codec steps in compiled C (see compiled.py): values read once, packed codes written once.
 *
 * Each entry point takes a run of whole chunks [c0, c1) of CHUNK codes (the caller packs the n % CHUNK tail)
 * of the packed layout of bitpack.py (layout.h) and runs the same float32 operations, in the same order,
 * as the reference steps (uniform.py, buckets.py, levels.py, fwht.py), so payloads and decoded values are
 * bit for bit theirs (golden payloads). Built with -ffp-contract=off: a fused multiply-add would round a
 * decode's `lo + code * step` once where the reference rounds twice. Codes are integers (uint16, at most 16
 * bits); the code width and the bucket count are constants inside each specialised body (a switch over
 * always_inline functions), so the lane and plane loops unroll and the value loops vectorise.
 *
 * - encode_uniform / decode_uniform: clamp(rint((x - lo[g]) / div[g]), 0, 2**bits - 1) per group g of
 *   group_len values, and lo[g] + code * step[g];
 * - encode_buckets / decode_buckets: sort quantization's bucket * 2**Q + level, the bucket being the number
 *   of boundaries <= x (S <= 4 split bits), and mins[b] + level * step[b];
 * - encode_levels / decode_levels: the codebook's nearest level, the number of midpoints < x (bits <= 4),
 *   and table[code] * scale[g];
 * - fwht: the Walsh-Hadamard butterflies of each row, in place, then the orthonormal factor;
 * - sort_sample: an LSD radix sort of float32 keys (three passes of 11-bit digits; sample_sort.h);
 * - bucket_extrema: the min and each bucket's max in one pass; value_range: the same without boundaries, the
 *   min and the max (a uniform grid's range);
 * - sampled_grid / uniform_message / message_values: a small message's grid and codes, or its values, in one
 *   call (a call after a stage's compute has evicted the caches costs 15-25 us).
 *
 * x86-64: AVX-512, AVX2 and baseline variants of each entry point (variants.h). Builds with GCC 11+ and
 * clang 14+, on x86-64 and aarch64. References: the radix sort is the textbook LSD radix sort of IEEE-754
 * keys (Knuth, TAOCP vol. 3, 5.2.5); the fast Walsh-Hadamard transform: Fino and Algazi, IEEE Trans.
 * Computers 1976.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layout.h"
#include "sample_sort.h"
#include "team.h"
#include "variants.h"

#define MAX_SPLIT 4 /* split bits of the bucket kernels (16 buckets) */

static inline INLINE long min_l(long a, long b) { return a < b ? a : b; }

/* a where take (0 or 1), else b, with no branch: GCC vectorises the selects of a loop over buckets in this
 * integer form (a conditional it may turn into a branch), clang in the conditional form. */
static inline INLINE float pick(int take, float a, float b) {
#if defined(__clang__)
    return take ? a : b;
#else
    uint32_t ua, ub;
    memcpy(&ua, &a, 4);
    memcpy(&ub, &b, 4);
    const uint32_t mask = -(uint32_t)take, r = (ua & mask) | (ub & ~mask);
    float f;
    memcpy(&f, &r, 4);
    return f;
#endif
}

/* A small table (boundaries, minima, levels) copied into a local array: read from there, GCC vectorises the
 * loops that pick from it (from the caller's pointer it does not). */
static inline INLINE void copy_table(const float *from, int n, float *to) {
    for (int j = 0; j < n; j++)
        to[j] = from[j];
}

/* ---- uniform grids, per run of group_len values ---------------------------------------------------- */

/* Codes clamp(rint((x - a) / d), 0, top) of x[t0, t1) into codes[t0, t1). */
static inline INLINE void grid_codes(const float *x, float a, float d, float top, int t0, int t1, uint16_t *codes) {
    for (int t = t0; t < t1; t++) {
        float v = rintf((x[t] - a) / d);
        v = v > 0.0f ? v : 0.0f;
        codes[t] = (uint16_t)(v < top ? v : top);
    }
}

static inline INLINE int encode_uniform(const float *x, const float *lo, const float *div, long group_len, long n,
                                        int bits, uint8_t *out, long c0, long c1) {
    uint16_t codes[CHUNK];
    if (bits < 1 || bits > 16)
        return 1;
    const float top = (float)((1 << bits) - 1);
    for (long c = c0; c < c1; c++) {
        const long i0 = c * CHUNK;
        for (int t = 0; t < CHUNK;) { /* runs of one group inside the chunk */
            const long grp = (i0 + t) / group_len;
            const int stop = (int)min_l(CHUNK, (grp + 1) * group_len - i0);
            grid_codes(x + i0, lo[grp], div[grp], top, t, stop, codes);
            t = stop;
        }
        pack_any(codes, bits, out, n, c);
    }
    return 0;
}

static inline INLINE int decode_uniform(const uint8_t *packed, int bits, const float *lo, const float *step,
                                        long group_len, long n, float *y, long c0, long c1) {
    uint16_t codes[CHUNK];
    if (bits < 1 || bits > 16)
        return 1;
    for (long c = c0; c < c1; c++) {
        unpack_any(packed, bits, n, c, codes);
        const long i0 = c * CHUNK;
        for (int t = 0; t < CHUNK;) {
            const long grp = (i0 + t) / group_len;
            const int stop = (int)min_l(CHUNK, (grp + 1) * group_len - i0);
            const float a = lo[grp], s = step[grp];
            for (int u = t; u < stop; u++)
                y[i0 + u] = a + (float)codes[u] * s;
            t = stop;
        }
    }
    return 0;
}

/* ---- sort quantization's buckets ---------------------------------------------------------------------- */

/* A body specialised on the split bits: `BODY(s)` for s 1..4 (a constant in each case). */
#define EACH_SPLIT(split_bits, BODY)                                                                         \
    switch (split_bits) {                                                                                    \
    case 1: BODY(1); break;  case 2: BODY(2); break;  case 3: BODY(3); break;  case 4: BODY(4); break;      \
    default: return 1;                                                                                       \
    }

static inline INLINE void encode_buckets_w(const float *x, const float *bounds, const float *mins, const float *div,
                                           int quant_bits, int split_bits, long n, long c0, long c1,
                                           uint8_t *out) {
    uint16_t codes[CHUNK];
    const int nb = (1 << split_bits) - 1;
    const float top = (float)((1 << quant_bits) - 1);
    float bound[1 << MAX_SPLIT], min[1 << MAX_SPLIT], dv[1 << MAX_SPLIT]; /* in locals: GCC vectorises then */
    copy_table(bounds, nb, bound);
    copy_table(mins, nb + 1, min);
    copy_table(div, nb + 1, dv);
    for (long c = c0; c < c1; c++) {
        const float *xs = x + c * CHUNK;
        for (int t = 0; t < CHUNK; t++) {
            const float v = xs[t];
            float m = min[0], d = dv[0];
            int b = 0;
            for (int j = 0; j < nb; j++) { /* the boundaries are non-decreasing: the last one <= v wins */
                const int above = v >= bound[j];
                m = pick(above, min[j + 1], m);
                d = pick(above, dv[j + 1], d);
                b += above;
            }
            float q = rintf((v - m) / d);
            q = q > 0.0f ? q : 0.0f;
            codes[t] = (uint16_t)((int)(q < top ? q : top) + (b << quant_bits));
        }
        pack_any(codes, quant_bits + split_bits, out, n, c);
    }
}

static inline INLINE int encode_buckets(const float *x, const float *bounds, const float *mins, const float *div,
                                        int quant_bits, int split_bits, long n, uint8_t *out, long c0, long c1) {
    if (quant_bits < 1 || quant_bits + split_bits > 16)
        return 1;
#define BODY(s) encode_buckets_w(x, bounds, mins, div, quant_bits, s, n, c0, c1, out)
    EACH_SPLIT(split_bits, BODY)
#undef BODY
    return 0;
}

static inline INLINE void decode_buckets_w(const uint8_t *packed, int quant_bits, int split_bits, const float *mins,
                                           const float *step, long n, long c0, long c1, float *y) {
    uint16_t codes[CHUNK];
    const int nb = 1 << split_bits, mask = (1 << quant_bits) - 1;
    float min[1 << MAX_SPLIT], st[1 << MAX_SPLIT];
    copy_table(mins, nb, min);
    copy_table(step, nb, st);
    for (long c = c0; c < c1; c++) {
        unpack_any(packed, quant_bits + split_bits, n, c, codes);
        float *ys = y + c * CHUNK;
        for (int t = 0; t < CHUNK; t++) {
            const int32_t code = codes[t], b = code >> quant_bits;
            float m = min[0], s = st[0];
            for (int j = 1; j < nb; j++) { /* min[b] and st[b] by selects: gathers are slower */
                m = pick(b >= j, min[j], m);
                s = pick(b >= j, st[j], s);
            }
            ys[t] = m + (float)(code & mask) * s;
        }
    }
}

static inline INLINE int decode_buckets(const uint8_t *packed, int quant_bits, int split_bits, const float *mins,
                                        const float *step, long n, float *y, long c0, long c1) {
    if (quant_bits < 1 || quant_bits + split_bits > 16)
        return 1;
#define BODY(s) decode_buckets_w(packed, quant_bits, s, mins, step, n, c0, c1, y)
    EACH_SPLIT(split_bits, BODY)
#undef BODY
    return 0;
}

/* ---- codebook levels ----------------------------------------------------------------------------------- */

static inline INLINE void encode_levels_w(const float *v, const float *mids, int bits, long n, long c0, long c1,
                                          uint8_t *out) {
    uint16_t codes[CHUNK];
    const int nm = (1 << bits) - 1;
    float mid[15];
    copy_table(mids, nm, mid);
    for (long c = c0; c < c1; c++) {
        const float *vs = v + c * CHUNK;
        for (int t = 0; t < CHUNK; t++) {
            int k = 0;
            for (int j = 0; j < nm; j++)
                k += vs[t] > mid[j]; /* torch.bucketize(v, mids): the midpoints below v */
            codes[t] = (uint16_t)k;
        }
        pack_chunk(codes, bits, out, n, c);
    }
}

static inline INLINE int encode_levels(const float *v, const float *mids, int bits, long n, uint8_t *out, long c0,
                                       long c1) {
    switch (bits) {
    case 1: encode_levels_w(v, mids, 1, n, c0, c1, out); break;
    case 2: encode_levels_w(v, mids, 2, n, c0, c1, out); break;
    case 3: encode_levels_w(v, mids, 3, n, c0, c1, out); break;
    case 4: encode_levels_w(v, mids, 4, n, c0, c1, out); break;
    default: return 1;
    }
    return 0;
}

static inline INLINE void decode_levels_w(const uint8_t *packed, int bits, const float *table, const float *scale,
                                          long group_len, long n, long c0, long c1, float *y) {
    uint16_t codes[CHUNK];
    float level[16];
    copy_table(table, 1 << bits, level);
    for (long c = c0; c < c1; c++) {
        unpack_chunk(packed, bits, n, c, codes);
        const long i0 = c * CHUNK;
        for (int t = 0; t < CHUNK;) {
            const long grp = (i0 + t) / group_len;
            const int stop = (int)min_l(CHUNK, (grp + 1) * group_len - i0);
            const float s = scale[grp];
            for (int u = t; u < stop; u++) {
                const int32_t code = codes[u];
                float v = level[0];
                for (int j = 1; j < 1 << bits; j++) /* level[code] by selects (see decode_buckets) */
                    v = pick(code >= j, level[j], v);
                y[i0 + u] = v * s;
            }
            t = stop;
        }
    }
}

static inline INLINE int decode_levels(const uint8_t *packed, int bits, const float *table, const float *scale,
                                       long group_len, long n, float *y, long c0, long c1) {
    switch (bits) {
    case 1: decode_levels_w(packed, 1, table, scale, group_len, n, c0, c1, y); break;
    case 2: decode_levels_w(packed, 2, table, scale, group_len, n, c0, c1, y); break;
    case 3: decode_levels_w(packed, 3, table, scale, group_len, n, c0, c1, y); break;
    case 4: decode_levels_w(packed, 4, table, scale, group_len, n, c0, c1, y); break;
    default: return 1;
    }
    return 0;
}

/* ---- the Walsh-Hadamard transform ------------------------------------------------------------------------ */

/* In place, rows [r0, r1) of b values: the butterflies of fwht.py in the same order, then the factor. */
static inline INLINE int fwht(float *y, long b, float scale, long r0, long r1) {
    for (long r = r0; r < r1; r++) {
        float *row = y + r * b;
        for (long h = 1; h < b; h *= 2)
            for (long i = 0; i < b; i += 2 * h)
                for (long j = i; j < i + h; j++) {
                    const float a = row[j], c = row[j + h];
                    row[j] = a + c;
                    row[j + h] = a - c;
                }
        for (long j = 0; j < b; j++)
            row[j] *= scale;
    }
    return 0;
}

/* ---- the min and the per-bucket maxima ------------------------------------------------------------------------ */

/* Running minima and maxima per lane, kept in vector registers: 32 lanes (two independent chains of maxima on
 * AVX-512, which a pass with one or no boundary needs to keep up with memory), 16 with more boundaries (their
 * chains run side by side already; 32 would not fit the registers). */
#define EXTREMA_LANES(split_bits) ((split_bits) < 2 ? 32 : 16)

/* ext (nb + 2 floats) = [min of x, then for each boundary b < nb the max of the values below it (-inf: none), then
 * the max of x], n >= 1. Bucket b < nb's max is the max of the values below boundary b where the bucket holds any
 * (those of the buckets below are smaller than its min), else below its min, and the top bucket's is the max of x:
 * so a pass that only reads, a compare and a masked max per boundary and value, gives every bucket's max. With no
 * boundary (split_bits 0) it is a uniform grid's range, [min, max]. The min and the max of x are NaN where x holds
 * a NaN (the other maxima skip it); zeros as found. */
static inline INLINE void bucket_extrema_s(const float *x, long n, const float *bounds, int split_bits, float *ext) {
    const int nb = (1 << split_bits) - 1, lanes = EXTREMA_LANES(split_bits);
    float bound[1 << MAX_SPLIT], lo[EXTREMA_LANES(0)], hi[1 << MAX_SPLIT][EXTREMA_LANES(0)];
    int32_t nan[EXTREMA_LANES(0)];
    copy_table(bounds, nb, bound);
    for (int t = 0; t < lanes; t++) {
        lo[t] = x[0];
        nan[t] = 0;
        for (int b = 0; b <= nb; b++)
            hi[b][t] = -INFINITY;
    }
    long i = 0;
    for (; i + lanes <= n; i += lanes)
        for (int t = 0; t < lanes; t++) {
            const float v = x[i + t];
            for (int j = 0; j < nb; j++) {
                const float h = v > hi[j][t] ? v : hi[j][t];
                hi[j][t] = v < bound[j] ? h : hi[j][t];
            }
            hi[nb][t] = v > hi[nb][t] ? v : hi[nb][t];
            lo[t] = v < lo[t] ? v : lo[t];
            nan[t] |= v != v;
        }
    for (; i < n; i++) { /* the tail, into lane 0 */
        const float v = x[i];
        for (int j = 0; j < nb; j++)
            hi[j][0] = v < bound[j] && v > hi[j][0] ? v : hi[j][0];
        hi[nb][0] = v > hi[nb][0] ? v : hi[nb][0];
        lo[0] = v < lo[0] ? v : lo[0];
        nan[0] |= v != v;
    }
    for (int t = 1; t < lanes; t++) {
        lo[0] = lo[t] < lo[0] ? lo[t] : lo[0];
        nan[0] |= nan[t];
        for (int b = 0; b <= nb; b++)
            hi[b][0] = hi[b][t] > hi[b][0] ? hi[b][t] : hi[b][0];
    }
    for (int b = 0; b <= nb; b++)
        ext[1 + b] = hi[b][0];
    ext[0] = nan[0] ? NAN : lo[0];
    ext[nb + 1] = nan[0] ? NAN : hi[nb][0];
}

static inline INLINE int bucket_extrema(const float *x, long n, const float *bounds, int split_bits, float *ext) {
    if (split_bits == 0) { /* the range alone */
        bucket_extrema_s(x, n, bounds, 0, ext);
        return 0;
    }
#define BODY(s) bucket_extrema_s(x, n, bounds, s, ext)
    EACH_SPLIT(split_bits, BODY)
#undef BODY
    return 0;
}

/* ---- a small message in one call ---------------------------------------------------------------------------- */

/* Sort quantization's grid of a sampled split -- the sample's sort, its boundaries, the extrema, the steps --
 * and, where the range is finite, the codes of chunks [0, chunks): the steps of buckets.py in one call.
 * grid: float32 (4, 2**S): rows mins, step, divisor, and the min and max of x in row 3's first two entries.
 * sample: m floats of scratch. */
static inline INLINE int sampled_grid(const float *x, long n, const int64_t *pos, long m, const int64_t *ranks,
                                      int split_bits, int quant_bits, float *sample, float *grid, long chunks,
                                      uint8_t *out) {
    const int nb = (1 << split_bits) - 1, w = nb + 1;
    const float steps = (float)((1 << quant_bits) - 1), half_max = 0x1p127f;
    float bounds[1 << MAX_SPLIT], ext[(1 << MAX_SPLIT) + 2];
    if (split_bits < 1 || split_bits > MAX_SPLIT)
        return 1;
    const int rc = sort_sample(x, pos, m, sample);
    if (rc)
        return rc;
    for (int j = 0; j < nb; j++) {
        bounds[j] = sample[ranks[j]] + 0.0f; /* a zero as +0.0 */
        grid[j + 1] = bounds[j];
    }
    bucket_extrema(x, n, bounds, split_bits, ext);
    grid[0] = ext[0] + 0.0f; /* the min, a zero as +0.0 */
    grid[3 * w] = ext[0];    /* the range, for the caller's check */
    grid[3 * w + 1] = ext[nb + 1];
    for (int j = 0; j <= nb; j++) {
        const float top = (ext[1 + j] > grid[j] ? ext[1 + j] : grid[j]) + 0.0f;
        const float step = (top - grid[j]) / steps;
        grid[w + j] = step;
        grid[2 * w + j] = step > 0.0f ? step : 1.0f;
    }
    if (fabsf(ext[0]) < half_max && fabsf(ext[nb + 1]) < half_max) /* else the caller raises (NaN fails too) */
        return encode_buckets(x, grid + 1, grid, grid + 2 * w, quant_bits, split_bits, n, out, 0, chunks);
    return 0;
}

/* Per-tensor uniform quantization of chunks [0, n / CHUNK): meta = [lo, step], step = (hi - lo) / (2**bits -
 * 1) in float32 as steps/grid.py computes it, and the codes. */
static inline INLINE int uniform_message(const float *x, long n, float lo, float hi, int bits, float *meta,
                                         uint8_t *out) {
    const float step = (hi - lo) / (float)((1 << bits) - 1), div = step > 0.0f ? step : 1.0f;
    meta[0] = lo;
    meta[1] = step;
    return encode_uniform(x, meta, &div, n, n, bits, out, 0, n / CHUNK);
}

/* The values of a one-group message of n codes (whole chunks): sort quantization's with split_bits >= 1,
 * meta = cat(mins, step); uniform quantization's with split_bits = 0, meta = [lo, step]. */
static inline INLINE int message_values(const uint8_t *packed, int quant_bits, int split_bits, const float *meta,
                                        long n, float *y) {
    if (!split_bits)
        return decode_uniform(packed, quant_bits, meta, meta + 1, n, n, y, 0, n / CHUNK);
    return decode_buckets(packed, quant_bits, split_bits, meta, meta + (1 << split_bits), n, y, 0, n / CHUNK);
}

/* ---- the exported entry points: 0 done, 1 not specialised for these widths, 2 out of memory ------------------ */

/* name##_avx512, name##_avx2 and name##_baseline: `name` (a body) compiled for each instruction set. */
#if VARIANTS
#define VARIANTS_OF(name, params, args)                                             \
    TARGET_AVX512 static int name##_avx512 params { return name args; }             \
    TARGET_AVX2 static int name##_avx2 params { return name args; }                 \
    static int name##_baseline params { return name args; }
#else
#define VARIANTS_OF(name, params, args)
#endif

/* dgpipe_<name>(params): one call on the calling thread. */
#define EXPORT(name, params, args) \
    VARIANTS_OF(name, params, args) \
    int dgpipe_##name params { return PICK(name, args); }

/* dgpipe_<name>(fields..., long p0, long p1, long parts, int threads): units [p0, p1) in parts (team.h). */
#define EXPORT_RANGED(name, FIELDS) \
    VARIANTS_OF(name, (FIELDS(TEAM_PARAM) long p0, long p1), (FIELDS(TEAM_ARG) p0, p1)) \
    RANGED(name, FIELDS)

TEAM_ENTRY

/* chunks [p0, p1) */
#define ENCODE_UNIFORM(X) X(const float *, x) X(const float *, lo) X(const float *, div) X(long, group_len) \
    X(long, n) X(int, bits) X(uint8_t *, out)
#define DECODE_UNIFORM(X) X(const uint8_t *, packed) X(int, bits) X(const float *, lo) X(const float *, step) \
    X(long, group_len) X(long, n) X(float *, y)
#define ENCODE_BUCKETS(X) X(const float *, x) X(const float *, bounds) X(const float *, mins) X(const float *, div) \
    X(int, quant_bits) X(int, split_bits) X(long, n) X(uint8_t *, out)
#define DECODE_BUCKETS(X) X(const uint8_t *, packed) X(int, quant_bits) X(int, split_bits) X(const float *, mins) \
    X(const float *, step) X(long, n) X(float *, y)
#define ENCODE_LEVELS(X) X(const float *, v) X(const float *, mids) X(int, bits) X(long, n) X(uint8_t *, out)
#define DECODE_LEVELS(X) X(const uint8_t *, packed) X(int, bits) X(const float *, table) X(const float *, scale) \
    X(long, group_len) X(long, n) X(float *, y)
/* rows [p0, p1) */
#define FWHT(X) X(float *, y) X(long, b) X(float, scale)

EXPORT_RANGED(encode_uniform, ENCODE_UNIFORM)
EXPORT_RANGED(decode_uniform, DECODE_UNIFORM)
EXPORT_RANGED(encode_buckets, ENCODE_BUCKETS)
EXPORT_RANGED(decode_buckets, DECODE_BUCKETS)
EXPORT_RANGED(encode_levels, ENCODE_LEVELS)
EXPORT_RANGED(decode_levels, DECODE_LEVELS)
EXPORT_RANGED(fwht, FWHT)
EXPORT(sort_sample, (const float *x, const int64_t *pos, long m, float *out), (x, pos, m, out))

/* The min and the bucket maxima of x in parts of whole chunks (the last part takes the n % CHUNK tail), part k's
 * in row k of ext (2**S + 1 floats a row). */
VARIANTS_OF(bucket_extrema, (const float *x, long n, const float *bounds, int split_bits, float *ext),
            (x, n, bounds, split_bits, ext))
#define BUCKET_EXTREMA(X) X(const float *, x) X(long, n) X(const float *, bounds) X(int, split_bits) X(float *, ext)
struct bucket_extrema_args { BUCKET_EXTREMA(TEAM_FIELD) };

static int bucket_extrema_part(const void *data, long k, long c0, long c1) {
    const struct bucket_extrema_args *a = data;
    const long i0 = c0 * CHUNK, i1 = c1 == a->n / CHUNK ? a->n : c1 * CHUNK;
    float *ext = a->ext + k * ((1 << a->split_bits) + 1);
    return PICK(bucket_extrema, (a->x + i0, i1 - i0, a->bounds, a->split_bits, ext));
}

int dgpipe_bucket_extrema(BUCKET_EXTREMA(TEAM_PARAM) long parts, int threads) {
    const struct bucket_extrema_args a = {BUCKET_EXTREMA(TEAM_ARG)};
    return team_run(bucket_extrema_part, &a, 0, n / CHUNK, parts, threads);
}

/* The min and the max of x (no boundary), part k's in ext[2k], ext[2k + 1]. */
int dgpipe_value_range(const float *x, long n, float *ext, long parts, int threads) {
    const struct bucket_extrema_args a = {x, n, NULL, 0, ext};
    return team_run(bucket_extrema_part, &a, 0, n / CHUNK, parts, threads);
}

EXPORT(sampled_grid, (const float *x, long n, const int64_t *pos, long m, const int64_t *ranks, int split_bits,
                      int quant_bits, float *sample, float *grid, long chunks, uint8_t *out),
       (x, n, pos, m, ranks, split_bits, quant_bits, sample, grid, chunks, out))
EXPORT(uniform_message, (const float *x, long n, float lo, float hi, int bits, float *meta, uint8_t *out),
       (x, n, lo, hi, bits, meta, out))
EXPORT(message_values, (const uint8_t *packed, int quant_bits, int split_bits, const float *meta, long n,
                        float *y),
       (packed, quant_bits, split_bits, meta, n, y))
