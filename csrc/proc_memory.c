/* Reading a process's and the machine's memory from Linux's /proc: plain read(2) into stack buffers,
   no stdio and no Python, so the host sampler's thread calls it without the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "proc_memory.h"

#include <dirent.h>
#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The whole of a small /proc file into `buf` (NUL-terminated); its length, or -1. */
static long read_small_file(const char *path, char *buf, size_t size) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t n = 0;
    while (n + 1 < size) {
        ssize_t got = read(fd, buf + n, size - 1 - n);
        if (got < 0) {
            close(fd);
            return -1;
        }
        if (got == 0)
            break;
        n += (size_t)got;
    }
    close(fd);
    buf[n] = '\0';
    return (long)n;
}

/* The value of "key:   123 kB" in `text`, in bytes; 0 where the key is absent. */
static uint64_t kib_field(const char *text, const char *key) {
    size_t len = strlen(key);
    for (const char *p = text; p != NULL;) {
        if (strncmp(p, key, len) == 0 && p[len] == ':')
            return strtoull(p + len + 1, NULL, 10) * 1024;
        p = strchr(p, '\n');
        if (p != NULL)
            p++;
    }
    return 0;
}

/* add one "Key:   123 kB" line of /proc/PID/smaps to the sums */
static void add_smaps_line(const char *line, hl_proc_memory *out) {
    static const struct {
        const char *key;
        size_t offset;
    } keys[] = {{"Rss:", offsetof(hl_proc_memory, rss)},
                {"Pss:", offsetof(hl_proc_memory, pss)},
                {"Private_Clean:", offsetof(hl_proc_memory, uss)},
                {"Private_Dirty:", offsetof(hl_proc_memory, uss)},
                {"SwapPss:", offsetof(hl_proc_memory, swap)},
                {"Locked:", offsetof(hl_proc_memory, locked)}};
    for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); k++) {
        size_t len = strlen(keys[k].key);
        if (strncmp(line, keys[k].key, len) == 0) {
            *(uint64_t *)((char *)out + keys[k].offset) += strtoull(line + len, NULL, 10) * 1024;
            return;
        }
    }
}

/* The same sums from /proc/PID/smaps, a block per mapping: for kernels (before 4.14) and sandboxes
   without smaps_rollup. Read in chunks, line by line. */
static int read_smaps_sums(int pid, hl_proc_memory *out) {
    char path[64], buf[16384];
    snprintf(path, sizeof(path), "/proc/%d/smaps", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    memset(out, 0, sizeof(*out));
    size_t have = 0;
    int lines = 0;
    for (;;) {
        ssize_t got = read(fd, buf + have, sizeof(buf) - 1 - have);
        if (got < 0) {
            close(fd);
            return -1;
        }
        have += (size_t)got;
        buf[have] = '\0';
        char *line = buf, *end;
        while ((end = strchr(line, '\n')) != NULL) {
            *end = '\0';
            add_smaps_line(line, out);
            lines++;
            line = end + 1;
        }
        size_t rest = have - (size_t)(line - buf);
        if (got == 0 || rest == sizeof(buf) - 1) /* the end, or a line longer than the buffer: dropped */
            break;
        memmove(buf, line, rest);
        have = rest;
    }
    close(fd);
    return lines > 0 ? 0 : -1; /* empty: a zombie, or a process whose memory is already gone */
}

int hl_read_proc_memory_from(int pid, hl_proc_memory *out, int rollup) {
    if (!rollup)
        return read_smaps_sums(pid, out);
    char path[64], buf[4096];
    snprintf(path, sizeof(path), "/proc/%d/smaps_rollup", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) /* no smaps_rollup here (a process that is gone has no smaps either) */
        return errno == ENOENT ? read_smaps_sums(pid, out) : -1;
    close(fd);
    /* an empty file: a zombie, or a process whose memory is already gone */
    if (read_small_file(path, buf, sizeof(buf)) <= 0 || strstr(buf, "Rss:") == NULL)
        return -1;
    out->rss = kib_field(buf, "Rss");
    out->pss = kib_field(buf, "Pss");
    out->uss = kib_field(buf, "Private_Clean") + kib_field(buf, "Private_Dirty");
    out->swap = kib_field(buf, "SwapPss");
    out->locked = kib_field(buf, "Locked");
    return 0;
}

int hl_read_proc_memory(int pid, hl_proc_memory *out) { return hl_read_proc_memory_from(pid, out, 1); }

int hl_read_proc_rss(int pid, uint64_t *rss) {
    char path[64], buf[256];
    snprintf(path, sizeof(path), "/proc/%d/statm", pid);
    unsigned long long size = 0, resident = 0;
    if (read_small_file(path, buf, sizeof(buf)) <= 0 || sscanf(buf, "%llu %llu", &size, &resident) != 2)
        return -1;
    *rss = resident * (uint64_t)sysconf(_SC_PAGESIZE);
    return 0;
}

int hl_read_machine_memory(hl_machine_memory *out) {
    char buf[8192];
    if (read_small_file("/proc/meminfo", buf, sizeof(buf)) <= 0)
        return -1;
    out->total = kib_field(buf, "MemTotal");
    out->available = kib_field(buf, "MemAvailable");
    out->swap_total = kib_field(buf, "SwapTotal");
    out->swap_free = kib_field(buf, "SwapFree");
    return 0;
}

int hl_read_proc_stat(int pid, hl_proc_stat *out) {
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    if (read_small_file(path, buf, sizeof(buf)) <= 0)
        return -1;
    /* the command name, in parentheses, may hold spaces and parentheses itself: fields follow the last ')' */
    const char *p = strrchr(buf, ')');
    if (p == NULL)
        return -1;
    char state;
    int ppid;
    unsigned long long utime = 0, stime = 0;
    /* state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime stime */
    if (sscanf(p + 1, " %c %d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &state, &ppid, &utime, &stime) != 4)
        return -1;
    if (state == 'Z' || state == 'X') /* exited, not yet reaped: no memory left to read */
        return -1;
    out->pid = pid;
    out->ppid = ppid;
    out->cpu_ticks = utime + stime;
    const char *open_paren = strchr(buf, '(');
    size_t len = open_paren != NULL && p > open_paren ? (size_t)(p - open_paren - 1) : 0;
    len = len < sizeof(out->comm) - 1 ? len : sizeof(out->comm) - 1;
    memcpy(out->comm, open_paren != NULL ? open_paren + 1 : "", len);
    out->comm[len] = '\0';
    return 0;
}

int hl_proc_alive(int pid) {
    hl_proc_stat s;
    if (hl_read_proc_stat(pid, &s) == 0)
        return 1;
    /* stat unreadable although the process is there (a hardened /proc): alive as long as it can be signalled */
    char path[64], buf[8];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    return read_small_file(path, buf, sizeof(buf)) < 0 && errno == EACCES;
}

long hl_read_proc_cmdline(int pid, char *buf, size_t size) {
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/cmdline", pid);
    return read_small_file(path, buf, size);
}

int hl_children_listed(void) {
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/task/%d/children", (int)getpid(), (int)getpid());
    return access(path, R_OK) == 0;
}

int hl_append_children(int pid, int **pids, size_t *n, size_t *capacity) {
    char path[64], buf[4096];
    snprintf(path, sizeof(path), "/proc/%d/task", pid);
    DIR *dir = opendir(path);
    if (dir == NULL)
        return 0; /* gone */
    int rc = 0;
    struct dirent *e;
    while (rc == 0 && (e = readdir(dir)) != NULL) {
        if (e->d_name[0] < '1' || e->d_name[0] > '9')
            continue;
        snprintf(path, sizeof(path), "/proc/%d/task/%.16s/children", pid, e->d_name);
        if (read_small_file(path, buf, sizeof(buf)) < 0)
            continue; /* the thread ended meanwhile */
        for (char *p = buf, *end; *p; p = end) {
            long child = strtol(p, &end, 10);
            if (end == p)
                break;
            if (*n == *capacity) {
                size_t grown = *capacity ? *capacity * 2 : 64;
                int *more = realloc(*pids, grown * sizeof(int));
                if (more == NULL) {
                    rc = -1;
                    break;
                }
                *pids = more;
                *capacity = grown;
            }
            (*pids)[(*n)++] = (int)child;
        }
    }
    closedir(dir);
    return rc;
}

long hl_scan_processes(hl_proc_stat **stats, size_t *capacity) {
    DIR *dir = opendir("/proc");
    if (dir == NULL)
        return -1;
    long n = 0;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        if (e->d_name[0] < '1' || e->d_name[0] > '9')
            continue;
        int pid = atoi(e->d_name);
        hl_proc_stat s;
        if (pid <= 0 || hl_read_proc_stat(pid, &s) < 0)
            continue; /* gone meanwhile, or a zombie */
        if ((size_t)n == *capacity) {
            size_t grown = *capacity ? *capacity * 2 : 256;
            hl_proc_stat *more = realloc(*stats, grown * sizeof(hl_proc_stat));
            if (more == NULL) {
                closedir(dir);
                return -1;
            }
            *stats = more;
            *capacity = grown;
        }
        (*stats)[n++] = s;
    }
    closedir(dir);
    return n;
}
