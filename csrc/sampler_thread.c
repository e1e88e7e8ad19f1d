/* The sampler thread skeleton (sampler_thread.h): start, wake-and-join stop, the monotonic sleep, fork handlers. */
#include "sampler_thread.h"

#include <errno.h>
#include <time.h>

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static hl_sampler_thread *registry;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

/* fork: hold every lock across it so the child's copies are consistent; the child has none of the parent's
   threads, so its samplers are simply stopped there (a later start() begins a thread of its own) */
static void before_fork(void) {
    pthread_mutex_lock(&registry_lock);
    for (hl_sampler_thread *t = registry; t != NULL; t = t->next)
        pthread_mutex_lock(&t->lock);
}

static void after_fork_parent(void) {
    for (hl_sampler_thread *t = registry; t != NULL; t = t->next)
        pthread_mutex_unlock(&t->lock);
    pthread_mutex_unlock(&registry_lock);
}

static int init_wake(pthread_cond_t *wake) {
    pthread_condattr_t attr;
    if (pthread_condattr_init(&attr) != 0)
        return -1;
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(wake, &attr);
    pthread_condattr_destroy(&attr);
    return rc == 0 ? 0 : -1;
}

static void after_fork_child(void) {
    for (hl_sampler_thread *t = registry; t != NULL; t = t->next) {
        pthread_mutex_init(&t->lock, NULL);
        init_wake(&t->wake);
        t->running = 0;
        t->stopping = 0;
        t->windows = 0;
    }
    pthread_mutex_init(&registry_lock, NULL);
}

static void install_fork_handlers(void) { pthread_atfork(before_fork, after_fork_parent, after_fork_child); }

int64_t hl_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

double hl_seconds(int64_t ns) { return (double)ns * 1e-9; }

int hl_sampler_init(hl_sampler_thread *t) {
    if (pthread_mutex_init(&t->lock, NULL) != 0)
        return -1;
    if (init_wake(&t->wake) < 0) {
        pthread_mutex_destroy(&t->lock);
        return -1;
    }
    t->running = t->stopping = t->windows = 0;
    pthread_once(&atfork_once, install_fork_handlers);
    pthread_mutex_lock(&registry_lock);
    t->prev = NULL;
    t->next = registry;
    if (registry != NULL)
        registry->prev = t;
    registry = t;
    t->registered = 1;
    pthread_mutex_unlock(&registry_lock);
    return 0;
}

void hl_sampler_destroy(hl_sampler_thread *t) {
    if (!t->registered)
        return;
    hl_sampler_stop(t);
    pthread_mutex_lock(&registry_lock);
    if (t->prev)
        t->prev->next = t->next;
    else if (registry == t)
        registry = t->next;
    if (t->next)
        t->next->prev = t->prev;
    t->registered = 0;
    pthread_mutex_unlock(&registry_lock);
    pthread_cond_destroy(&t->wake);
    pthread_mutex_destroy(&t->lock);
}

int hl_sampler_start(hl_sampler_thread *t, void *(*body)(void *), void *arg) {
    pthread_mutex_lock(&t->lock);
    t->stopping = 0;
    pthread_mutex_unlock(&t->lock);
    int err = pthread_create(&t->thread, NULL, body, arg);
    t->running = err == 0;
    return err;
}

void hl_sampler_stop(hl_sampler_thread *t) {
    if (!t->running)
        return;
    pthread_mutex_lock(&t->lock);
    t->stopping = 1;
    pthread_cond_broadcast(&t->wake);
    pthread_mutex_unlock(&t->lock);
    pthread_join(t->thread, NULL);
    t->running = 0;
}

int hl_sampler_stopping(hl_sampler_thread *t) {
    pthread_mutex_lock(&t->lock);
    int stopping = t->stopping;
    pthread_mutex_unlock(&t->lock);
    return stopping;
}

int hl_sampler_sleep_until(hl_sampler_thread *t, int64_t deadline) {
    struct timespec ts = {.tv_sec = deadline / 1000000000, .tv_nsec = deadline % 1000000000};
    int waited = 0;
    pthread_mutex_lock(&t->lock);
    while (!t->stopping && t->idles && t->windows == 0) { /* nothing to watch: no tick costs anything */
        pthread_cond_wait(&t->wake, &t->lock);
        waited = 1;
    }
    while (!waited && !t->stopping && hl_now_ns() < deadline) {
        int rc = pthread_cond_timedwait(&t->wake, &t->lock, &ts);
        if (rc != 0 && rc != EINTR)
            break; /* ETIMEDOUT: the deadline */
    }
    pthread_mutex_unlock(&t->lock);
    return waited;
}

void hl_sampler_window_opened(hl_sampler_thread *t) {
    if (t->windows++ == 0)
        pthread_cond_broadcast(&t->wake);
}

void hl_sampler_window_closed(hl_sampler_thread *t) {
    if (t->windows > 0)
        t->windows--;
}

int64_t hl_sampler_next_tick(hl_sampler_thread *t, int64_t next, int64_t interval, uint64_t *missed) {
    next += interval;
    int64_t now = hl_now_ns();
    if (next < now) {
        int64_t skipped = (now - next) / interval + 1;
        next += skipped * interval;
        pthread_mutex_lock(&t->lock);
        *missed += (uint64_t)skipped;
        pthread_mutex_unlock(&t->lock);
    }
    return next;
}
