"""This process's descendants as Linux's /proc shows them: the image bench counts their CPU time, and
the loader tests say where each of their threads waits when a loader hangs."""
import os


def process_stats():
    """{pid: the fields of /proc/<pid>/stat after the command name} for every process readable now:
    [0] the state, [1] the parent's pid, [11] and [12] user and system time in clock ticks."""
    stats = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                # the command name, in parentheses, may hold spaces and parentheses itself
                stats[int(pid)] = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
    return stats


def descendants(stats, root):
    """The pids below `root` in `stats` (process_stats()), children first, then theirs."""
    found, generation = [], {root}
    while generation:
        generation = {pid for pid, fields in stats.items() if int(fields[1]) in generation}
        found += sorted(generation)
    return found
