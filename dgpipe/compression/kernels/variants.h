/*
 * Instruction-set variants of dgpipe's compiled kernels (rows.c, codes.c).
 *
 * x86-64: each entry point is built as AVX-512, AVX2 and baseline variants (target attributes; the helpers
 * are always_inline, so that they are compiled inside each) and PICK runs the one of the CPU's features
 * (__builtin_cpu_init: the feature bits read once, whichever library's constructors have run). GCC 11 takes
 * single ISA names only in a target attribute (no "arch=x86-64-vN"), so its variants are AVX-512F and AVX2
 * without FMA -- the same bytes, the kernels being built so that a fused multiply-add changes nothing (see
 * each file's head). -DDGPIPE_ROWS_ONE_TARGET, and every other machine (aarch64: NEON): one build for the
 * target. Builds with GCC 11+ and clang 14+.
 */
#ifndef DGPIPE_VARIANTS_H
#define DGPIPE_VARIANTS_H

#define INLINE __attribute__((always_inline))

#if defined(__x86_64__) && !defined(DGPIPE_ROWS_ONE_TARGET)
#define VARIANTS 1
#if defined(__clang__) || __GNUC__ >= 12
#define TARGET_AVX512 __attribute__((target("arch=x86-64-v4")))
#define TARGET_AVX2 __attribute__((target("arch=x86-64-v3")))
#else
#define TARGET_AVX512 __attribute__((target("avx512f")))
#define TARGET_AVX2 __attribute__((target("avx2")))
#endif
/* name##_avx512, name##_avx2 or name##_baseline called on `args` (a parenthesised list), by the CPU's features */
#define PICK(name, args) \
    (__builtin_cpu_init(), __builtin_cpu_supports("avx512f") ? name##_avx512 args \
     : __builtin_cpu_supports("avx2") ? name##_avx2 args : name##_baseline args)
#else
#define VARIANTS 0
#define PICK(name, args) name args
#endif

#endif
