/* The C reference's worker threads: one process-wide pool, started on first use, woken for each pass, re-made lazily in a forked child. */
#include "thread_pool.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define HL_POOL_MXCSR 1
#endif

/* at most this many threads in a pass, the caller's included */
#define MAX_THREADS 256

/* NOTE [ The C reference's thread pool ]
   Threads started for every pass cost a clone, a stack and a wake-up each; the pool's threads sleep on a
   condition variable between passes instead, as torch's intra-op threads do. One pass at a time uses
   the pool: `busy` says one is in flight, and another caller (a second Python thread stepping with
   the GIL released) does its items alone rather than wait, which fn's contract (any thread may do
   any item) makes correct. A pass's job lives on its caller's stack: a worker joins it (under the
   lock) only while the caller has not closed it and items are left, and the caller, out of items,
   closes it and returns once every worker that joined has left; so a worker the scheduler wakes late
   costs the pass nothing.
   Fork: the lock is held across fork() so the child's copy is consistent; the child has none of the
   parent's threads, so it forgets them and starts its own on its first pass (a DataLoader worker
   forked while the parent's pool sleeps steps on its own pool). Exit: the workers sleep in
   pthread_cond_wait between passes and hold nothing, so the process's exit ends them; they block
   every signal, so the main thread takes them as it would without the pool. Floating point: a worker
   takes the caller's SSE control word (rounding, flush-to-zero and denormals-are-zero, which
   torch.set_flush_denormal sets per thread) with each job, so an item's bits do not depend on the
   thread that did it, as a thread started for the pass would inherit it. */

typedef struct {
    hl_range_fn fn;
    void *ctx;
    int64_t n;
    _Atomic int64_t next; /* the next item nobody has taken */
    int threads;          /* the most that take part, the caller's included */
#ifdef HL_POOL_MXCSR
    unsigned int mxcsr; /* the caller's SSE rounding and flush-to-zero modes (torch.set_flush_denormal) */
#endif
} pool_job;

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake; /* a new job (generation moved on) */
    pthread_cond_t done; /* the last worker on the job left it */
    int started;         /* workers alive: indices 1..started */
    int busy;            /* a pass holds the pool */
    uint64_t generation; /* bumped per job */
    int wanted;          /* workers 1..wanted - 1 may join the current job */
    int joined;          /* workers on the job now */
    pool_job *job;       /* the current job; NULL once its caller has done what it could */
    uint64_t born_at[MAX_THREADS]; /* worker k's first generation to wait past: the one it was started in */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, NULL, {0}};

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void before_fork(void) { pthread_mutex_lock(&pool.lock); }

static void after_fork_parent(void) { pthread_mutex_unlock(&pool.lock); }

static void after_fork_child(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.started = 0;
    pool.busy = 0;
    pool.wanted = 0;
    pool.joined = 0;
    pool.job = NULL;
}

static void install_fork_handlers(void) { pthread_atfork(before_fork, after_fork_parent, after_fork_child); }

/* items of `job` until none is left, in runs that shrink as they go (OpenMP's guided schedule): a run is
   a share of what is left, so the first ones are long (a thread streams through contiguous memory, as
   the hardware prefetchers like, and writes partials apart from the others') and the last ones short
   (threads finish together, whichever joined late) */
static void take_items(pool_job *job) {
    int64_t first = atomic_load_explicit(&job->next, memory_order_relaxed);
    for (;;) {
        const int64_t left = job->n - first;
        if (left <= 0)
            return;
        int64_t run = left / (2 * (int64_t)job->threads);
        if (run < 1)
            run = 1;
        if (atomic_compare_exchange_weak_explicit(&job->next, &first, first + run, memory_order_relaxed,
                                                  memory_order_relaxed)) {
            job->fn(job->ctx, first, first + run);
            first = atomic_load_explicit(&job->next, memory_order_relaxed);
        }
    }
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.lock);
    uint64_t seen = pool.born_at[index]; /* not pool.generation: the job it was started for may be out already */
    for (;;) {
        while (pool.generation == seen)
            pthread_cond_wait(&pool.wake, &pool.lock);
        seen = pool.generation;
        pool_job *job = pool.job;
        /* woken late (the caller did every item, or is waiting for the others): nothing to join */
        if (index >= pool.wanted || job == NULL || atomic_load_explicit(&job->next, memory_order_relaxed) >= job->n)
            continue;
        pool.joined++;
        pthread_mutex_unlock(&pool.lock);
#ifdef HL_POOL_MXCSR
        if (_mm_getcsr() != job->mxcsr)
            _mm_setcsr(job->mxcsr);
#endif
        take_items(job);
        pthread_mutex_lock(&pool.lock);
        if (--pool.joined == 0)
            pthread_cond_signal(&pool.done);
    }
    return NULL;
}

/* workers up to index `count`, pool.lock held; returns how many are alive */
static int start_workers(int count) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old); /* a new thread inherits the mask */
    while (pool.started < count) {
        pthread_t id;
        pthread_attr_t attr;
        pool.born_at[pool.started + 1] = pool.generation;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int err = pthread_create(&id, &attr, worker_main, (void *)(intptr_t)(pool.started + 1));
        pthread_attr_destroy(&attr);
        if (err != 0)
            break;
        pool.started++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return pool.started;
}

void hl_parallel_for(int64_t n, int threads, int64_t min_per_thread, hl_range_fn fn, void *ctx) {
    if (n <= 0)
        return;
    int64_t most = min_per_thread > 0 ? n / min_per_thread : n;
    if (most > threads)
        most = threads;
    if (most > MAX_THREADS)
        most = MAX_THREADS;
    if (most <= 1) {
        fn(ctx, 0, n);
        return;
    }
    pthread_once(&atfork_once, install_fork_handlers);
    pool_job job = {.fn = fn, .ctx = ctx, .n = n, .threads = (int)most};
    atomic_init(&job.next, 0);
#ifdef HL_POOL_MXCSR
    job.mxcsr = _mm_getcsr();
#endif
    pthread_mutex_lock(&pool.lock);
    if (pool.busy) {
        pthread_mutex_unlock(&pool.lock);
        fn(ctx, 0, n);
        return;
    }
    const int workers = start_workers((int)most - 1);
    if (workers == 0) {
        pthread_mutex_unlock(&pool.lock);
        fn(ctx, 0, n);
        return;
    }
    pool.busy = 1;
    pool.job = &job;
    pool.wanted = (int)(workers < most - 1 ? workers + 1 : most);
    pool.joined = 0;
    pool.generation++;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);

    take_items(&job);

    pthread_mutex_lock(&pool.lock);
    pool.job = NULL; /* a worker not on it by now stays out */
    while (pool.joined > 0)
        pthread_cond_wait(&pool.done, &pool.lock);
    pool.busy = 0;
    pthread_mutex_unlock(&pool.lock);
}
