"""Workers never collect what they inherit (worker/inherited_garbage.py): an object that was garbage in the
main process when the workers were forked is finalized once, in the main process, never in a worker
(where a CUDA object's finalizer aborted the worker or could block it for good); and the main
process's collector is left as it was: that garbage is still young there, a gen-0 collection frees it
(the memory monitor's tests caught a version whose gc.unfreeze() aged everything)."""
import gc
import os

import pytest
import torch
from torch.utils.data import Dataset

import hotloop


class CollectsInWorkers(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        gc.collect()  # a full collection in the worker
        return torch.tensor([i])


class Finalized:
    """Garbage once made: a cycle, which only the collector frees. Its finalizer notes the process."""

    def __init__(self, path):
        self.path = path
        self.me = self

    def __del__(self):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


@pytest.mark.parametrize("program_froze", [False, True], ids=["", "program-froze"])
@pytest.mark.parametrize("workers", [1, 3], ids=["worker-0", "launcher"])  # 0 forked here; 1.. by the launcher
def test_garbage_inherited_by_workers_is_finalized_only_here(tmp_path, workers, program_froze):
    path = tmp_path / "finalized"
    gc.disable()  # the garbage below stays uncollected here until the workers are forked
    try:
        if program_froze:
            gc.freeze()  # the program's own frozen set, made before the garbage
        frozen = gc.get_freeze_count()  # (Python 3.12 starts with a few hundred objects frozen)
        Finalized(str(path))
        loader = hotloop.DataLoader(CollectsInWorkers(), batch_size=2, num_workers=workers)
        got = sorted(int(x) for batch in loader for x in batch)
        # the main process's frozen set left to the program: not grown (a frozen object may die
        # meanwhile), nor unfrozen
        count = gc.get_freeze_count()
        assert count <= frozen and (count > frozen // 2 or not program_froze)
        gc.collect(0)
    finally:
        if program_froze:
            gc.unfreeze()
        gc.enable()
    assert got == list(range(12))
    assert path.read_text().split() == [str(os.getpid())]


@pytest.mark.parametrize("collector_on", [True, False], ids=["collector-on", "program-disabled-it"])
def test_workers_and_this_process_keep_the_collector_as_it_was(collector_on):
    """The collector, off around each fork so that none starts in a child before it froze what it
    inherited, is on again in the workers (they collect their own garbage) and here, unless the
    program had turned it off."""
    was = gc.isenabled()
    if not collector_on:
        gc.disable()
    try:
        loader = hotloop.DataLoader(CollectorState(), batch_size=2, num_workers=3)
        in_workers = {bool(x) for batch in loader for x in batch}
        here = gc.isenabled()
    finally:
        if was:
            gc.enable()
    assert in_workers == {collector_on} and here == collector_on


class CollectorState(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.tensor([gc.isenabled()])


frozen_in_worker = [0]  # the worker's frozen count, set by its init function


class ForksItself(Dataset):
    """Each sample: whether a child this worker forks collects, and whether it froze anything."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, bytes([gc.isenabled(), gc.get_freeze_count() > frozen_in_worker[0]]))
            os._exit(0)
        os.waitpid(pid, 0)
        state = os.read(r, 2)
        os.close(r)
        os.close(w)
        return torch.tensor(list(state))


def test_a_fork_made_by_a_worker_is_not_one_of_ours():
    """A dataset that forks in a worker (worker 0, forked by multiprocessing, and the launcher's):
    its child is left as the worker is, collector off if the worker turned it off, nothing frozen."""
    def init(worker_id):
        gc.disable()
        frozen_in_worker[0] = gc.get_freeze_count()

    loader = hotloop.DataLoader(ForksItself(), batch_size=1, num_workers=2, worker_init_fn=init)
    assert [b.tolist() for b in loader] == [[[0, 0]]] * 4
