/*
 * The vectors of the row kernels (rows.c): 16 floats in GCC's vector extensions (which clang shares), and
 * the operations whose spelling differs between compilers or whose lowering differs between instruction
 * sets -- loads and stores, broadcasts, narrowing to bytes, lane permutations with constant lanes
 * (SHUFFLE) or lanes chosen at run time (lookup) -- each whole or in halves of 8 lanes (`wide`, below).
 * Builds with GCC 11+ and clang 14+, on x86-64 and aarch64.
 */
#ifndef DGPIPE_VECTORS_H
#define DGPIPE_VECTORS_H

#include <stdint.h>
#include <string.h>

#include "variants.h"

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

#endif
