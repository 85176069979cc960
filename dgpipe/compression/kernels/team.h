/*
 * A kernel's parts run on torch's own OpenMP threads (rows.c, codes.c).
 *
 * A kernel over p1 - p0 units (chunks of codes, or rows) is cut into `parts` ranges [p0 + span * k / parts,
 * p0 + span * (k + 1) / parts), the ones the Python side would cut (backend.team). `threads` threads take them
 * in turn from a shared counter, so that a thread slowed by another one on its core takes fewer; the parts are
 * disjoint, so the result does not depend on who took which. The threads are the team of the OpenMP runtime
 * torch runs its intra-op work on, entered through GOMP_parallel -- the entry point GCC's libgomp defines and
 * LLVM's libomp also exports -- whose address backend.py finds in the process and hands to each library
 * (dgpipe_use_team): the workers torch's own parallel ops use, not a pool beside them. Without it (torch
 * built with another thread pool) the parts run on the calling thread. No compiler OpenMP support is needed.
 *
 * The entry points of a ranged kernel are made from an X-list of its fields (RANGED): the arguments before
 * its range, as `X(type, name)`; its body takes them, then the range. Builds with GCC 11+ and clang 14+.
 */
#ifndef DGPIPE_TEAM_H
#define DGPIPE_TEAM_H

typedef void (*team_start)(void (*body)(void *), void *data, unsigned threads, unsigned flags);

/* GOMP_parallel of the runtime torch runs on, or NULL (the calling thread alone). */
static team_start team_parallel;

/* Part k, units [p0, p1), of a kernel on its arguments: 0 done, else the kernel's error code. */
typedef int (*team_part)(const void *args, long k, long p0, long p1);

struct team_job {
    team_part part;
    const void *args;
    long p0, p1, parts;
    long next; /* the next part to hand out */
    int rc;    /* the largest error code of a part */
};

static void team_drain(void *data) {
    struct team_job *job = data;
    const long span = job->p1 - job->p0;
    for (;;) {
        const long k = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (k >= job->parts)
            return;
        const int rc = job->part(job->args, k, job->p0 + span * k / job->parts,
                                 job->p0 + span * (k + 1) / job->parts);
        int seen = __atomic_load_n(&job->rc, __ATOMIC_RELAXED);
        while (rc > seen && !__atomic_compare_exchange_n(&job->rc, &seen, rc, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            ;
    }
}

/* Run `part` on `parts` ranges of [p0, p1) with up to `threads` threads; the largest error code, or 0. */
static int team_run(team_part part, const void *args, long p0, long p1, long parts, int threads) {
    struct team_job job = {part, args, p0, p1, parts > 1 ? parts : 1, 0, 0};
    if (threads > 1 && job.parts > 1 && team_parallel)
        team_parallel(team_drain, &job, (unsigned)(threads < job.parts ? threads : job.parts), 0);
    else
        team_drain(&job);
    return job.rc;
}

/* Each library's setter: the runtime's GOMP_parallel, or NULL for none. */
#define TEAM_ENTRY \
    void dgpipe_use_team(void *parallel) { team_parallel = (team_start)parallel; }

/* X-list helpers: a struct field, a parameter, an argument, the argument from a struct `a`. */
#define TEAM_FIELD(type, name) type name;
#define TEAM_PARAM(type, name) type name,
#define TEAM_ARG(type, name) name,
#define TEAM_MEMBER(type, name) a->name,

/* The entry point dgpipe_<name>(fields..., long p0, long p1, long parts, int threads) of a kernel whose body
 * `name` (or its variants, through PICK) takes (fields..., long p0, long p1). */
#define RANGED(name, FIELDS)                                                                                  \
    struct name##_args { FIELDS(TEAM_FIELD) };                                                                \
    static int name##_part(const void *data, long k, long p0, long p1) {                                       \
        const struct name##_args *a = data;                                                                    \
        (void)k;                                                                                               \
        return PICK(name, (FIELDS(TEAM_MEMBER) p0, p1));                                                       \
    }                                                                                                          \
    int dgpipe_##name(FIELDS(TEAM_PARAM) long p0, long p1, long parts, int threads) {                         \
        const struct name##_args a = {FIELDS(TEAM_ARG)};                                                       \
        return team_run(name##_part, &a, p0, p1, parts, threads);                                              \
    }

#endif
