"""gpu_decode's loader taking batches as fast as it makes them, in one thread, while another thread
runs ResNet-50 AMP training steps on the same GPU (the bench's "decoder working beside it, flat out"
row). On the H200 such runs hung: first inside nvjpeg's batched hardware decode, then, with the
decode on a stream of its own, waiting for a worker's batch (the launcher's workers collecting
inherited CUDA memory under a lock held at the fork: worker/inherited_garbage.py). Each attempt here
must come back within JOIN_S of being stopped, and so must each training step (the GPU's queue is
polled, not waited on: a step stuck behind a hung decode must fail the test, not block it). A hang
fails the test with where every thread below this process waits, and the stacks of this process's
threads and of the workers'. A hang that rare can pass by chance: ATTEMPTS repeats it (5 s each)."""
import faulthandler
import glob
import os
import signal
import tempfile
import threading
import time

import pytest
import torch
from torchvision.datasets import ImageFolder

import hotloop

from .conftest import descendant_states
from .image_folders import TRAIN_V1, make_folder

pytestmark = pytest.mark.gpu

ATTEMPTS = 8
JOIN_S = 30
HANG_GUARD_S = ATTEMPTS * (JOIN_S + 10) + 60  # conftest's hang_guard: past this test's own limit


_dump_files = []  # a worker's file for faulthandler, open for the worker's life


def _dump_stacks_on_sigusr1(folder):
    def init(worker_id):
        f = open(os.path.join(folder, f"worker-{os.getpid()}.txt"), "w")
        _dump_files.append(f)
        faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
    return init


def _stacks(folder):
    """Where every thread below this process waits in the kernel, every thread's stack here, then
    each live worker's (they dump theirs on SIGUSR1)."""
    states = descendant_states()
    paths = sorted(glob.glob(os.path.join(folder, "worker-*.txt")))
    for path in paths:
        try:
            os.kill(int(os.path.basename(path)[7:-4]), signal.SIGUSR1)
        except OSError:  # gone: an earlier attempt's
            pass
    time.sleep(1)
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        text = states + "\n" + f.read()
    for path in paths:
        with open(path) as f:
            text += f"\n{os.path.basename(path)}:\n{f.read()}"
    return text


def _step_done_within(seconds):
    """Whether the current stream's work finished within `seconds` (polled: never blocks for good)."""
    stream, limit = torch.cuda.current_stream(), time.perf_counter() + seconds
    while not stream.query():
        if time.perf_counter() > limit:
            return False
        time.sleep(0.001)
    return True


def test_loader_flat_out_beside_training_steps_comes_back(tmp_path):
    from hotloop.bench.loader import resnet_step

    root = make_folder(str(tmp_path / "images"), n=256, classes=4, sizes=(300, 640))
    dumps = tmp_path / "stacks"
    dumps.mkdir()
    ds = ImageFolder(root, transform=TRAIN_V1(224))
    ds.samples = ds.samples * 4  # 4 batches an epoch
    step = resnet_step("cuda")
    x = torch.randn(256, 3, 224, 224, device="cuda").to(torch.float16, memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (256,), device="cuda")
    for attempt in range(ATTEMPTS):
        stop, taken, failed = threading.Event(), [], []

        def take_flat_out():
            try:
                take_until_stopped()
            except BaseException as exc:
                failed.append(exc)

        def take_until_stopped():
            loader = hotloop.DataLoader(ds, batch_size=256, shuffle=True, num_workers=4, drop_last=True,
                                        device="cuda", gpu_decode=hotloop.GpuDecode(dtype=torch.float16,
                                                                                    channels_last=True),
                                        worker_init_fn=_dump_stacks_on_sigusr1(str(dumps)))
            while not stop.is_set():
                for batch, _ in loader:
                    taken.append(batch.shape[0])
                    if stop.is_set():
                        break

        thread = threading.Thread(target=take_flat_out, daemon=True)
        thread.start()
        deadline = time.perf_counter() + 5
        while time.perf_counter() < deadline:
            step(x, y)
            assert _step_done_within(JOIN_S), (f"attempt {attempt + 1}: a training step did not finish within "
                                               f"{JOIN_S} s, after {len(taken)} batches\n{_stacks(str(dumps))}")
        stop.set()
        thread.join(JOIN_S)
        assert not thread.is_alive(), (f"attempt {attempt + 1}: the loader's thread did not come back within "
                                       f"{JOIN_S} s of being stopped, after {len(taken)} batches\n{_stacks(str(dumps))}")
        assert not failed, f"attempt {attempt + 1}: the loader raised {failed[0]!r}"
        assert taken and set(taken) == {256}, f"attempt {attempt + 1}: batches taken {taken}"
