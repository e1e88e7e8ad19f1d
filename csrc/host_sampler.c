/* The host memory sampler: a C thread that reads /proc for this process, its children (DataLoader
   workers) and the machine, without the GIL, at its own rate, for every window open on it. */
#include "module.h"
#include "host_sampler.h"
#include "proc_memory.h"
#include "sample_ring.h"
#include "sampler_thread.h"

#include <errno.h>
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
   core (and never more often than the tick). A round is always whole: when a process appears or exits,
   every process is read again at that tick, so that each tick's sum is one moment's (a sum of main's
   reading from before a fork and its workers' from after it counts every page main shared twice), and
   the peak is taken only over whole rounds.
   The list of processes (every descendant of this one: torch's DataLoader workers are its children,
   hotloop's are children of its launcher) comes from the kernel's children files (a few small reads, so
   a new worker is read from its first tick or so); where the kernel has none, from a scan of /proc, which
   reads one file per process of the machine. Either is spaced by its own cost over the same budget (and
   at least scan_interval_ms apart), so a quiet machine is listed every tick or two and finds short-lived
   workers, while a scan of thousands of processes comes seldom; a worker that vanishes triggers one at
   the next tick, so restarted workers are found at once. */

/* NOTE [ Sampler windows ]
   Entering a monitor must cost next to nothing, so the thread is started once per process and kept: a
   monitor opens a window on it (a few counters set under the lock) and closes it (its figures copied out).
   The thread ticks while any window is open and sleeps, costing nothing, while none is; each tick updates
   every open window's peaks and per-process records, so nested monitors, and monitors in several threads,
   each see their own run. The rings are shared: a window's records are those inside its times. A window
   closed before the thread's first tick in it (a run of a few milliseconds) takes the last whole tick
   before it, and says so: waiting for a tick would cost the run a round of smaps_rollup. */

/* What a window knows of one process over its run (kept or dropped samples alike). */
typedef struct {
    int pid, ppid, alive, given; /* given: named by set_pids() */
    int unreadable;              /* alive, but its memory could not be read (another user's, a hardened /proc) */
    int forked;                  /* its command line is main's: forked from it without an exec */
    char comm[16];
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

/* The sampler's running totals, which a window holds at its opening and at its closing. */
typedef struct {
    uint64_t ticks, ticks_missed, scans, errors, rounds;
    int64_t read_ns, scan_ns, round_ns; /* time the thread spent reading /proc (round_ns: smaps_rollup) */
} totals;

/* One monitor's window (NOTE [ Sampler windows ]). */
typedef struct {
    int id, open;
    double opened, closed;
    totals at_open, at_close;
    uint64_t whole_ticks;
    int before; /* the run ended before the window's first tick: its figures are the last whole tick before it */
    uint64_t peak_tree_pss, peak_main_pss, peak_tree_rss;
    uint32_t peak_processes, unreadable_max;
    double peak_t;
    uint64_t min_available, max_swap_used, total, swap_total;
    double min_available_t;
    proc_record *table;
    size_t table_n, table_cap;
} window;

/* one process's reading in a tick, taken without the lock; `fresh`: smaps_rollup was read this tick
   (otherwise pss, uss, swap and locked are its last round's); `unreadable`: it is there but could not be read */
typedef struct {
    hl_proc_stat stat;
    hl_proc_memory memory;
    int fresh, unreadable, forked;
} reading;

typedef struct hl_host_sampler {
    PyObject_HEAD
    hl_sampler_thread sampler; /* sampler.lock guards what is marked so below */
    int ready;
    int64_t interval_ns, scan_interval_ns;
    size_t capacity;
    int tree;     /* follow every descendant of main_pid */
    int main_pid; /* the root of the watched tree: `root`, else this process (as of the thread's start) */
    int root;
    int default_window; /* start()/stop()'s window id, 0 when none */
    int starting;       /* an open_window() call is starting the thread (read and written with the GIL) */

    /* the sampler thread's own */
    int *descendants;
    size_t descendants_n, descendants_cap;
    hl_proc_stat *scan;
    size_t scan_cap;
    reading *readings, *previous; /* this tick's and the last tick's */
    size_t readings_cap, previous_cap, previous_n;
    int64_t next_scan, next_round;
    int rescan;
    double pss_budget; /* the share of one core smaps_rollup rounds may take */
    char main_cmdline[512];
    long main_cmdline_n;
    int children_listed; /* the kernel lists children: list_descendants() every tick, no scans of /proc */

    /* guarded by sampler.lock */
    int *given;
    size_t given_n;
    sample_ring host, procs;
    totals sum;
    window *windows;
    size_t windows_n, windows_cap;
    int next_id;
    struct { /* the last whole tick: what a window shorter than a tick reports (NOTE [ Sampler windows ]) */
        hl_host_sample host;
        hl_machine_memory machine;
        int machine_ok, valid;
        reading *readings;
        size_t n, cap;
    } last_whole;
} hl_host_sampler;

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

/* Every descendant of main_pid, from the children files, breadth first: cheap enough for every tick, so a worker
   is read from its first tick on (what it copies from then on is counted). The thread's own arrays. */
static int list_descendants(hl_host_sampler *s) {
    s->descendants_n = 0;
    if (hl_append_children(s->main_pid, &s->descendants, &s->descendants_n, &s->descendants_cap) < 0)
        return -1;
    for (size_t i = 0; i < s->descendants_n; i++)
        if (hl_append_children(s->descendants[i], &s->descendants, &s->descendants_n, &s->descendants_cap) < 0)
            return -1;
    return 0;
}

/* Every descendant of main_pid in a fresh scan of /proc, where the kernel lists no children. */
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

static proc_record *record_of(window *w, int pid) {
    for (size_t i = 0; i < w->table_n; i++)
        if (w->table[i].pid == pid && (w->table[i].alive || w->table[i].gone_t == 0.0))
            return &w->table[i];
    if (grow((void **)&w->table, &w->table_cap, w->table_n + 1, sizeof(proc_record)) < 0)
        return NULL;
    proc_record *r = &w->table[w->table_n++];
    memset(r, 0, sizeof(*r));
    r->pid = pid;
    return r;
}

static void note(proc_record *r, const reading *x, double t, uint64_t available) {
    const hl_proc_memory *m = &x->memory;
    r->ppid = x->stat.ppid ? x->stat.ppid : r->ppid;
    if (x->stat.comm[0])
        memcpy(r->comm, x->stat.comm, sizeof(r->comm));
    r->alive = 1;
    r->unreadable = x->unreadable;
    r->forked = x->forked;
    r->seen_t = t;
    r->available_last = available;
    if (x->unreadable)
        return;
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

static int is_forked(hl_host_sampler *s, int pid) {
    char cmdline[sizeof(s->main_cmdline)];
    long n = hl_read_proc_cmdline(pid, cmdline, sizeof(cmdline));
    return n > 0 && n == s->main_cmdline_n && memcmp(cmdline, s->main_cmdline, (size_t)n) == 0;
}

/* The watched processes' readings, all at this tick: RSS and CPU time of each, and their PSS and USS either all
   read now (a whole round: due, or a process appeared or vanished) or all carried from the last round. n read. */
static size_t read_processes(hl_host_sampler *s, const int *given, size_t given_n, int first, int *whole,
                             int64_t *round_ns, int *ok) {
    size_t want = 1 + s->descendants_n + given_n, n = 0;
    *ok = grow((void **)&s->readings, &s->readings_cap, want, sizeof(reading)) == 0;
    if (!*ok)
        return 0;
    int changed = first;
    for (size_t i = 0; i < want; i++) {
        int pid = i == 0                    ? s->main_pid
                  : i <= s->descendants_n ? s->descendants[i - 1]
                                          : given[i - 1 - s->descendants_n];
        if (i > s->descendants_n && (pid == s->main_pid || contains(s->descendants, s->descendants_n, pid)))
            continue;
        reading *x = &s->readings[n];
        memset(x, 0, sizeof(*x));
        uint64_t rss = 0;
        if (hl_read_proc_stat(pid, &x->stat) < 0 || hl_read_proc_rss(pid, &rss) < 0) {
            if (!hl_proc_alive(pid))
                continue; /* exited */
            x->stat.pid = pid;
            x->unreadable = 1;
        }
        x->memory.rss = rss;
        const reading *before = previous_of(s, pid);
        changed |= before == NULL || before->unreadable != x->unreadable; /* its PSS is not in the cache */
        x->forked = before != NULL ? before->forked : pid != s->main_pid && is_forked(s, pid);
        n++;
    }
    for (size_t i = 0; i < s->previous_n && !changed; i++) {
        int found = 0;
        for (size_t k = 0; k < n && !found; k++)
            found = s->readings[k].stat.pid == s->previous[i].stat.pid;
        changed = !found;
    }
    *whole = changed || hl_now_ns() >= s->next_round;
    int64_t r0 = hl_now_ns();
    for (size_t i = 0; i < n; i++) {
        reading *x = &s->readings[i];
        if (x->unreadable)
            continue;
        if (*whole) { /* NOTE [ Host sampling rate ]: smaps_rollup in whole rounds */
            uint64_t rss = x->memory.rss;
            if (hl_read_proc_memory(x->stat.pid, &x->memory) < 0) {
                memset(&x->memory, 0, sizeof(x->memory));
                x->unreadable = hl_proc_alive(x->stat.pid);
                if (!x->unreadable) { /* exited meanwhile: drop it */
                    memmove(x, x + 1, (n - i - 1) * sizeof(reading));
                    n--;
                    i--;
                }
                continue;
            }
            x->memory.rss = rss;
            x->fresh = 1;
        } else {
            const reading *before = previous_of(s, x->stat.pid);
            uint64_t rss = x->memory.rss;
            x->memory = before->memory;
            x->memory.rss = rss;
        }
    }
    if (*whole) {
        *round_ns = hl_now_ns() - r0;
        int64_t gap = (int64_t)((double)*round_ns / s->pss_budget);
        s->next_round = hl_now_ns() + (gap > s->interval_ns ? gap : s->interval_ns);
    }
    return n;
}

/* One open window takes in this tick. Under the lock. */
static void window_tick(hl_host_sampler *s, window *w, const hl_host_sample *h, const hl_machine_memory *machine,
                        int machine_ok, const int *given, size_t given_n, const reading *readings, size_t n) {
    for (size_t i = 0; i < n; i++) {
        const reading *x = &readings[i];
        proc_record *r = record_of(w, x->stat.pid);
        if (r == NULL) {
            s->sum.errors++;
            continue;
        }
        r->given = contains(given, given_n, x->stat.pid);
        note(r, x, h->t, machine->available);
    }
    /* a process read before and not now: gone only when it has exited (one that left the tree is not) */
    for (size_t i = 0; i < w->table_n; i++) {
        proc_record *r = &w->table[i];
        if (!r->alive || r->seen_t == h->t || hl_proc_alive(r->pid))
            continue;
        r->alive = 0;
        r->gone_t = h->t;
    }
    if (machine_ok) {
        w->total = machine->total;
        w->swap_total = machine->swap_total;
        if (w->min_available == 0 || machine->available < w->min_available) {
            w->min_available = machine->available;
            w->min_available_t = h->t;
        }
        w->max_swap_used = h->swap_used > w->max_swap_used ? h->swap_used : w->max_swap_used;
    }
    w->unreadable_max = h->unreadable > w->unreadable_max ? h->unreadable : w->unreadable_max;
    if (h->whole) {
        w->whole_ticks++;
        if (h->tree_pss > w->peak_tree_pss) { /* one moment's sum: NOTE [ Host sampling rate ] */
            w->peak_tree_pss = h->tree_pss;
            w->peak_main_pss = h->main_pss;
            w->peak_tree_rss = h->tree_rss;
            w->peak_processes = h->processes;
            w->peak_t = h->t;
        }
    }
}

/* One tick: read every watched process and the machine, then record it all under the lock. */
static void tick(hl_host_sampler *s, int first) {
    int64_t t0 = hl_now_ns();
    int64_t scan_ns = 0;
    int listed = 1;
    if (s->tree && (t0 >= s->next_scan || s->rescan || first)) {
        listed = (s->children_listed ? list_descendants(s) : scan_descendants(s)) == 0;
        if (listed) {
            s->rescan = 0;
            scan_ns = hl_now_ns() - t0;
            int64_t gap = (int64_t)((double)scan_ns / s->pss_budget); /* NOTE [ Host sampling rate ] */
            s->next_scan = t0 + (gap > s->scan_interval_ns ? gap : s->scan_interval_ns);
        }
    }
    /* the watched: this process, its descendants, and the pids Python named (copied under the lock) */
    int given[HL_HOST_MAX_GIVEN];
    size_t given_n = 0;
    pthread_mutex_lock(&s->sampler.lock);
    given_n = s->given_n;
    if (given_n > 0)
        memcpy(given, s->given, given_n * sizeof(int));
    pthread_mutex_unlock(&s->sampler.lock);

    int whole = 0, ok = 1;
    int64_t round_ns = 0;
    size_t n = read_processes(s, given, given_n, first, &whole, &round_ns, &ok);
    if (n < s->previous_n)
        s->rescan = 1; /* one vanished: find its successor (a restarted worker) at once */
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
    int64_t t1 = hl_now_ns();
    double t = hl_seconds(t1);

    hl_host_sample h = {.t = t, .available = machine.available, .swap_used = machine.swap_total - machine.swap_free,
                        .whole = (uint16_t)whole};
    pthread_mutex_lock(&s->sampler.lock);
    s->sum.ticks++;
    s->sum.read_ns += t1 - t0 - scan_ns;
    s->sum.scan_ns += scan_ns;
    s->sum.scans += scan_ns > 0;
    s->sum.round_ns += round_ns;
    s->sum.rounds += whole;
    if (!ok || !machine_ok || !listed)
        s->sum.errors++;
    for (size_t i = 0; i < n; i++) {
        const reading *x = &s->readings[i];
        if (x->unreadable) {
            h.unreadable++;
            continue;
        }
        h.tree_pss += x->memory.pss;
        h.tree_rss += x->memory.rss;
        h.tree_uss += x->memory.uss;
        h.tree_swap += x->memory.swap;
        h.processes++;
        if (x->stat.pid == s->main_pid) {
            h.main_pss = x->memory.pss;
            h.main_rss = x->memory.rss;
            h.main_locked = x->memory.locked;
        }
        hl_proc_sample p = {.t = t, .pid = x->stat.pid, .ppid = x->stat.ppid, .rss = x->memory.rss,
                            .pss = x->memory.pss, .uss = x->memory.uss, .swap = x->memory.swap};
        ring_push(&s->procs, &p);
    }
    for (size_t i = 0; i < s->windows_n; i++)
        if (s->windows[i].open)
            window_tick(s, &s->windows[i], &h, &machine, machine_ok, given, given_n, s->readings, n);
    ring_push(&s->host, &h);
    if (whole && grow((void **)&s->last_whole.readings, &s->last_whole.cap, n ? n : 1, sizeof(reading)) == 0) {
        if (n > 0)
            memcpy(s->last_whole.readings, s->readings, n * sizeof(reading));
        s->last_whole.n = n;
        s->last_whole.host = h;
        s->last_whole.machine = machine;
        s->last_whole.machine_ok = machine_ok;
        s->last_whole.valid = 1;
    }
    pthread_mutex_unlock(&s->sampler.lock);
}

static void *sampler_main(void *arg) {
    hl_host_sampler *s = arg;
    int first = 1;
    int64_t next = hl_now_ns();
    while (!hl_sampler_stopping(&s->sampler)) {
        tick(s, first);
        first = 0;
        next = hl_sampler_next_tick(&s->sampler, next, s->interval_ns, &s->sum.ticks_missed);
        /* a window opened after a time with none: a tick at once (RSS; PSS when its round is due: NOTE [ Host
           sampling rate ], so monitors opened one after another keep to the budget too) */
        if (hl_sampler_sleep_until(&s->sampler, next))
            next = hl_now_ns();
    }
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
   Python methods */

static window *window_of(hl_host_sampler *s, int id) {
    for (size_t i = 0; i < s->windows_n; i++)
        if (s->windows[i].id == id)
            return &s->windows[i];
    return NULL;
}

static void close_window(hl_host_sampler *s, window *w) {
    if (!w->open)
        return;
    w->open = 0;
    w->closed = hl_seconds(hl_now_ns());
    w->at_close = s->sum;
    if (w->whole_ticks == 0 && s->last_whole.valid) { /* NOTE [ Sampler windows ]: a run shorter than a round */
        const hl_host_sample *h = &s->last_whole.host;
        if (w->at_close.ticks == w->at_open.ticks) {
            window_tick(s, w, h, &s->last_whole.machine, s->last_whole.machine_ok, s->given, s->given_n,
                        s->last_whole.readings, s->last_whole.n);
        } else { /* its ticks read RSS alone: the peak is the last whole sum's */
            w->peak_tree_pss = h->tree_pss;
            w->peak_main_pss = h->main_pss;
            w->peak_tree_rss = h->tree_rss;
            w->peak_processes = h->processes;
            w->peak_t = h->t;
        }
        w->before = 1;
    }
    /* a process that exited after the last tick is gone at the end too (a stat read each: cheap) */
    for (size_t i = 0; i < w->table_n; i++) {
        proc_record *r = &w->table[i];
        if (r->alive && !hl_proc_alive(r->pid)) {
            r->alive = 0;
            r->gone_t = w->closed;
        }
    }
    hl_sampler_window_closed(&s->sampler);
}

static void free_window(hl_host_sampler *s, int id) {
    window *w = window_of(s, id);
    if (w == NULL)
        return;
    close_window(s, w);
    free(w->table);
    *w = s->windows[--s->windows_n];
}

/* Open a window, starting the thread when `start` (the caller decided, with the GIL: the first window in this
   process; a forked child starts its own). Without the GIL. The window's id, or -1 with errno set. */
static int open_window(hl_host_sampler *s, int start) {
    int pid = (int)getpid();
    if (start) {
        s->main_pid = s->root ? s->root : pid; /* after a fork, the child watches its own tree */
        s->main_cmdline_n = hl_read_proc_cmdline(s->main_pid, s->main_cmdline, sizeof(s->main_cmdline));
        s->previous_n = s->descendants_n = 0;
        s->next_scan = s->next_round = 0;
        pthread_mutex_lock(&s->sampler.lock);
        for (size_t i = 0; i < s->windows_n; i++) /* a forked child's copies of its parent's windows */
            free(s->windows[i].table);
        s->windows_n = 0;
        s->last_whole.valid = 0;
        pthread_mutex_unlock(&s->sampler.lock);
    }
    pthread_mutex_lock(&s->sampler.lock);
    int id = -1;
    if (grow((void **)&s->windows, &s->windows_cap, s->windows_n + 1, sizeof(window)) == 0) {
        window *w = &s->windows[s->windows_n++];
        memset(w, 0, sizeof(*w));
        w->id = id = ++s->next_id;
        w->open = 1;
        w->opened = hl_seconds(hl_now_ns());
        w->at_open = s->sum;
        hl_sampler_window_opened(&s->sampler);
    } else {
        errno = ENOMEM;
    }
    pthread_mutex_unlock(&s->sampler.lock);
    if (id < 0 || !start)
        return id;
    int err = hl_sampler_start(&s->sampler, sampler_main, s);
    if (err != 0) {
        pthread_mutex_lock(&s->sampler.lock);
        free_window(s, id);
        pthread_mutex_unlock(&s->sampler.lock);
        errno = err;
        return -1;
    }
    /* the process's first window waits for the thread's first (whole) tick, so that even a run shorter than a
       tick has figures; later windows do not wait (NOTE [ Sampler windows ]) */
    for (int waited_ms = 0; waited_ms < 2000; waited_ms++) {
        pthread_mutex_lock(&s->sampler.lock);
        int ticked = s->last_whole.valid;
        pthread_mutex_unlock(&s->sampler.lock);
        if (ticked)
            break;
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    return id;
}

PyDoc_STRVAR(open_window_doc, "open_window() -> int\n\nOpen a window on the sampler (its thread starts with the "
                              "first window in this process and\nsleeps while none is open) and return its id: "
                              "close_window(id) gives its figures.");

static PyObject *sampler_open_window(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    hl_host_sampler *s = (hl_host_sampler *)self;
    int id;
    /* decided with the GIL: of two threads opening the process's first windows at once, one starts the thread */
    int start = !s->sampler.running && !s->starting;
    s->starting |= start;
    Py_BEGIN_ALLOW_THREADS
    id = open_window(s, start);
    Py_END_ALLOW_THREADS
    if (start)
        s->starting = 0;
    if (id < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(id);
}

PyDoc_STRVAR(start_doc, "start()\n\nOpen the default window (the one snapshot() reads without an id). "
                        "RuntimeError if it is open.");

/* whether start()'s window is open (in this process: a forked child's copy has no thread) */
static int default_open(hl_host_sampler *s) {
    pthread_mutex_lock(&s->sampler.lock);
    const window *w = window_of(s, s->default_window);
    int open = w != NULL && w->open && s->sampler.running;
    pthread_mutex_unlock(&s->sampler.lock);
    return open;
}

static PyObject *sampler_start(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    hl_host_sampler *s = (hl_host_sampler *)self;
    if (default_open(s)) {
        PyErr_SetString(PyExc_RuntimeError, "HostSampler.start(): already running; call stop() first");
        return NULL;
    }
    pthread_mutex_lock(&s->sampler.lock);
    free_window(s, s->default_window); /* the last run's figures */
    pthread_mutex_unlock(&s->sampler.lock);
    PyObject *id = sampler_open_window(self, NULL);
    if (id == NULL)
        return NULL;
    s->default_window = (int)PyLong_AsLong(id);
    Py_DECREF(id);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(stop_doc, "stop()\n\nClose the default window (its figures stay for snapshot() until the next start()). "
                       "Does nothing\nwhen it is not open.");

static PyObject *sampler_stop(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    hl_host_sampler *s = (hl_host_sampler *)self;
    pthread_mutex_lock(&s->sampler.lock);
    window *w = window_of(s, s->default_window);
    if (w != NULL)
        close_window(s, w);
    pthread_mutex_unlock(&s->sampler.lock);
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
    pthread_mutex_lock(&s->sampler.lock);
    memcpy(s->given, pids, (size_t)n * sizeof(int));
    s->given_n = (size_t)n;
    pthread_mutex_unlock(&s->sampler.lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* what snapshot() copies under the lock, turned into Python objects once the GIL is back */
typedef struct {
    char *host, *procs;
    size_t host_n, procs_n;
    proc_record *table;
    size_t table_n;
    window w;   /* a copy of the window's figures (its table is `table`) */
    totals now; /* the sampler's totals at the copy, for a window still open */
} snapshot_copy;

/* the ring's items inside [t0, t1], copied out */
static char *copy_between(const sample_ring *r, double t0, double t1, size_t *n) {
    size_t from = ring_index_at(r, t0), to = ring_index_at(r, t1);
    *n = to > from ? to - from : 0;
    char *out = malloc(*n * r->item + 1);
    if (out != NULL)
        ring_copy_range(r, out, from, *n);
    return out;
}

/* 0, 1 when there is no such window, -1 when memory runs out */
static int take_copy(hl_host_sampler *s, int id, double since, snapshot_copy *c) {
    pthread_mutex_lock(&s->sampler.lock);
    const window *w = window_of(s, id);
    if (w == NULL) {
        pthread_mutex_unlock(&s->sampler.lock);
        return 1;
    }
    c->w = *w;
    c->now = s->sum;
    double t0 = since > w->opened ? since : w->opened, t1 = w->open ? 1e300 : w->closed;
    c->host = copy_between(&s->host, t0, t1, &c->host_n);
    c->procs = copy_between(&s->procs, t0, t1, &c->procs_n);
    c->table_n = w->table_n;
    c->table = malloc(c->table_n * sizeof(proc_record) + 1);
    if (c->table != NULL && c->table_n > 0)
        memcpy(c->table, w->table, c->table_n * sizeof(proc_record));
    pthread_mutex_unlock(&s->sampler.lock);
    return c->host && c->procs && c->table ? 0 : -1;
}

static PyObject *process_dict(const proc_record *r, double tick_s) {
    return Py_BuildValue("{s:i, s:i, s:O, s:O, s:O, s:O, s:s, s:d, s:d, s:N, s:K, s:K, s:K, s:K, s:K, s:K, s:K, s:K, "
                         "s:K, s:d, s:d, s:d, s:d, s:d, s:d, s:K}",
                         "pid", r->pid, "ppid", r->ppid, "alive", r->alive ? Py_True : Py_False, "given",
                         r->given ? Py_True : Py_False, "unreadable", r->unreadable ? Py_True : Py_False, "forked",
                         r->forked ? Py_True : Py_False, "comm", r->comm, "first_t", r->first_t, "last_t", r->last_t,
                         "gone_t", r->alive ? Py_NewRef(Py_None) : PyFloat_FromDouble(r->gone_t), "first_pss",
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
             "snapshot(window=None, since=0.0) -> dict or None\n\n"
             "One window's figures (window: an id from open_window(); None: the default window of start()/stop()),\n"
             "None when there is no such window. host: bytes of packed per-tick records inside the window and from\n"
             "`since` (time.monotonic() seconds) on (f8 t,\n"
             "u8 tree_pss, tree_rss, tree_uss, tree_swap, main_pss, main_rss, main_locked, available, swap_used,\n"
             "u4 processes, u2 unreadable, u2 whole); procs: one record per process per tick (f8 t, i4 pid, i4 ppid,\n"
             "u8 rss, pss, uss, swap); processes: a dict per process seen (first, last and peak readings, least-\n"
             "squares sums of its USS in MiB over seconds since its first reading, CPU seconds between them, its\n"
             "command name, whether it was forked without an exec, whether it could not be read); and statistics\n"
             "over every tick of the window, kept or dropped (before: it closed before its first tick, and its\n"
             "figures are the last whole tick's before it). Bytes, and time.monotonic() seconds. Works while open.");

static PyObject *window_snapshot(hl_host_sampler *s, int id, double since) {
    snapshot_copy c = {0};
    PyObject *result = NULL, *host = NULL, *procs = NULL, *processes = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = take_copy(s, id, since, &c);
    Py_END_ALLOW_THREADS
    if (rc == 1)
        Py_RETURN_NONE;
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
    const window *w = &c.w;
    totals a = w->at_open, b = w->open ? c.now : w->at_close;
    uint64_t ticks = b.ticks - a.ticks;
    result = Py_BuildValue("{s:O, s:O, s:O, s:O, s:i, s:d, s:d, s:d, s:K, s:K, s:K, s:K, s:K, s:K, s:K, s:I, s:d,"
                           " s:K, s:d, s:K, s:K, s:K, s:d, s:d, s:K, s:d, s:K, s:d, s:K, s:I, s:O}",
                           "host", host, "procs", procs, "processes", processes, "running",
                           w->open ? Py_True : Py_False, "main_pid", s->main_pid, "started", w->opened, "stopped",
                           w->closed, "interval_s", hl_seconds(s->interval_ns), "ticks", (unsigned long long)ticks,
                           "ticks_missed", (unsigned long long)(b.ticks_missed - a.ticks_missed), "scans",
                           (unsigned long long)(b.scans - a.scans), "errors", (unsigned long long)(b.errors - a.errors),
                           "peak_tree_pss", (unsigned long long)w->peak_tree_pss, "peak_main_pss",
                           (unsigned long long)w->peak_main_pss, "peak_tree_rss", (unsigned long long)w->peak_tree_rss,
                           "peak_processes", (unsigned int)w->peak_processes, "peak_t", w->peak_t, "min_available",
                           (unsigned long long)w->min_available, "min_available_t", w->min_available_t,
                           "max_swap_used", (unsigned long long)w->max_swap_used, "total",
                           (unsigned long long)w->total, "swap_total", (unsigned long long)w->swap_total, "read_s",
                           hl_seconds(b.read_ns - a.read_ns), "scan_s", hl_seconds(b.scan_ns - a.scan_ns),
                           "host_dropped", (unsigned long long)(ticks > c.host_n ? ticks - c.host_n : 0),
                           "pss_s", hl_seconds(b.round_ns - a.round_ns),
                           "rounds", (unsigned long long)(b.rounds - a.rounds), "pss_budget", s->pss_budget,
                           "whole_ticks", (unsigned long long)w->whole_ticks, "unreadable_max",
                           (unsigned int)w->unreadable_max, "before", w->before ? Py_True : Py_False);
error:
    Py_XDECREF(host);
    Py_XDECREF(procs);
    Py_XDECREF(processes);
    free(c.host);
    free(c.procs);
    free(c.table);
    return result;
}

static PyObject *sampler_snapshot(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"window", "since", NULL};
    PyObject *id = Py_None;
    double since = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|Od:snapshot", keywords, &id, &since))
        return NULL;
    hl_host_sampler *s = (hl_host_sampler *)self;
    if (id != Py_None && !PyLong_Check(id))
        return PyErr_Format(PyExc_TypeError, "snapshot(): expected a window id from open_window(), got %R", id);
    return window_snapshot(s, id == Py_None ? s->default_window : (int)PyLong_AsLong(id), since);
}

PyDoc_STRVAR(close_window_doc, "close_window(id) -> dict or None\n\nClose the window `id` and return its snapshot() "
                               "(None when there is no such window).");

static PyObject *sampler_close_window(PyObject *self, PyObject *arg) {
    hl_host_sampler *s = (hl_host_sampler *)self;
    long id = PyLong_Check(arg) ? PyLong_AsLong(arg) : -1;
    if (id <= 0 || id > INT32_MAX) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "close_window(): expected a window id from open_window(), got %R", arg);
        return NULL;
    }
    pthread_mutex_lock(&s->sampler.lock);
    window *w = window_of(s, (int)id);
    if (w != NULL)
        close_window(s, w);
    pthread_mutex_unlock(&s->sampler.lock);
    PyObject *snapshot = window_snapshot(s, (int)id, 0.0);
    pthread_mutex_lock(&s->sampler.lock);
    free_window(s, (int)id);
    pthread_mutex_unlock(&s->sampler.lock);
    return snapshot;
}

static PyObject *get_running(PyObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(default_open((hl_host_sampler *)self));
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
    {"running", get_running, NULL, "whether the default window (start()/stop()) is open", NULL},
    {"interval_ms", get_interval_ms, NULL, "the tick, milliseconds", NULL},
    {"scan_interval_ms", get_scan_interval_ms, NULL, "the least time between scans of /proc for descendants, ms", NULL},
    {"tree", get_tree, NULL, "whether every descendant of this process is watched", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef sampler_methods[] = {
    {"start", sampler_start, METH_NOARGS, start_doc},
    {"stop", sampler_stop, METH_NOARGS, stop_doc},
    {"set_pids", sampler_set_pids, METH_O, set_pids_doc},
    {"snapshot", (PyCFunction)(void (*)(void))sampler_snapshot, METH_VARARGS | METH_KEYWORDS, snapshot_doc},
    {"open_window", sampler_open_window, METH_NOARGS, open_window_doc},
    {"close_window", sampler_close_window, METH_O, close_window_doc},
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
    s->given = malloc(HL_HOST_MAX_GIVEN * sizeof(int));
    /* the process ring holds a tick's records for HL_HOST_PROCS_PER_TICK processes on average */
    if (s->given == NULL || ring_init(&s->host, sizeof(hl_host_sample), (size_t)capacity) < 0 ||
        ring_init(&s->procs, sizeof(hl_proc_sample), (size_t)capacity * HL_HOST_PROCS_PER_TICK) < 0) {
        Py_DECREF(s); /* dealloc frees what was allocated */
        return PyErr_NoMemory();
    }
    if (hl_sampler_init(&s->sampler) < 0) {
        Py_DECREF(s);
        return PyErr_NoMemory();
    }
    s->sampler.idles = 1; /* NOTE [ Sampler windows ] */
    s->children_listed = hl_children_listed();
    s->ready = 1;
    return (PyObject *)s;
}

static void sampler_dealloc(PyObject *self) {
    hl_host_sampler *s = (hl_host_sampler *)self;
    PyTypeObject *type = Py_TYPE(self);
    if (s->ready) {
        Py_BEGIN_ALLOW_THREADS
        hl_sampler_destroy(&s->sampler);
        Py_END_ALLOW_THREADS
    }
    for (size_t i = 0; i < s->windows_n; i++)
        free(s->windows[i].table);
    free(s->windows);
    free(s->last_whole.readings);
    ring_free(&s->host);
    ring_free(&s->procs);
    free(s->given);
    free(s->descendants);
    free(s->scan);
    free(s->readings);
    free(s->previous);
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
             "core. Monitors open windows on it (open_window(), close_window(); start() and stop() the default one):\n"
             "its thread starts with the first and sleeps while none is open. The ring keeps the newest `capacity`\n"
             "ticks; each window's peaks and per-process figures cover every tick of it. Linux only.");

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
