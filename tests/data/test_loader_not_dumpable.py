"""Workers of a main process that is not dumpable get the ring: the memfd is handed down (inherited
across fork, or sent over a socket with SCM_RIGHTS), never reopened through /proc/<pid>/fd, which
refuses a worker once its parent called prctl(PR_SET_DUMPABLE, 0) or changed credentials (as some
schedulers and sandboxes do)."""
import os
import random
import signal
import subprocess
import sys

import pytest
import torch
from torch.utils.data import Dataset

from hotloop import _C

from ..seeding import current_seed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EPOCHS = 2
# each spawned or forkserver worker imports torch (~5 s here); the subprocess has its own timeout
HANG_GUARD_S = 200


class KillsOnce(Dataset):
    """Sample i: i and draws from the worker's torch generator. The worker that makes `victim`
    kills itself with SIGKILL the first time (marker: a file made then), after the ring exists."""

    def __init__(self, victim=-1, marker=""):
        self.victim, self.marker = victim, marker

    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i == self.victim and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.rand(6) + i, i


def run(method, marker, seed):
    """In the non-dumpable subprocess: torch's epochs and hotloop's (a worker killed in its first
    epoch), batch by batch, under the test's `seed`; prints what the pool did."""
    import hotloop
    from torch.utils.data import DataLoader as TorchDataLoader

    from tests.data.conftest import assert_same

    # batch 3 goes to worker 1 (a launched worker under fork), given only once the ring was made
    kw = dict(batch_size=4, num_workers=2, persistent_workers=True, multiprocessing_context=method)
    torch.manual_seed(seed)
    theirs = TorchDataLoader(KillsOnce(), generator=torch.Generator().manual_seed(seed + 5), **kw)
    ref = [list(theirs) for _ in range(EPOCHS)]
    torch.manual_seed(seed)
    loader = hotloop.DataLoader(KillsOnce(13, marker), generator=torch.Generator().manual_seed(seed + 5), **kw)
    for epoch in range(EPOCHS):
        got = list(loader)
        assert len(got) == len(ref[epoch]) == 10
        for a, b in zip(ref[epoch], got, strict=True):
            assert_same(a, b)
    print(f"restarts={loader.stats.worker_restarts} ring_bytes={loader.stats.ring_bytes}")


_SCRIPT = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
PR_GET_DUMPABLE, PR_SET_DUMPABLE, PR_CAPBSET_DROP, CAP_SYS_PTRACE = 3, 4, 24, 19
if os.geteuid() == 0:
    # root opens any /proc/<pid>/fd (CAP_SYS_PTRACE): without it, as any other user, it is refused.
    # dropped from the bounding set too, so that spawned workers (an exec) do not get it back
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Sets(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
    header, sets = Header(0x20080522, 0), (Sets * 2)()
    if libc.capget(ctypes.byref(header), sets) != 0 or libc.prctl(PR_CAPBSET_DROP, CAP_SYS_PTRACE, 0, 0, 0) != 0:
        sys.exit(f"capget/PR_CAPBSET_DROP failed: errno {ctypes.get_errno()}")
    for s in sets:
        s.effective &= ~(1 << CAP_SYS_PTRACE)
        s.permitted &= ~(1 << CAP_SYS_PTRACE)
    if libc.capset(ctypes.byref(header), sets) != 0:
        sys.exit(f"capset failed: errno {ctypes.get_errno()}")
if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 or libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) != 0:
    sys.exit("prctl(PR_SET_DUMPABLE, 0) failed")
from tests.data.test_loader_not_dumpable import run
run(sys.argv[1], sys.argv[2], int(sys.argv[3]))
"""


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_workers_of_a_main_process_that_is_not_dumpable(method, tmp_path):
    marker = str(tmp_path / "killed")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, method, marker, str(current_seed())], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert os.path.exists(marker)  # the victim did die: its successor needed the ring's fd too
    restarts, ring_bytes = (int(kv.split("=")[1]) for kv in proc.stdout.split())
    assert restarts == 1 and ring_bytes > 0, proc.stdout


def test_ring_attaches_by_fd():
    """Ring(fd=) maps the creator's memfd and owns that fd; an fd it refuses stays the caller's."""
    ring = _C.Ring(3, 5000)
    fd = os.dup(ring.fd)
    other = _C.Ring(3, 5000, fd=fd)
    data = random.randbytes(5000)
    other.view(2)[:5000] = data
    assert bytes(ring.view(2)[:5000]) == data and other.fd == fd
    other.close()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed with the ring that owned it
    for nslots, slot_bytes, error in [(4, 5000, "is smaller than"), (2, 8192, "is not a ring")]:
        fd = os.dup(ring.fd)
        with pytest.raises(ValueError, match=error):
            _C.Ring(nslots, slot_bytes, fd=fd)
        os.fstat(fd)  # still open: the caller's to close
        os.close(fd)
    with pytest.raises(ValueError, match="fd: expected"):
        _C.Ring(3, 5000, fd=-2)
    ring.close()
