"""hotloop.Normalize on CUDA tensors and as a device loader's gpu_transform: every input kind against the CPU path and torchvision."""
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader

import hotloop

from .pictures import IN_DTYPES, MEANS, OUT_DTYPES, STDS, Pictures, assert_matches_torchvision, random_images

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:This DataLoader will create")]


@pytest.mark.parametrize("channels", [1, 3, 4])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_cuda_equals_cpu_and_torchvision(channels, layout, in_dtype, out_dtype):
    """uint8: the kernel against the C reference; floats: torch's ops on the GPU against the CPU's
    (IEEE sub and div, one rounding to the output): bit for bit, every element, poisoned first."""
    x = random_images(6, channels, 13, 17, in_dtype, layout)
    for channels_last in (True, False):
        tf = hotloop.Normalize(MEANS[channels], STDS[channels], dtype=out_dtype, channels_last=channels_last)
        cpu = tf(x)
        xd = x.cuda()
        out, mem = tf.empty_output(xd.dtype, tuple(xd.shape), xd.device)
        mem.fill_(float("nan"))
        tf.run(xd, mem, torch.cuda.current_stream().cuda_stream)
        assert out.device.type == "cuda" and out.dtype == out_dtype and out.shape == cpu.shape
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        assert out.is_contiguous(memory_format=fmt)
        assert torch.equal(out.cpu(), cpu)
        assert torch.equal(tf(xd).cpu(), cpu)
        assert_matches_torchvision(out.cpu(), x, layout, tf)


@pytest.mark.parametrize("in_dtype", [torch.uint8, torch.float32], ids=str)
def test_torch_ops_run_on_the_kernels_stream_after_the_producer(in_dtype):
    """The uint8 NCHW -> NHWC copy and the float path run on the stream given (a loader's copy
    stream), or on the current stream when called directly, as the kernel does: a late producer on
    that stream is seen. Once the kernel of a direct call went to the default stream."""
    side = torch.cuda.Stream()
    tf = hotloop.Normalize(MEANS[3], STDS[3], dtype=torch.float32)
    x = random_images(64, 3, 224, 224, in_dtype, "NCHW")
    want = tf(x)
    for direct in (False, True):
        xd = torch.empty(x.shape, dtype=in_dtype, device="cuda")
        out, mem = tf.empty_output(xd.dtype, tuple(xd.shape), xd.device)
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # the producer is late: an unordered reader would see garbage
            xd.copy_(x.pin_memory(), non_blocking=True)
            if direct:
                out = tf(xd)  # on the current stream, side
        if not direct:
            tf.run(xd, mem, side.cuda_stream)
        side.synchronize()
        assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("in_dtype", [torch.uint8, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_device_loader_normalises_every_input_kind(channels, layout, in_dtype, num_workers):
    ds = Pictures(22, channels, in_dtype, layout, size=20)
    tf = hotloop.Normalize(MEANS[channels], STDS[channels], dtype=torch.float16)
    ref = list(TorchDataLoader(ds, batch_size=4))
    got = list(hotloop.DataLoader(ds, batch_size=4, num_workers=num_workers, device="cuda", gpu_transform=tf))
    assert len(got) == len(ref) == 6
    for (x, i, f), (y, j, g) in zip(ref, got, strict=True):
        assert y.device.type == "cuda" and y.dtype == torch.float16
        assert torch.equal(j.cpu(), i) and torch.equal(g.cpu(), f)
        assert torch.equal(y.cpu(), tf(x))
        assert_matches_torchvision(y.cpu(), x, layout, tf)
