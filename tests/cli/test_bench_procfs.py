"""hotloop.bench.procfs: the process tree and CPU times read from /proc, as the image bench and the loader
tests' hang reports use them."""
import os
import subprocess
import sys
import time

import pytest

from hotloop.bench.procfs import descendants, process_stats

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")

# a child that spins on the CPU in a thread and forks a grandchild (which only waits), both until stdin
# closes; the grandchild's pid on stdout
TREE = """
import os, sys, threading
def spin():
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
pid = os.fork()
if pid == 0:
    sys.stdin.read()
    os._exit(0)
print(pid, flush=True)
sys.stdin.read()
os.waitpid(pid, 0)
"""


def test_descendants_are_children_then_theirs_with_their_cpu_time():
    child = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        time.sleep(0.5)  # the child spins meanwhile (a fork copies only the forking thread)
        stats = process_stats()
        below = descendants(stats, os.getpid())
        assert below.index(child.pid) < below.index(grandchild), below
        assert int(stats[grandchild][1]) == child.pid and int(stats[child.pid][1]) == os.getpid()
        assert descendants(stats, grandchild) == []
        ticks = int(stats[child.pid][11]) + int(stats[child.pid][12])
        assert ticks / os.sysconf("SC_CLK_TCK") > 0.1, stats[child.pid]  # the child's spinning thread
    finally:
        child.stdin.close()
        child.wait(10)
    assert child.pid not in descendants(process_stats(), os.getpid())
