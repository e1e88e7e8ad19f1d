/* The host memory sampler: a C thread that reads /proc for this process, its children (DataLoader
   workers) and the machine, without the GIL, at its own rate. */
#include "module.h"
#include "host_sampler.h"
#include "proc_memory.h"
#include "sample_ring.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* NOTE [ Host sampling rate ]
   The default tick is 50 ms (20 Hz), slower than the GPU sampler's 1 kHz: host memory moves at the
   pace of batches and of copy-on-read growth, steps tens of milliseconds apart and trends over
   seconds, so 10-100 Hz sees all of it, and faster ticks add cost and no finding. Each tick reads
   every watched process's RSS (/proc/PID/statm) and the machine's available memory and swap
   (/proc/meminfo): small files, cheap at that rate.
   PSS and USS, the figures that add up across processes and that show copy-on-read (a page copied
   into a worker was already resident there: its RSS does not move, its USS does), come only from
   /proc/PID/smaps_rollup, which walks every page table of the process under its memory-map lock:
   its cost grows with the process's resident memory (a training process with torch loaded costs
   milliseconds), and while it runs the process's own page faults wait. So smaps_rollup is read in
   rounds, all watched processes at once, spaced so that the rounds take at most `pss_budget` of one
   core (and never more often than the tick); a process seen for the first time is read at once.
   The list of processes (every descendant of this one: torch's DataLoader workers are its children,
   hotloop's are children of its launcher) comes from a scan of /proc, which reads one file per process
   of the machine: scans are spaced by their own cost over the same budget (and at least
   scan_interval_ms apart), so a quiet machine is scanned every tick or two and finds short-lived
   workers, while one of thousands of processes is scanned seldom; a worker that vanishes triggers a
   scan at the next tick, so restarted workers are found at once. */

/* What the sampler knows of one process over the whole run (kept or dropped samples alike). */
typedef struct {
    int pid, ppid, alive, given; /* given: named by set_pids() */
    double first_t, last_t, gone_t;
    uint64_t first_pss, last_pss, peak_pss, first_uss, last_uss, first_rss, last_rss, peak_rss;
    uint64_t samples;
    /* least squares of uss (MiB) over time (s since first_t): how steadily it grew. USS, not PSS: a
       page copied into a worker is the worker's alone, while its PSS also moves whenever another
       process starts or stops sharing any of its pages */
    double sum_t, sum_tt, sum_p, sum_tp, sum_pp;
    uint64_t first_cpu_ticks, last_cpu_ticks;
    uint64_t available_last; /* the machine's available memory at its last reading */
    double seen_t;           /* its last tick (RSS), >= last_t (its last PSS reading) */
} proc_record;

/* one process's reading in a tick, taken without the lock; `fresh`: smaps_rollup was read this tick
   (otherwise pss, uss, swap and locked are its last round's) */
typedef struct {
    hl_proc_stat stat;
    hl_proc_memory memory;
    int fresh;
} reading;

typedef struct hl_host_sampler {
    PyObject_HEAD
    int64_t interval_ns, scan_interval_ns;
    size_t capacity;
    int tree;     /* follow every descendant of main_pid */
    int main_pid; /* the root of the watched tree: `root`, else this process (as of start()) */
    int root;

    pthread_mutex_t lock;
    pthread_t thread;
    int running;
    atomic_int stop_requested;
    struct hl_host_sampler *prev, *next; /* every live sampler, for the fork handlers */

    /* the sampler thread's own (touched by start() and stop() only while no thread runs) */
    int *descendants;
    size_t descendants_n, descendants_cap;
    hl_proc_stat *scan;
    size_t scan_cap;
    reading *readings, *previous; /* this tick's and the last tick's */
    size_t readings_cap, previous_cap, previous_n;
    int64_t next_scan, next_round;
    int rescan;
    double pss_budget; /* the share of one core smaps_rollup rounds may take */

    /* guarded by lock */
    int *given;
    size_t given_n;
    sample_ring host, procs;
    proc_record *table;
    size_t table_n, table_cap;
    uint64_t ticks, ticks_missed, scans, errors, rounds;
    uint64_t peak_tree_pss, peak_main_pss, peak_tree_rss;
    uint32_t peak_processes;
    double peak_t;
    uint64_t min_available, max_swap_used, total, swap_total;
    double min_available_t;
    int64_t read_ns, scan_ns, round_ns; /* time the thread spent reading /proc (round_ns: smaps_rollup) */
    double started, stopped;
} hl_host_sampler;

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static hl_host_sampler *registry;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

/* fork: hold every lock across it so the child's copies are consistent; the child has none of the
   parent's threads, so its samplers are simply stopped there */
static void before_fork(void) {
    pthread_mutex_lock(&registry_lock);
    for (hl_host_sampler *s = registry; s != NULL; s = s->next)
        pthread_mutex_lock(&s->lock);
}

static void after_fork_parent(void) {
    for (hl_host_sampler *s = registry; s != NULL; s = s->next)
        pthread_mutex_unlock(&s->lock);
    pthread_mutex_unlock(&registry_lock);
}

static void after_fork_child(void) {
    for (hl_host_sampler *s = registry; s != NULL; s = s->next) {
        pthread_mutex_init(&s->lock, NULL);
        s->running = 0;
        atomic_store(&s->stop_requested, 1);
    }
    pthread_mutex_init(&registry_lock, NULL);
}

static void install_fork_handlers(void) { pthread_atfork(before_fork, after_fork_parent, after_fork_child); }

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static double seconds(int64_t ns) { return (double)ns * 1e-9; }

static void sleep_until(hl_host_sampler *s, int64_t deadline) {
    const int64_t slice = 10000000; /* wake every 10 ms to see whether stop() asked */
    for (;;) {
        if (atomic_load_explicit(&s->stop_requested, memory_order_relaxed))
            return;
        int64_t now = now_ns();
        if (now >= deadline)
            return;
        int64_t until = deadline - now > slice ? now + slice : deadline;
        struct timespec ts = {.tv_sec = until / 1000000000, .tv_nsec = until % 1000000000};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
        }
    }
}

static int contains(const int *pids, size_t n, int pid) {
    for (size_t i = 0; i < n; i++)
        if (pids[i] == pid)
            return 1;
    return 0;
}

static int grow(void **array, size_t *cap, size_t need, size_t item) {
    if (need <= *cap)
        return 0;
    size_t grown = *cap ? *cap : 16;
    while (grown < need)
        grown *= 2;
    void *more = realloc(*array, grown * item);
    if (more == NULL)
        return -1;
    *array = more;
    *cap = grown;
    return 0;
}

/* Every descendant of main_pid in a fresh scan of /proc; the thread's own arrays. */
static int scan_descendants(hl_host_sampler *s) {
    long n = hl_scan_processes(&s->scan, &s->scan_cap);
    if (n < 0)
        return -1;
    s->descendants_n = 0;
    /* pass after pass adds the children of what is found: as many passes as the tree is deep */
    for (int added = 1; added;) {
        added = 0;
        for (long i = 0; i < n; i++) {
            int pid = s->scan[i].pid, ppid = s->scan[i].ppid;
            if (pid == s->main_pid || contains(s->descendants, s->descendants_n, pid))
                continue;
            if (ppid == s->main_pid || contains(s->descendants, s->descendants_n, ppid)) {
                if (grow((void **)&s->descendants, &s->descendants_cap, s->descendants_n + 1, sizeof(int)) < 0)
                    return -1;
                s->descendants[s->descendants_n++] = pid;
                added = 1;
            }
        }
    }
    return 0;
}

static proc_record *record_of(hl_host_sampler *s, int pid) {
    for (size_t i = 0; i < s->table_n; i++)
        if (s->table[i].pid == pid && (s->table[i].alive || s->table[i].gone_t == 0.0))
            return &s->table[i];
    if (grow((void **)&s->table, &s->table_cap, s->table_n + 1, sizeof(proc_record)) < 0)
        return NULL;
    proc_record *r = &s->table[s->table_n++];
    memset(r, 0, sizeof(*r));
    r->pid = pid;
    return r;
}

static void note(proc_record *r, const reading *x, double t, uint64_t available) {
    const hl_proc_memory *m = &x->memory;
    r->ppid = x->stat.ppid;
    r->alive = 1;
    r->seen_t = t;
    r->available_last = available;
    r->last_cpu_ticks = x->stat.cpu_ticks;
    r->peak_rss = m->rss > r->peak_rss ? m->rss : r->peak_rss;
    if (!x->fresh)
        return;
    if (r->samples == 0) {
        r->first_t = t;
        r->first_pss = m->pss;
        r->first_uss = m->uss;
        r->first_rss = m->rss;
        r->first_cpu_ticks = x->stat.cpu_ticks;
    }
    r->last_t = t;
    r->last_pss = m->pss;
    r->last_uss = m->uss;
    r->last_rss = m->rss;
    r->peak_pss = m->pss > r->peak_pss ? m->pss : r->peak_pss;
    double dt = t - r->first_t, p = (double)m->uss / (1024.0 * 1024.0);
    r->sum_t += dt;
    r->sum_tt += dt * dt;
    r->sum_p += p;
    r->sum_tp += dt * p;
    r->sum_pp += p * p;
    r->samples++;
}

static const reading *previous_of(const hl_host_sampler *s, int pid) {
    for (size_t i = 0; i < s->previous_n; i++)
        if (s->previous[i].stat.pid == pid)
            return &s->previous[i];
    return NULL;
}

/* One tick: read every watched process and the machine, then record it all under the lock. */
static void tick(hl_host_sampler *s) {
    int64_t t0 = now_ns();
    int64_t scan_ns = 0;
    if (s->tree && (t0 >= s->next_scan || s->rescan)) {
        if (scan_descendants(s) == 0) {
            s->rescan = 0;
            scan_ns = now_ns() - t0;
            int64_t gap = (int64_t)((double)scan_ns / s->pss_budget); /* NOTE [ Host sampling rate ] */
            s->next_scan = t0 + (gap > s->scan_interval_ns ? gap : s->scan_interval_ns);
        }
    }
    /* the watched: this process, its descendants, and the pids Python named (copied under the lock) */
    int given[HL_HOST_MAX_GIVEN];
    size_t given_n = 0;
    pthread_mutex_lock(&s->lock);
    given_n = s->given_n;
    if (given_n > 0)
        memcpy(given, s->given, given_n * sizeof(int));
    pthread_mutex_unlock(&s->lock);

    size_t want = 1 + s->descendants_n + given_n, n = 0;
    int ok = grow((void **)&s->readings, &s->readings_cap, want, sizeof(reading)) == 0;
    int round = t0 >= s->next_round;
    int64_t round_ns = 0;
    for (size_t i = 0; ok && i < want; i++) {
        int pid = i == 0 ? s->main_pid : i <= s->descendants_n ? s->descendants[i - 1] : given[i - 1 - s->descendants_n];
        if (i > s->descendants_n && (pid == s->main_pid || contains(s->descendants, s->descendants_n, pid)))
            continue;
        reading *x = &s->readings[n];
        uint64_t rss = 0;
        if (hl_read_proc_stat(pid, &x->stat) < 0 || hl_read_proc_rss(pid, &rss) < 0)
            continue;
        const reading *before = previous_of(s, pid);
        x->fresh = round || before == NULL;
        if (x->fresh) { /* NOTE [ Host sampling rate ]: smaps_rollup in rounds */
            int64_t r0 = now_ns();
            int rc = hl_read_proc_memory(pid, &x->memory);
            round_ns += now_ns() - r0;
            if (rc < 0)
                continue;
        } else {
            x->memory = before->memory;
        }
        x->memory.rss = rss;
        n++;
    }
    if (round) {
        int64_t gap = (int64_t)((double)round_ns / s->pss_budget);
        s->next_round = now_ns() + (gap > s->interval_ns ? gap : s->interval_ns);
    }
    /* this tick's readings are the next tick's cache of PSS */
    if (grow((void **)&s->previous, &s->previous_cap, n ? n : 1, sizeof(reading)) == 0) {
        if (n > 0)
            memcpy(s->previous, s->readings, n * sizeof(reading));
        s->previous_n = n;
    } else {
        s->previous_n = 0;
    }
    hl_machine_memory machine = {0};
    int machine_ok = hl_read_machine_memory(&machine) == 0;
    int64_t t1 = now_ns();
    double t = seconds(t1);

    hl_host_sample h = {.t = t, .available = machine.available, .swap_used = machine.swap_total - machine.swap_free};
    pthread_mutex_lock(&s->lock);
    s->ticks++;
    s->read_ns += t1 - t0 - scan_ns;
    s->scan_ns += scan_ns;
    s->scans += scan_ns > 0;
    s->round_ns += round_ns;
    s->rounds += round;
    if (!ok || !machine_ok)
        s->errors++;
    for (size_t i = 0; i < n; i++) {
        const reading *x = &s->readings[i];
        h.tree_pss += x->memory.pss;
        h.tree_rss += x->memory.rss;
        h.tree_uss += x->memory.uss;
        h.tree_swap += x->memory.swap;
        if (x->stat.pid == s->main_pid) {
            h.main_pss = x->memory.pss;
            h.main_rss = x->memory.rss;
            h.main_locked = x->memory.locked;
        }
        hl_proc_sample p = {.t = t, .pid = x->stat.pid, .ppid = x->stat.ppid, .rss = x->memory.rss,
                            .pss = x->memory.pss, .uss = x->memory.uss, .swap = x->memory.swap};
        ring_push(&s->procs, &p);
        proc_record *r = record_of(s, x->stat.pid);
        if (r == NULL) {
            s->errors++;
            continue;
        }
        r->given = contains(given, given_n, x->stat.pid);
        note(r, x, t, machine.available);
    }
    h.processes = (uint32_t)n;
    /* a process read before and not now is gone: find its successor (a restarted worker) at once */
    for (size_t i = 0; i < s->table_n; i++) {
        proc_record *r = &s->table[i];
        if (!r->alive || r->seen_t == t)
            continue;
        r->alive = 0;
        r->gone_t = t;
        s->rescan = 1;
    }
    if (machine_ok) {
        s->total = machine.total;
        s->swap_total = machine.swap_total;
        if (s->min_available == 0 || machine.available < s->min_available) {
            s->min_available = machine.available;
            s->min_available_t = t;
        }
        s->max_swap_used = h.swap_used > s->max_swap_used ? h.swap_used : s->max_swap_used;
    }
    if (h.tree_pss > s->peak_tree_pss) {
        s->peak_tree_pss = h.tree_pss;
        s->peak_main_pss = h.main_pss;
        s->peak_tree_rss = h.tree_rss;
        s->peak_processes = h.processes;
        s->peak_t = t;
    }
    ring_push(&s->host, &h);
    pthread_mutex_unlock(&s->lock);
}

static void *sampler_main(void *arg) {
    hl_host_sampler *s = arg;
    int64_t next = now_ns() + s->interval_ns; /* start() took the first reading itself */
    sleep_until(s, next);
    while (!atomic_load(&s->stop_requested)) {
        tick(s);
        next += s->interval_ns;
        int64_t now = now_ns();
        if (next < now) { /* absolute deadlines keep the rate; ticks that could not be kept are counted */
            int64_t missed = (now - next) / s->interval_ns + 1;
            next += missed * s->interval_ns;
            pthread_mutex_lock(&s->lock);
            s->ticks_missed += (uint64_t)missed;
            pthread_mutex_unlock(&s->lock);
        }
        sleep_until(s, next);
    }
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
   Python methods */

static void reset_statistics(hl_host_sampler *s) {
    ring_clear(&s->host);
    ring_clear(&s->procs);
    s->table_n = 0;
    s->ticks = s->ticks_missed = s->scans = s->errors = s->rounds = 0;
    s->peak_tree_pss = s->peak_main_pss = s->peak_tree_rss = 0;
    s->peak_processes = 0;
    s->peak_t = s->min_available_t = 0.0;
    s->min_available = s->max_swap_used = s->total = s->swap_total = 0;
    s->read_ns = s->scan_ns = s->round_ns = 0;
    s->stopped = 0.0;
}

PyDoc_STRVAR(start_doc, "start()\n\nClear the previous run, take a first reading and start the sampler thread.\n"
                        "RuntimeError if already running.");

static PyObject *sampler_start(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    hl_host_sampler *s = (hl_host_sampler *)self;
    int err;
    if (s->running) {
        PyErr_SetString(PyExc_RuntimeError, "HostSampler.start(): already running; call stop() first");
        return NULL;
    }
    s->main_pid = s->root ? s->root : (int)getpid(); /* after a fork, the child watches its own tree */
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&s->lock);
    reset_statistics(s);
    pthread_mutex_unlock(&s->lock);
    atomic_store(&s->stop_requested, 0);
    s->started = seconds(now_ns());
    s->next_scan = s->next_round = 0;
    s->descendants_n = s->previous_n = 0;
    tick(s); /* a first reading now and a last one in stop(): a run shorter than a tick has both */
    err = pthread_create(&s->thread, NULL, sampler_main, s);
    s->running = err == 0;
    Py_END_ALLOW_THREADS
    if (err != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(stop_doc, "stop()\n\nTake a last reading and join the sampler thread. Does nothing when not running.");

static PyObject *sampler_stop(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    hl_host_sampler *s = (hl_host_sampler *)self;
    if (s->running) {
        Py_BEGIN_ALLOW_THREADS
        atomic_store(&s->stop_requested, 1);
        pthread_join(s->thread, NULL);
        s->running = 0;
        s->next_round = 0; /* the last reading is a whole one */
        tick(s);
        s->stopped = seconds(now_ns());
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_pids_doc, "set_pids(pids)\n\nWatch these processes too (besides this one and, with tree=True, its\n"
                           "descendants): hotloop's DataLoader names its workers. Replaces the previous list.");

static PyObject *sampler_set_pids(PyObject *self, PyObject *arg) {
    hl_host_sampler *s = (hl_host_sampler *)self;
    int pids[HL_HOST_MAX_GIVEN];
    Py_ssize_t n = PySequence_Size(arg);
    if (n < 0) {
        PyErr_Clear();
        return PyErr_Format(PyExc_TypeError, "set_pids(): expected a sequence of process ids, got %R", arg);
    }
    if (n > HL_HOST_MAX_GIVEN)
        return PyErr_Format(PyExc_ValueError, "set_pids(): expected at most %d process ids, got %zd",
                            HL_HOST_MAX_GIVEN, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(arg, i);
        if (item == NULL)
            return NULL;
        long pid = PyLong_Check(item) ? PyLong_AsLong(item) : -1;
        if (pid <= 0 || pid > INT32_MAX) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "set_pids(): expected positive process ids, got %R", item);
            Py_DECREF(item);
            return NULL;
        }
        Py_DECREF(item);
        pids[i] = (int)pid;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&s->lock);
    memcpy(s->given, pids, (size_t)n * sizeof(int));
    s->given_n = (size_t)n;
    pthread_mutex_unlock(&s->lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* what snapshot() copies under the lock, turned into Python objects once the GIL is back */
typedef struct {
    char *host, *procs;
    size_t host_n, procs_n;
    proc_record *table;
    size_t table_n;
    hl_host_sampler stats; /* a copy of the counters (its arrays and lock are not used) */
} snapshot_copy;

static int take_copy(hl_host_sampler *s, snapshot_copy *c) {
    pthread_mutex_lock(&s->lock);
    c->stats = *s;
    c->host_n = s->host.count;
    c->procs_n = s->procs.count;
    c->table_n = s->table_n;
    c->host = malloc(c->host_n * s->host.item + 1);
    c->procs = malloc(c->procs_n * s->procs.item + 1);
    c->table = malloc(c->table_n * sizeof(proc_record) + 1);
    int ok = c->host && c->procs && c->table;
    if (ok) {
        ring_copy(&s->host, c->host);
        ring_copy(&s->procs, c->procs);
        if (c->table_n > 0)
            memcpy(c->table, s->table, c->table_n * sizeof(proc_record));
    }
    pthread_mutex_unlock(&s->lock);
    return ok ? 0 : -1;
}

static PyObject *process_dict(const proc_record *r, double tick_s) {
    return Py_BuildValue("{s:i, s:i, s:O, s:O, s:d, s:d, s:N, s:K, s:K, s:K, s:K, s:K, s:K, s:K, s:K, s:K, s:d, s:d,"
                         " s:d, s:d, s:d, s:d, s:K}",
                         "pid", r->pid, "ppid", r->ppid, "alive", r->alive ? Py_True : Py_False, "given",
                         r->given ? Py_True : Py_False, "first_t", r->first_t, "last_t", r->last_t, "gone_t",
                         r->alive ? Py_NewRef(Py_None) : PyFloat_FromDouble(r->gone_t), "first_pss",
                         (unsigned long long)r->first_pss, "last_pss", (unsigned long long)r->last_pss, "peak_pss",
                         (unsigned long long)r->peak_pss, "first_uss", (unsigned long long)r->first_uss, "last_uss",
                         (unsigned long long)r->last_uss, "first_rss", (unsigned long long)r->first_rss, "last_rss",
                         (unsigned long long)r->last_rss, "peak_rss", (unsigned long long)r->peak_rss, "samples",
                         (unsigned long long)r->samples, "sum_t", r->sum_t, "sum_tt", r->sum_tt, "sum_p", r->sum_p,
                         "sum_tp", r->sum_tp, "sum_pp", r->sum_pp, "cpu_s",
                         (double)(r->last_cpu_ticks - r->first_cpu_ticks) * tick_s, "available_last",
                         (unsigned long long)r->available_last);
}

PyDoc_STRVAR(snapshot_doc,
             "snapshot() -> dict\n\n"
             "host: bytes of packed per-tick records (f8 t, u8 tree_pss, tree_rss, tree_uss, tree_swap, main_pss,\n"
             "main_rss, main_locked, available, swap_used, u4 processes, u4 unused); procs: one record per process\n"
             "per tick (f8 t, i4 pid, i4 ppid, u8 rss, pss, uss, swap); processes: a dict per process seen (first,\n"
             "last and peak readings, least-squares sums of its USS in MiB over seconds since its first reading,\n"
             "CPU seconds between them); and statistics over every tick, kept or dropped. Bytes, and\n"
             "time.monotonic() seconds. Works while running.");

static PyObject *sampler_snapshot(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    hl_host_sampler *s = (hl_host_sampler *)self;
    snapshot_copy c = {0};
    PyObject *result = NULL, *host = NULL, *procs = NULL, *processes = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = take_copy(s, &c);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_NoMemory();
        goto error;
    }
    host = PyBytes_FromStringAndSize(c.host, (Py_ssize_t)(c.host_n * sizeof(hl_host_sample)));
    procs = PyBytes_FromStringAndSize(c.procs, (Py_ssize_t)(c.procs_n * sizeof(hl_proc_sample)));
    processes = PyList_New(0);
    if (host == NULL || procs == NULL || processes == NULL)
        goto error;
    double tick_s = 1.0 / (double)sysconf(_SC_CLK_TCK);
    for (size_t i = 0; i < c.table_n; i++) {
        PyObject *d = process_dict(&c.table[i], tick_s);
        if (d == NULL || PyList_Append(processes, d) < 0) {
            Py_XDECREF(d);
            goto error;
        }
        Py_DECREF(d);
    }
    const hl_host_sampler *t = &c.stats;
    result = Py_BuildValue("{s:O, s:O, s:O, s:O, s:i, s:d, s:d, s:d, s:K, s:K, s:K, s:K, s:K, s:K, s:K, s:I, s:d,"
                           " s:K, s:d, s:K, s:K, s:K, s:d, s:d, s:K, s:K, s:d, s:K, s:d}",
                           "host", host, "procs", procs, "processes", processes, "running",
                           s->running ? Py_True : Py_False, "main_pid", s->main_pid, "started", t->started, "stopped",
                           t->stopped, "interval_s", seconds(s->interval_ns), "ticks", (unsigned long long)t->ticks,
                           "ticks_missed", (unsigned long long)t->ticks_missed, "scans", (unsigned long long)t->scans,
                           "errors", (unsigned long long)t->errors, "peak_tree_pss",
                           (unsigned long long)t->peak_tree_pss, "peak_main_pss", (unsigned long long)t->peak_main_pss,
                           "peak_tree_rss", (unsigned long long)t->peak_tree_rss, "peak_processes",
                           (unsigned int)t->peak_processes, "peak_t", t->peak_t, "min_available",
                           (unsigned long long)t->min_available, "min_available_t", t->min_available_t,
                           "max_swap_used", (unsigned long long)t->max_swap_used, "total",
                           (unsigned long long)t->total, "swap_total", (unsigned long long)t->swap_total, "read_s",
                           seconds(t->read_ns), "scan_s", seconds(t->scan_ns), "host_dropped",
                           (unsigned long long)t->host.dropped, "procs_dropped", (unsigned long long)t->procs.dropped, "pss_s", seconds(t->round_ns),
                           "rounds", (unsigned long long)t->rounds, "pss_budget", s->pss_budget);
error:
    Py_XDECREF(host);
    Py_XDECREF(procs);
    Py_XDECREF(processes);
    free(c.host);
    free(c.procs);
    free(c.table);
    return result;
}

static PyObject *get_running(PyObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(((hl_host_sampler *)self)->running);
}

static PyObject *get_interval_ms(PyObject *self, void *Py_UNUSED(closure)) {
    return PyFloat_FromDouble((double)((hl_host_sampler *)self)->interval_ns * 1e-6);
}

static PyObject *get_scan_interval_ms(PyObject *self, void *Py_UNUSED(closure)) {
    return PyFloat_FromDouble((double)((hl_host_sampler *)self)->scan_interval_ns * 1e-6);
}

static PyObject *get_tree(PyObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(((hl_host_sampler *)self)->tree);
}

static PyGetSetDef sampler_getset[] = {
    {"running", get_running, NULL, "whether the sampler thread runs", NULL},
    {"interval_ms", get_interval_ms, NULL, "the tick, milliseconds", NULL},
    {"scan_interval_ms", get_scan_interval_ms, NULL, "the least time between scans of /proc for descendants, ms", NULL},
    {"tree", get_tree, NULL, "whether every descendant of this process is watched", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef sampler_methods[] = {
    {"start", sampler_start, METH_NOARGS, start_doc},
    {"stop", sampler_stop, METH_NOARGS, stop_doc},
    {"set_pids", sampler_set_pids, METH_O, set_pids_doc},
    {"snapshot", sampler_snapshot, METH_NOARGS, snapshot_doc},
    {NULL, NULL, 0, NULL},
};

static PyObject *sampler_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"interval_ms", "scan_interval_ms", "capacity", "tree", "pss_budget", "root", NULL};
    double interval_ms = 50.0, scan_ms = 50.0, pss_budget = 0.02;
    Py_ssize_t capacity = 65536;
    int tree = 1, root = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|ddnpdi:HostSampler", keywords, &interval_ms, &scan_ms, &capacity,
                                     &tree, &pss_budget, &root))
        return NULL;
    if (root < 0) {
        PyErr_Format(PyExc_ValueError, "root: expected a process id (0: this process), got %d", root);
        return NULL;
    }
    if (!(interval_ms >= 1.0 && interval_ms <= 3.6e6)) {
        char message[120];
        snprintf(message, sizeof(message), "interval_ms: expected 1 to 3600000 milliseconds, got %g", interval_ms);
        PyErr_SetString(PyExc_ValueError, message);
        return NULL;
    }
    if (!(scan_ms >= interval_ms && scan_ms <= 3.6e6)) {
        PyErr_SetString(PyExc_ValueError, "scan_interval_ms: expected at least interval_ms, at most 3600000");
        return NULL;
    }
    if (!(pss_budget > 0.0 && pss_budget <= 1.0)) {
        PyErr_SetString(PyExc_ValueError, "pss_budget: expected a share of one core above 0, at most 1");
        return NULL;
    }
    if (capacity < 1 || capacity > ((Py_ssize_t)1 << 26)) {
        PyErr_Format(PyExc_ValueError, "capacity: expected 1 to 2**26 ticks, got %zd", capacity);
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    hl_host_sampler *s = (hl_host_sampler *)alloc(type, 0);
    if (s == NULL)
        return NULL;
    s->interval_ns = (int64_t)(interval_ms * 1e6);
    s->scan_interval_ns = (int64_t)(scan_ms * 1e6);
    s->capacity = (size_t)capacity;
    s->tree = tree;
    s->pss_budget = pss_budget;
    s->root = root;
    s->main_pid = (int)getpid();
    pthread_mutex_init(&s->lock, NULL);
    atomic_init(&s->stop_requested, 0);
    s->given = malloc(HL_HOST_MAX_GIVEN * sizeof(int));
    /* the process ring holds a tick's records for HL_HOST_PROCS_PER_TICK processes on average */
    if (s->given == NULL || ring_init(&s->host, sizeof(hl_host_sample), (size_t)capacity) < 0 ||
        ring_init(&s->procs, sizeof(hl_proc_sample), (size_t)capacity * HL_HOST_PROCS_PER_TICK) < 0) {
        Py_DECREF(s); /* dealloc frees what was allocated */
        return PyErr_NoMemory();
    }
    reset_statistics(s);
    pthread_once(&atfork_once, install_fork_handlers);
    pthread_mutex_lock(&registry_lock);
    s->next = registry;
    if (registry != NULL)
        registry->prev = s;
    registry = s;
    pthread_mutex_unlock(&registry_lock);
    return (PyObject *)s;
}

static void sampler_dealloc(PyObject *self) {
    hl_host_sampler *s = (hl_host_sampler *)self;
    PyTypeObject *type = Py_TYPE(self);
    if (s->running) {
        Py_BEGIN_ALLOW_THREADS
        atomic_store(&s->stop_requested, 1);
        pthread_join(s->thread, NULL);
        s->running = 0;
        Py_END_ALLOW_THREADS
    }
    if (s->capacity > 0) { /* registered (construction got that far) */
        pthread_mutex_lock(&registry_lock);
        if (s->prev)
            s->prev->next = s->next;
        else if (registry == s)
            registry = s->next;
        if (s->next)
            s->next->prev = s->prev;
        pthread_mutex_unlock(&registry_lock);
        pthread_mutex_destroy(&s->lock);
    }
    ring_free(&s->host);
    ring_free(&s->procs);
    free(s->given);
    free(s->descendants);
    free(s->scan);
    free(s->readings);
    free(s->previous);
    free(s->table);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(self);
    Py_DECREF(type);
}

PyDoc_STRVAR(sampler_doc,
             "HostSampler(interval_ms=50.0, scan_interval_ms=50.0, capacity=65536, tree=True, pss_budget=0.02, root=0)\n\n"
             "Host memory read by a C thread without the GIL: every interval_ms, the RSS of this process (or of\n"
             "`root`, another process), of every descendant (tree=True: DataLoader workers; found by scans of\n"
             "/proc at least scan_interval_ms apart, and at once when a watched process vanishes) and of the\n"
             "pids given to set_pids(), and /proc/meminfo's available memory and swap; their PSS, USS and swap\n"
             "(/proc/PID/smaps_rollup, costly) in rounds. Rounds and scans each take at most pss_budget of one\n"
             "core. The ring keeps the newest `capacity` ticks; peaks and per-process figures cover every tick.\n"
             "Linux only: elsewhere start() raises OSError.");

static PyType_Slot sampler_slots[] = {
    {Py_tp_new, sampler_new},
    {Py_tp_dealloc, sampler_dealloc},
    {Py_tp_methods, sampler_methods},
    {Py_tp_getset, sampler_getset},
    {Py_tp_doc, (void *)sampler_doc},
    {0, NULL},
};

static PyType_Spec sampler_spec = {
    .name = "hotloop._C.HostSampler",
    .basicsize = sizeof(hl_host_sampler),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = sampler_slots,
};

PyDoc_STRVAR(proc_memory_doc, "proc_memory(pid, rollup=True) -> dict or None\n\nOne reading of /proc/PID/smaps_rollup "
                              "now (where the kernel has none, or rollup=False: the sums of /proc/PID/smaps), in\n"
                              "bytes (rss, pss, uss, swap, locked); None when the process is gone.");

static PyObject *proc_memory(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"pid", "rollup", NULL};
    long pid;
    int rollup = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "l|p:proc_memory", keywords, &pid, &rollup))
        return NULL;
    if (pid <= 0 || pid > INT32_MAX)
        return PyErr_Format(PyExc_ValueError, "proc_memory(): expected a positive process id, got %ld", pid);
    hl_proc_memory m;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hl_read_proc_memory_from((int)pid, &m, rollup);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("{s:K, s:K, s:K, s:K, s:K}", "rss", (unsigned long long)m.rss, "pss",
                         (unsigned long long)m.pss, "uss", (unsigned long long)m.uss, "swap",
                         (unsigned long long)m.swap, "locked", (unsigned long long)m.locked);
}

PyDoc_STRVAR(machine_memory_doc, "machine_memory() -> dict or None\n\n/proc/meminfo now, in bytes (total, available, "
                                 "swap_total, swap_free); None where it cannot be read.");

static PyObject *machine_memory(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
    hl_machine_memory m;
    if (hl_read_machine_memory(&m) < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("{s:K, s:K, s:K, s:K}", "total", (unsigned long long)m.total, "available",
                         (unsigned long long)m.available, "swap_total", (unsigned long long)m.swap_total,
                         "swap_free", (unsigned long long)m.swap_free);
}

static PyMethodDef host_functions[] = {
    {"proc_memory", (PyCFunction)(void (*)(void))proc_memory, METH_VARARGS | METH_KEYWORDS, proc_memory_doc},
    {"machine_memory", machine_memory, METH_NOARGS, machine_memory_doc},
    {NULL, NULL, 0, NULL},
};

static const hl_int_constant host_constants[] = {
    {"HOST_SAMPLE_BYTES", (long)sizeof(hl_host_sample)},
    {"HOST_PROC_SAMPLE_BYTES", (long)sizeof(hl_proc_sample)},
    {"HOST_MAX_GIVEN_PIDS", HL_HOST_MAX_GIVEN},
    {NULL, 0},
};

int hl_host_sampler_exec(PyObject *module) {
    hl_state *state = hl_state_of(module);
    state->host_sampler_type = PyType_FromModuleAndSpec(module, &sampler_spec, NULL);
    if (state->host_sampler_type == NULL)
        return -1;
    if (hl_add_int_constants(module, host_constants) < 0 || PyModule_AddFunctions(module, host_functions) < 0)
        return -1;
    return PyModule_AddObjectRef(module, "HostSampler", state->host_sampler_type);
}
