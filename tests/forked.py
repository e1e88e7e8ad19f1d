"""Waiting for a child the test forked, bounded: a child that hangs fails the test instead of hanging CI."""
import os
import time


def wait_for_child(pid, timeout=15.0):
    """The child's exit code, or None if it still runs after `timeout` (then killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None
