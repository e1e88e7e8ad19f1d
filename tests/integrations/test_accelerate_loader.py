"""hotloop.integrations.accelerate.prepare_data_loader under 2 gloo processes, against Accelerate's own
prepare of torch's DataLoader: each process gets the batches Accelerate gives it (its shard, random
draws in workers included), through hotloop's loader (its class, stats, gpu_transform); save_state /
load_state resume it mid-epoch: the rest of the epoch and the next one equal the uninterrupted run's
(and, with num_workers=0, what Accelerate resumes of a torchdata StatefulDataLoader); accelerator.prepare()
on a bare hotloop.DataLoader warns that it is being replaced."""
import os
import warnings

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install hotloop[test])")

import hotloop  # noqa: E402

from ..distributed import run_ranks  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

WORKERS = "fork"  # the ranks are spawned; their loaders' workers fork, as torchrun's ranks would (tests/data)


class Rows(Dataset):
    """Sample i: i, a draw from the worker's torch RNG, and a small uint8 HWC image of i."""

    def __len__(self):
        return 37  # not a multiple of 2 processes x batch 3: Accelerate's even_batches wraps around

    def __getitem__(self, i):
        return i, torch.rand(2), torch.full((4, 5, 3), i, dtype=torch.uint8)


def accelerator(seed, **config):
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed
    set_seed(seed)  # the same global seed before prepare: Accelerate seeds the sampler's generator from it
    return Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))


def accelerator_and_model(seed, **config):
    """A new accelerator, and the model made before prepare(): the first thing each run draws from
    the global RNG, ahead of the seed Accelerate draws for the sampler, in every run alike."""
    acc = accelerator(seed, **config)
    return acc, torch.nn.Linear(2, 2)


def loader_args(nw):
    return dict(batch_size=3, shuffle=True, num_workers=nw, multiprocessing_context=WORKERS if nw else None)


def epochs(loader, n):
    return [[(b[0].tolist(), b[1], b[2]) for b in loader] for _ in range(n)]


def assert_same(theirs, ours, what, draws=True):
    assert len(ours) == len(theirs), f"{what}: {len(ours)} batches, expected {len(theirs)}"
    for j, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        assert b[0] == a[0], f"{what}, batch {j}: samples {b[0]}, expected {a[0]}"
        assert not draws or torch.equal(b[1], a[1]), f"{what}, batch {j}: the workers' draws differ"
        assert torch.equal(b[2], a[2]), f"{what}, batch {j}: images differ"


def _shards(rank, world_size, seed, nw, tmp):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from accelerate.data_loader import DataLoaderShard

    from hotloop.integrations.accelerate import prepare_data_loader
    ds = Rows()

    acc, model = accelerator_and_model(seed)
    model, theirs = acc.prepare(model, TorchDataLoader(ds, **loader_args(nw)))
    want = epochs(theirs, 2)

    acc, model = accelerator_and_model(seed)
    loader = hotloop.DataLoader(ds, **loader_args(nw))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = prepare_data_loader(acc, loader)
        model, again = acc.prepare(model, ours)  # the user's line, unchanged: the prepared loader passes through
    assert not [str(w.message) for w in caught if "hotloop" in str(w.message)]
    assert again is ours and issubclass(type(ours), DataLoaderShard)
    assert prepare_data_loader(acc, ours) is ours  # prepared once
    assert isinstance(ours, hotloop.DataLoader) and type(ours.base_dataloader) is hotloop.DataLoader
    got = epochs(ours, 2)
    for e in range(2):
        assert_same(want[e], got[e], f"rank {rank}, num_workers={nw}, epoch {e}")
    assert ours.stats.batches == sum(len(e) for e in got)  # hotloop's loader ran them

    # gpu_transform survives: normalised float NCHW, as hotloop.Normalize makes of Accelerate's torch batches
    norm = hotloop.Normalize([0.4, 0.5, 0.6], [0.2, 0.25, 0.3], dtype=torch.float32, channels_last=False)
    acc, _ = accelerator_and_model(seed)
    normed = prepare_data_loader(acc, hotloop.DataLoader(ds, gpu_transform=norm, **loader_args(nw)))
    got = epochs(normed, 1)[0]
    assert len(got) == len(want[0])
    for j, (a, b) in enumerate(zip(want[0], got, strict=True)):
        assert b[0] == a[0] and b[2].dtype == torch.float32 and b[2].shape == (3, 3, 4, 5), (j, b[2].dtype, b[2].shape)
        torch.testing.assert_close(b[2], norm(a[2]), rtol=0, atol=0)

    # save_state mid-epoch 0, a new accelerator and loader, load_state: the rest of epoch 0, then epoch 1.
    # Each process its own folder: Accelerate writes every process's loader state to one file name.
    cut = 2 + rank
    folder = os.path.join(tmp, f"ours{rank}")
    os.makedirs(folder, exist_ok=True)
    acc, _ = accelerator_and_model(seed)
    saved = prepare_data_loader(acc, hotloop.DataLoader(ds, **loader_args(nw)))
    it = iter(saved)
    head = [next(it) for _ in range(cut)]
    acc.save_state(folder)
    del it
    assert_same(want[0][:cut], [(b[0].tolist(), b[1], b[2]) for b in head], f"rank {rank}: before the save")

    acc, _ = accelerator_and_model(seed)  # set_seed as the saved run did: Accelerate seeds the sampler alike
    resumed = prepare_data_loader(acc, hotloop.DataLoader(ds, **loader_args(nw)))
    acc.load_state(folder)
    rest = epochs(resumed, 2)
    # workers' draws resume with their RNG states; num_workers=0 draws from the main process's global RNG,
    # which load_state sets as it was at the save, a batch ahead (Accelerate's DataLoaderShard reads one
    # batch ahead) and the loader's resume then rewinds (generator=None: its generator is the global one)
    assert_same(want[0][cut:], rest[0], f"rank {rank}, num_workers={nw}: the rest of epoch 0", draws=nw > 0)
    assert_same(want[1], rest[1], f"rank {rank}, num_workers={nw}: epoch 1", draws=nw > 0)

    if nw > 0:
        return [i for b in want[0] for i in b[0]]
    # the same with Accelerate's own stateful path (a torchdata StatefulDataLoader): the same samples.
    # (With workers, torchdata's resumed epoch under Accelerate is not the saved run's rest at all:
    # no oracle there; hotloop's equals the uninterrupted run, above.)
    folder = os.path.join(tmp, f"theirs{rank}")
    os.makedirs(folder, exist_ok=True)
    acc, _ = accelerator_and_model(seed, use_stateful_dataloader=True)
    stateful = acc.prepare(TorchDataLoader(ds, **loader_args(nw)))
    it = iter(stateful)
    for _ in range(cut):
        next(it)
    acc.save_state(folder)
    del it
    acc, _ = accelerator_and_model(seed, use_stateful_dataloader=True)
    stateful = acc.prepare(TorchDataLoader(ds, **loader_args(nw)))
    acc.load_state(folder)
    their_rest = [b[0].tolist() for b in stateful]
    assert their_rest == [b[0] for b in rest[0]], f"rank {rank}: torchdata's resumed epoch {their_rest}"
    return [i for b in want[0] for i in b[0]]


@pytest.mark.parametrize("nw", [0, 2])
def test_each_process_gets_accelerates_shard_through_hotloops_loader(tmp_path, nw):
    seed = int(torch.randint(1 << 20, ()).item())
    seen = run_ranks(_shards, 2, args=(seed, nw, str(tmp_path)), timeout=240)
    # the two shards cover the dataset (even_batches repeats a few samples to even the last batch)
    assert set(seen[0]) | set(seen[1]) == set(range(37)) and set(seen[0]) != set(seen[1])


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate's state is one per process (AcceleratorState, PartialState): each test in this process
    starts and ends without one, as its own tests do."""
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_bare_loader_warns_when_accelerate_replaces_it(fresh_accelerate_state):
    """Accelerate's own prepare still replaces a hotloop.DataLoader (its class, stats and transform
    gone), now with a warning that names the helper."""
    from accelerate import Accelerator
    norm = hotloop.Normalize([0.5] * 3, [0.25] * 3, dtype=torch.float32)
    loader = hotloop.DataLoader(Rows(), batch_size=3, gpu_transform=norm)
    with pytest.warns(UserWarning, match="hotloop.integrations.accelerate.prepare_data_loader"):
        prepared = Accelerator(cpu=True).prepare(loader)
    assert type(prepared.base_dataloader) is TorchDataLoader
    assert next(iter(prepared))[2].dtype == torch.uint8  # what the warning is about


def test_bad_arguments(fresh_accelerate_state):
    from accelerate import Accelerator

    from hotloop.integrations.accelerate import prepare_data_loader
    with pytest.raises(TypeError, match="hotloop.DataLoader"):
        prepare_data_loader(Accelerator(cpu=True), TorchDataLoader(Rows()))
    with pytest.raises(TypeError, match="accelerate.Accelerator"):
        prepare_data_loader(object(), hotloop.DataLoader(Rows()))


@pytest.mark.gpu
@pytest.mark.parametrize("nw", [0, 2])
def test_loader_on_the_gpu_keeps_its_device_and_transform(fresh_accelerate_state, nw):
    """device="cuda" and gpu_transform through Accelerate on the GPU: batches come from hotloop's ring
    copies, normalised on the device (float16), Accelerate's send_to_device left out; the samples are
    those of Accelerate's prepare of torch's loader, and the images its, normalised by the same Normalize."""
    from accelerate import Accelerator

    from hotloop.integrations.accelerate import prepare_data_loader
    norm = hotloop.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    acc = Accelerator()
    assert acc.device.type == "cuda"
    want = list(acc.prepare(TorchDataLoader(Rows(), batch_size=3, num_workers=nw)))
    ours = prepare_data_loader(acc, hotloop.DataLoader(Rows(), batch_size=3, num_workers=nw, device="cuda",
                                                       gpu_transform=norm))
    assert ours.device is None  # Accelerate's own placement is off: hotloop's copies put them there
    got = list(ours)
    assert len(got) == len(want)
    here = torch.device("cuda", torch.cuda.current_device())  # Accelerate says "cuda", a tensor "cuda:0"
    for j, (a, b) in enumerate(zip(want, got, strict=True)):
        assert b[0].tolist() == a[0].tolist(), j
        assert b[2].device == here and b[2].dtype == torch.float16, (b[2].device, b[2].dtype)
        torch.testing.assert_close(b[2], norm(a[2].to(acc.device)), rtol=0, atol=0)
    assert ours.stats.h2d_bytes > 0 and ours.stats.batches == len(got)
