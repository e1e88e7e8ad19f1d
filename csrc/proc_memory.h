/* Reading a process's and the machine's memory from Linux's /proc, without the GIL or Python. */
#ifndef HOTLOOP_PROC_MEMORY_H
#define HOTLOOP_PROC_MEMORY_H

#include <stddef.h>
#include <stdint.h>

/* One process's memory, in bytes, from /proc/PID/smaps_rollup. */
typedef struct {
    uint64_t rss;    /* resident: pages shared with other processes counted in full */
    uint64_t pss;    /* proportional: a page shared by n processes counts 1/n; sums to the tree's real use */
    uint64_t uss;    /* unique: Private_Clean + Private_Dirty, what the process alone holds */
    uint64_t swap;   /* SwapPss: its share of what is swapped out */
    uint64_t locked; /* Locked: page-locked (mlock) */
} hl_proc_memory;

/* The machine's memory, in bytes, from /proc/meminfo. */
typedef struct {
    uint64_t total, available, swap_total, swap_free;
} hl_machine_memory;

/* One process's line of /proc/PID/stat. */
typedef struct {
    int pid, ppid;
    uint64_t cpu_ticks; /* utime + stime, in clock ticks */
    char comm[16];      /* the command name (the kernel keeps 15 characters) */
} hl_proc_stat;

/* 0 and `out` filled, or -1 (the process is gone, or its memory cannot be read). From smaps_rollup,
   or where the kernel has none (before 4.14, some sandboxes) the sums of smaps; rollup=0: smaps. */
int hl_read_proc_memory(int pid, hl_proc_memory *out);
int hl_read_proc_memory_from(int pid, hl_proc_memory *out, int rollup);
int hl_read_machine_memory(hl_machine_memory *out);
/* RSS alone from /proc/PID/statm: a small fraction of smaps_rollup's cost, which walks every page table */
int hl_read_proc_rss(int pid, uint64_t *rss);
int hl_read_proc_stat(int pid, hl_proc_stat *out);
/* 1 while the process has not exited (a zombie has), else 0: a process whose memory cannot be read (another
   user's) is alive and unreadable, not gone */
int hl_proc_alive(int pid);
/* /proc/PID/cmdline into `buf` (NUL-separated arguments, truncated to `size`); its length, or -1 */
long hl_read_proc_cmdline(int pid, char *buf, size_t size);

/* Whether the kernel lists each thread's children (/proc/PID/task/TID/children, CONFIG_PROC_CHILDREN). */
int hl_children_listed(void);
/* Append the children of `pid` (every thread's) to `*pids` (grown with realloc, freed by the caller): a handful of
   small reads, where a scan of /proc reads a file per process of the machine. 0, or -1 when memory runs out; a
   process that is gone has none. */
int hl_append_children(int pid, int **pids, size_t *n, size_t *capacity);

/* Every process readable in /proc now: fills `*stats` (grown with realloc; the caller
   frees it with free) and returns how many, or -1 when /proc cannot be listed or memory
   runs out. Safe without the GIL. */
long hl_scan_processes(hl_proc_stat **stats, size_t *capacity);

#endif
