"""gpu_decode's decoder opened in the background when the loader is made (decoder_opening.py), on the
CPU: nvjpeg is replaced by a stand-in that takes its time to open, as nvjpeg's hardware decoder does
(~0.65 s on an H200). What open() at the first iter() gets must be what it would have opened itself:
the same decoder on the same device, the same refusal, the same fallback."""
import threading
import time

import pytest
import torch
from torchvision.datasets import ImageFolder

import hotloop
from hotloop import _C
from hotloop.data import dataloader
from hotloop.data.image import gpu_decode
from hotloop.data.image.gpu_decode import ImagePipeline
from hotloop.data.image.maker import ImageMaker
from hotloop.data.stats import LoaderStats

from .image_folders import TRAIN_V2, make_folder

OPEN_S = 0.5


class SlowDecoder:
    """Stands in for _C.JpegDecoder: opening takes OPEN_S; `refuse` makes it raise as nvjpeg does on a
    GPU without JPEG engines."""

    made = []
    refuse = None
    refuse_only = None  # the one backend refused, where set

    def __init__(self, paths, device, backend, max_batch):
        time.sleep(OPEN_S)
        if SlowDecoder.refuse is not None and SlowDecoder.refuse_only in (None, backend):
            raise SlowDecoder.refuse
        self.device, self.backend, self.max_batch = device, backend, max_batch
        self.threads = 3 if backend == "hybrid" else 0  # JpegDecoder's defaults: the engines alone
        self.thread = threading.current_thread().name
        self.closed = False
        self.library = "stand-in"
        SlowDecoder.made.append(self)

    def close(self):
        self.closed = True


@pytest.fixture
def slow_decoder(monkeypatch):
    SlowDecoder.made, SlowDecoder.refuse, SlowDecoder.refuse_only = [], None, None
    monkeypatch.setattr(_C, "JpegDecoder", SlowDecoder)
    return SlowDecoder


def _maker(tmp_path, backend="auto", device=0):
    ds = ImageFolder(make_folder(str(tmp_path), n=6), transform=TRAIN_V2(16))
    pipeline = ImagePipeline.make(hotloop.GpuDecode(backend), ds, None, 4, "map")
    return ImageMaker(pipeline, torch.device("cuda", device), LoaderStats())


def _opening_threads():
    return [t for t in threading.enumerate() if t.name == "hotloop-nvjpeg-open"]


def test_open_takes_the_decoder_opened_in_the_background(tmp_path, slow_decoder):
    maker = _maker(tmp_path)
    t0 = time.perf_counter()
    maker.open_early(torch.device("cuda", 0))
    assert time.perf_counter() - t0 < OPEN_S / 2  # the caller goes on while nvjpeg opens
    time.sleep(OPEN_S * 2)  # the script's own set-up
    t0 = time.perf_counter()
    assert maker.open() == "hardware"
    assert time.perf_counter() - t0 < OPEN_S / 2  # iter() no longer waits for the open
    [decoder] = slow_decoder.made
    assert maker.decoder is decoder and decoder.thread == "hotloop-nvjpeg-open"
    assert (decoder.device, decoder.backend, decoder.max_batch) == (0, "hardware", 4)
    assert maker.stats.decoder == "nvjpeg hardware (stand-in)"
    assert not _opening_threads()


def test_open_waits_for_an_open_still_running(tmp_path, slow_decoder):
    maker = _maker(tmp_path, backend="cuda")
    maker.open_early(torch.device("cuda", 0))
    assert maker.open() == "cuda"
    assert len(slow_decoder.made) == 1 and slow_decoder.made[0].backend == "cuda"


def test_a_device_changed_before_iter_gets_a_decoder_of_its_own(tmp_path, slow_decoder):
    """The loader expected the current device when it was made; the script then chose another
    (torch.cuda.set_device(local_rank)): the early decoder is closed, one opened on the right device."""
    maker = _maker(tmp_path, device=1)
    maker.open_early(torch.device("cuda", 0))
    assert maker.open() == "hardware"
    early, own = slow_decoder.made
    assert early.device == 0 and early.closed
    assert own.device == 1 and not own.closed and maker.decoder is own
    assert own.thread == threading.current_thread().name


@pytest.mark.parametrize("backend", ["auto", "hardware"])
def test_a_refusal_in_the_background_is_the_one_open_would_meet(tmp_path, slow_decoder, backend):
    refusal = _C.NvjpegError("nvjpegCreateEx: NVJPEG_STATUS_ARCH_MISMATCH (no hardware JPEG decoder)")
    slow_decoder.refuse = refusal
    maker = _maker(tmp_path, backend=backend)
    maker.open_early(torch.device("cuda", 0))
    if backend == "hardware":  # forced: raised at iter(), as without the early open
        with pytest.raises(_C.NvjpegError) as info:
            maker.open()
        assert info.value is refusal
        return
    assert maker.open() == "cpu"  # auto: the workers decode, and stats say why
    assert "no hardware JPEG decoder" in maker.stats.decoder


@pytest.mark.parametrize("hybrid_opens", [True, False])
def test_auto_without_engines_takes_the_next_backend(tmp_path, slow_decoder, monkeypatch, hybrid_opens):
    """auto where the hardware decoder is refused: AUTO_WITHOUT_ENGINES ("hybrid" here) where it opens,
    opened in the same background thread, else the workers, with every refusal in the stats."""
    monkeypatch.setattr(gpu_decode, "AUTO_WITHOUT_ENGINES", "hybrid")
    slow_decoder.refuse = _C.NvjpegError("nvjpegCreateEx: NVJPEG_STATUS_ARCH_MISMATCH (no hardware JPEG decoder)")
    slow_decoder.refuse_only = "hardware" if hybrid_opens else None
    maker = _maker(tmp_path)
    maker.open_early(torch.device("cuda", 0))
    if hybrid_opens:
        assert maker.open() == "hybrid"
        [decoder] = slow_decoder.made
        assert maker.decoder is decoder and decoder.backend == "hybrid"
        assert decoder.thread == "hotloop-nvjpeg-open"  # the whole chain opens in the background
        assert maker.stats.decoder.startswith("nvjpeg hybrid (stand-in, 3 threads); no hardware decoder: nvjpegCreateEx")
    else:
        assert maker.open() == "cpu" and maker.decoder is None and not slow_decoder.made
        assert "no hardware JPEG decoder" in maker.stats.decoder and "nvjpeg hybrid:" in maker.stats.decoder


def test_other_errors_reach_open_unchanged(tmp_path, monkeypatch):
    def broken(*args):
        raise ValueError("JpegDecoder: max_batch: expected 1 to 65536 images, got 0")

    monkeypatch.setattr(_C, "JpegDecoder", broken)
    maker = _maker(tmp_path)
    maker.open_early(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="max_batch"):
        maker.open()


def test_close_before_iter_closes_the_early_decoder(tmp_path, slow_decoder):
    maker = _maker(tmp_path)
    maker.open_early(torch.device("cuda", 0))
    maker.close()
    [decoder] = slow_decoder.made
    assert decoder.closed and not _opening_threads()


def test_the_cpu_backend_opens_nothing(tmp_path, slow_decoder):
    maker = _maker(tmp_path, backend="cpu")
    maker.open_early(torch.device("cuda", 0))
    assert maker.open() == "cpu" and not slow_decoder.made


def test_the_loader_starts_the_open_when_its_device_is_known(tmp_path, slow_decoder, monkeypatch):
    """device="cuda:0" given: the open starts in DataLoader(); device="cuda" before CUDA is set up
    in the process: not before iter() (which would set CUDA up on device 0 for every rank)."""
    monkeypatch.setattr(dataloader, "_cuda_device",
                        lambda device: None if device is None else torch.device(device))
    ds = ImageFolder(make_folder(str(tmp_path), n=6), transform=TRAIN_V2(16))
    loader = hotloop.DataLoader(ds, batch_size=4, device="cuda:0", gpu_decode=True)
    assert loader.batch_maker._opening is not None and loader.batch_maker._opening.device == torch.device("cuda", 0)
    loader.batch_maker.close()
    assert slow_decoder.made[0].thread == "hotloop-nvjpeg-open" and slow_decoder.made[0].closed
    if not torch.cuda.is_initialized():
        loader = hotloop.DataLoader(ds, batch_size=4, device="cuda", gpu_decode=True)
        assert loader.batch_maker._opening is None
