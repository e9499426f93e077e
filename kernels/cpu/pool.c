/* The decode path's thread pool (loom_par_for): a step's many small parallel loops (a SmolLM2
   token: 121 quantized matmuls of 10 us to 1.3 ms and 30 attention loops) without an OpenMP
   fork / join each.

   Why not `omp parallel for`: its implicit barrier waits for every thread of the team, also
   one that has not started yet. On a shared 2-core machine the second thread is often not
   running when a loop starts (its core busy with another process, or libgomp's worker asleep
   after GOMP_SPINCOUNT), and then the caller, having done its half, waits a wake-up or a
   scheduler slice at each of ~150 loops a token. Here the caller does not wait for helpers
   to arrive: the loop's chunks are claimed one at a time from a shared counter, by the
   caller and by whichever helpers are awake, and the caller waits only for chunks a helper
   has claimed and not yet finished. A helper that is late or asleep only helps less; with
   none awake the loop runs on the caller as on one thread.

   Results do not depend on who runs a chunk: every kernel that uses it computes each output
   element inside one item, so the bits are the same for any thread count (tests check 1 vs 2
   vs 3 threads bitwise).

   Helpers spin loom_pool_spin_ns after their last chunk (the gaps between a step's loops are a
   few microseconds), then sleep on a condition variable: an idle server burns no core.
   One caller at a time uses the pool (a mutex; a second concurrent caller runs its loop on its
   own thread). After a fork the child starts its own helpers (pool_child). */
#include "loom_cpu.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* 1 (default): loom_par_for runs on the pool; 0: on an OpenMP `parallel for` of static chunks
   (the previous behaviour; a knob for bench_decode_threads.py's A/B in one process) */
int loom_pool = 1;

/* 1 (default): a loop's last (threads x chunk) items are claimed in quarter chunks (at least 1
   item), so the thread that finds no chunk left waits for at most a quarter chunk of the
   other's, not a whole one (8 chunks over 2 threads: half a chunk, 1/8 of the loop, on
   average); 0: equal chunks (a knob for bench_decode_threads.py's A/B). Which thread runs an
   item does not change its bits. */
int loom_pool_tail = 1;
/* a helper's spin after its last chunk before it sleeps (ns): as long as libgomp's (loom sets
   GOMP_SPINCOUNT=1000, ~20 us), so that in a step mixing both (a prefill's OpenMP matmuls, the
   pool's attention) neither team's spinner holds the other's core for long; a knob for
   bench_decode_threads.py's A/B */
int64_t loom_pool_spin_ns = 20000;

#define POOL_MAX 64        /* helpers at most (threads - 1) */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The current job. Its fields are written by the caller between two increments of seq
   (odd while writing) and read by helpers as a seqlock, with job_gen naming the job they
   belong to. word = gen << 32 | the next chunk index: a claim is a compare-and-swap on it,
   so a helper holding a stale job's fields cannot claim a chunk of a newer job (its gen
   differs), and the caller rewrites the fields only after every chunk of the previous job
   is done (no claim of it can succeed any more: its index is past the end). */
#define LINE _Alignas(64) /* each group of fields on its own cache line: a helper spinning
                                on gen does not pull the line the caller is writing */
static struct {
    LINE _Atomic uint64_t word;
    LINE _Atomic int64_t done; /* chunks finished */
    LINE _Atomic uint32_t seq;
    _Atomic uint32_t job_gen;
    _Atomic(loom_task_fn) fn;
    _Atomic(void*) ctx;
    _Atomic int64_t n, chunk, nbig, tail; /* chunks 0 .. nbig-1 of `chunk` items, then of `tail` */
    _Atomic uint32_t nchunks;
    _Atomic int helpers; /* helpers 0 .. helpers-1 take part */
    LINE _Atomic uint32_t gen; /* the latest job (0: none yet) */
    _Atomic int sleepers;
    LINE int started; /* helpers running */
    pthread_mutex_t lock; /* helpers sleep on wake under lock */
    pthread_cond_t wake;
    pthread_mutex_t caller; /* one caller at a time */
} P = {.lock = PTHREAD_MUTEX_INITIALIZER,
       .wake = PTHREAD_COND_INITIALIZER,
       .caller = PTHREAD_MUTEX_INITIALIZER};

#define RELAXED memory_order_relaxed

/* claim and run chunks of job g (fields as read for it) until none is left */
static void run_chunks(uint32_t g, loom_task_fn fn, void* ctx, int64_t n, int64_t chunk,
                       int64_t nbig, int64_t tail, uint32_t nchunks, int worker) {
    for (;;) {
        uint64_t w = atomic_load(&P.word);
        if ((uint32_t)(w >> 32) != g || (uint32_t)w >= nchunks) return;
        if (!atomic_compare_exchange_weak(&P.word, &w, w + 1)) continue;
        const int64_t c = (int64_t)(uint32_t)w;
        const int64_t i0 = c < nbig ? c * chunk : nbig * chunk + (c - nbig) * tail;
        const int64_t i1 = i0 + (c < nbig ? chunk : tail) < n ? i0 + (c < nbig ? chunk : tail) : n;
        fn(ctx, i0, i1, worker);
        atomic_fetch_add(&P.done, 1);
    }
}

static void* helper_main(void* arg) {
    const int id = (int)(intptr_t)arg; /* worker index id + 1 (the caller is 0) */
    uint32_t seen = atomic_load(&P.gen);
    for (;;) {
        if (atomic_load(&P.gen) == seen) {
            const int64_t until = now_ns() + loom_pool_spin_ns;
            for (int spins = 0; atomic_load(&P.gen) == seen; spins++) {
                cpu_relax();
                if ((spins & 63) == 63 && now_ns() > until) {
                    pthread_mutex_lock(&P.lock);
                    atomic_fetch_add(&P.sleepers, 1);
                    while (atomic_load(&P.gen) == seen) pthread_cond_wait(&P.wake, &P.lock);
                    atomic_fetch_sub(&P.sleepers, 1);
                    pthread_mutex_unlock(&P.lock);
                    break;
                }
            }
        }
        const uint32_t g = atomic_load(&P.gen);
        seen = g;
        const uint32_t s1 = atomic_load_explicit(&P.seq, memory_order_acquire);
        if (s1 & 1) continue; /* being rewritten: a newer job follows */
        const uint32_t jg = atomic_load_explicit(&P.job_gen, RELAXED);
        loom_task_fn fn = atomic_load_explicit(&P.fn, RELAXED);
        void* ctx = atomic_load_explicit(&P.ctx, RELAXED);
        const int64_t n = atomic_load_explicit(&P.n, RELAXED);
        const int64_t chunk = atomic_load_explicit(&P.chunk, RELAXED);
        const int64_t nbig = atomic_load_explicit(&P.nbig, RELAXED);
        const int64_t tail = atomic_load_explicit(&P.tail, RELAXED);
        const uint32_t nchunks = atomic_load_explicit(&P.nchunks, RELAXED);
        const int helpers = atomic_load_explicit(&P.helpers, RELAXED);
        atomic_thread_fence(memory_order_acquire); /* the field loads before seq's re-read */
        if (atomic_load_explicit(&P.seq, RELAXED) != s1 || jg != g || id >= helpers) continue;
        run_chunks(g, fn, ctx, n, chunk, nbig, tail, nchunks, id + 1);
    }
    return NULL;
}

/* A forked child has none of the parent's helpers, and its copies of the mutexes and the
   condition variable may be held or waited on by threads that do not exist there: it starts
   with fresh ones and no helpers (pthread_atfork, registered at the first parallel loop). */
static void pool_child(void) {
    pthread_mutex_init(&P.lock, NULL);
    pthread_cond_init(&P.wake, NULL);
    pthread_mutex_init(&P.caller, NULL);
    atomic_store(&P.sleepers, 0);
    P.started = 0;
}
static void pool_register(void) { pthread_atfork(NULL, NULL, pool_child); }
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

/* helpers 0 .. want-1 running; returns how many are */
static int ensure_helpers(int want) {
    if (want > POOL_MAX) want = POOL_MAX;
    while (P.started < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &attr, helper_main, (void*)(intptr_t)P.started);
        pthread_attr_destroy(&attr);
        if (rc) break;
        P.started++;
    }
    return P.started;
}

void loom_par_for(int nthreads, int64_t n, int64_t chunk, loom_task_fn fn, void* ctx) {
    if (n <= 0) return;
    if (chunk < 1) chunk = 1;
    int64_t nchunks = (n + chunk - 1) / chunk;
    if (nthreads <= 1 || nchunks <= 1) {
        fn(ctx, 0, n, 0);
        return;
    }
    if (!loom_pool) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t c = 0; c < nchunks; c++) {
#ifdef _OPENMP
            const int worker = omp_get_thread_num();
#else
            const int worker = 0;
#endif
            fn(ctx, c * chunk, c * chunk + chunk < n ? c * chunk + chunk : n, worker);
        }
        return;
    }
    pthread_once(&pool_once, pool_register);
    if (nchunks > UINT32_MAX || pthread_mutex_trylock(&P.caller)) {
        fn(ctx, 0, n, 0); /* another caller holds the pool */
        return;
    }
    const int helpers = ensure_helpers(nthreads - 1);
    if (helpers < 1) {
        pthread_mutex_unlock(&P.caller);
        fn(ctx, 0, n, 0);
        return;
    }
    int64_t nbig = nchunks, tail = chunk;
    if (loom_pool_tail && chunk >= 4 && n > (int64_t)nthreads * chunk && nchunks < UINT32_MAX / 2) {
        nbig = (n - (int64_t)nthreads * chunk) / chunk;
        tail = chunk / 4;
        nchunks = nbig + (n - nbig * chunk + tail - 1) / tail;
    }
    uint32_t g = atomic_load(&P.gen) + 1;
    if (g == 0) g = 1; /* 0: "no job yet" */
    /* the seqlock's write side: seq odd, the fields, seq even again (release) */
    atomic_store_explicit(&P.seq, atomic_load_explicit(&P.seq, RELAXED) + 1, RELAXED);
    atomic_thread_fence(memory_order_release); /* odd seq before the field stores */
    atomic_store_explicit(&P.job_gen, g, RELAXED);
    atomic_store_explicit(&P.fn, fn, RELAXED);
    atomic_store_explicit(&P.ctx, ctx, RELAXED);
    atomic_store_explicit(&P.n, n, RELAXED);
    atomic_store_explicit(&P.chunk, chunk, RELAXED);
    atomic_store_explicit(&P.nbig, nbig, RELAXED);
    atomic_store_explicit(&P.tail, tail, RELAXED);
    atomic_store_explicit(&P.nchunks, (uint32_t)nchunks, RELAXED);
    atomic_store_explicit(&P.helpers, nthreads - 1 < helpers ? nthreads - 1 : helpers, RELAXED);
    atomic_store_explicit(&P.seq, atomic_load_explicit(&P.seq, RELAXED) + 1, memory_order_release);
    atomic_store_explicit(&P.done, 0, RELAXED);
    atomic_store(&P.word, (uint64_t)g << 32);
    atomic_store(&P.gen, g); /* seq_cst: ordered against the sleepers check below */
    if (atomic_load(&P.sleepers) > 0) {
        pthread_mutex_lock(&P.lock);
        pthread_cond_broadcast(&P.wake);
        pthread_mutex_unlock(&P.lock);
    }
    run_chunks(g, fn, ctx, n, chunk, nbig, tail, (uint32_t)nchunks, 0);
    /* chunks a helper claimed and is still running: spin, then yield the core to it (on an
       oversubscribed machine it may be waiting for exactly this core) */
    for (int spins = 0; atomic_load(&P.done) < nchunks; spins++) {
        if (spins < 4096)
            cpu_relax();
        else
            sched_yield();
    }
    pthread_mutex_unlock(&P.caller);
}
