"""hotloop.Normalize on uint8 and float, NCHW and NHWC, 1/3/4-channel batches against torchvision's ToTensor + Normalize, directly and as a DataLoader's gpu_transform."""
import pytest
import torch
from torch.utils.data import Dataset
from torch.utils.data import DataLoader as TorchDataLoader
from torchvision import transforms as T
from torchvision.datasets import ImageFolder

import hotloop

from .conftest import fake_device
from .image_folders import TRAIN_V2, make_folder
from .pictures import IN_DTYPES, MEANS, OUT_DTYPES, STDS, Pictures, assert_matches_torchvision, random_images

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def poisoned_like_output(tf, x):
    """An output tensor of the right kind filled with NaN: every element must be written."""
    out, mem = tf.empty_output(x.dtype, tuple(x.shape), x.device)
    mem.fill_(float("nan"))
    return out, mem


@pytest.mark.parametrize("channels", [1, 3, 4])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_direct_call_matches_torchvision(channels, layout, in_dtype, out_dtype):
    x = random_images(5, channels, 7, 9, in_dtype, layout)
    for channels_last in (True, False):
        tf = hotloop.Normalize(MEANS[channels], STDS[channels], dtype=out_dtype, channels_last=channels_last)
        got = tf(x)
        assert got.shape == (5, channels, 7, 9) and got.dtype == out_dtype
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        assert got.is_contiguous(memory_format=fmt)
        assert torch.equal(got, tf.reference(x))
        assert_matches_torchvision(got, x, layout, tf)
        out, mem = poisoned_like_output(tf, x)
        tf.run(x, mem)
        assert not out.isnan().any() and torch.equal(out, got)


def test_uint8_nchw_stored_channels_last_is_read_in_place_and_equals_contiguous():
    x = random_images(3, 3, 6, 5, torch.uint8, "NCHW")
    tf = hotloop.Normalize(MEANS[3], STDS[3], dtype=torch.float32)
    assert torch.equal(tf(x.contiguous(memory_format=torch.channels_last)), tf(x))
    assert torch.equal(tf(x[:, :, ::2, 1:]), tf(x[:, :, ::2, 1:].contiguous()))  # a strided view


def test_scale_one_takes_means_in_0_255_units_for_uint8_and_float():
    mean, std = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)
    tf = hotloop.Normalize(mean, std, dtype=torch.float32, scale=1)
    u8 = random_images(2, 3, 4, 4, torch.uint8, "NHWC")
    f = u8.float() / 255
    ref = (u8.permute(0, 3, 1, 2).float() - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    torch.testing.assert_close(tf(u8), ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(tf(f), ref, rtol=1e-5, atol=1e-5)  # float x / 255 brought back to 0-255 units


def test_layout_when_both_dims_have_the_channel_count():
    """[n, 3, h, 3]: uint8 is read as NHWC, float as NCHW (ToTensor's), unless layout= says."""
    u8 = random_images(2, 3, 3, 3, torch.uint8, "NHWC")
    f = random_images(2, 3, 3, 3, torch.float32, "NCHW")
    tf = hotloop.Normalize(MEANS[3], STDS[3], dtype=torch.float32)
    assert tf.layout_of(u8.dtype, u8.shape) == "NHWC" and tf.layout_of(f.dtype, f.shape) == "NCHW"
    assert_matches_torchvision(tf(u8), u8, "NHWC", tf)
    assert_matches_torchvision(tf(f), f, "NCHW", tf)
    nchw = hotloop.Normalize(MEANS[3], STDS[3], dtype=torch.float32, layout="NCHW")
    nhwc = hotloop.Normalize(MEANS[3], STDS[3], dtype=torch.float32, layout="NHWC")
    assert_matches_torchvision(nchw(u8), u8, "NCHW", nchw)
    assert_matches_torchvision(nhwc(f), f, "NHWC", nhwc)
    with pytest.raises(ValueError, match=r"\[n, h, w, 3\] \(layout='NHWC'\), got torch.float32 of shape \[2, 3, 5, 5\]"):
        nhwc(torch.rand(2, 3, 5, 5))
    with pytest.raises(ValueError, match="layout None, 'NCHW' or 'NHWC', got 'CHW'"):
        hotloop.Normalize(MEANS[3], STDS[3], layout="CHW")


@pytest.mark.parametrize("x", [
    torch.zeros(2, 4, 5, 5, dtype=torch.uint8),  # no dim of 3 channels
    torch.zeros(2, 5, 5, 2),  # float, neither
    torch.zeros(2, 3, 5, 5, dtype=torch.int64),  # integers other than uint8
    torch.zeros(3, 5, 5, dtype=torch.uint8),  # one image, no batch dim
    torch.zeros(2, 1, 3, 5, 5),  # 5-d
    torch.zeros(2, 3, 5, 5, dtype=torch.float8_e4m3fn),
], ids=["uint8-4ch", "float-2ch", "int64", "3d", "5d", "float8"])
def test_what_it_cannot_take_raises_naming_what_it_got(x):
    tf = hotloop.Normalize(MEANS[3], STDS[3])
    want = (r"expected a uint8 or float \(float16, bfloat16, float32, float64\) image batch \[n, 3, h, w\] or "
            rf"\[n, h, w, 3\], got {x.dtype} of shape \[{', '.join(map(str, x.shape))}\]")
    with pytest.raises(ValueError, match=want):
        tf(x)
    with pytest.raises(TypeError, match="got ndarray"):
        tf(x.float().numpy())


# --- as a DataLoader's gpu_transform -----------------------------------------------------------------

def check_loader_batches(ds, loader, tf, layout):
    ref = list(TorchDataLoader(ds, batch_size=4))
    got = list(loader)
    assert len(got) == len(ref) == 3
    for (x, i, f), (y, j, g) in zip(ref, got, strict=True):
        assert torch.equal(i, j) and torch.equal(f, g)  # the other leaves pass unchanged
        assert y.dtype == tf.output_dtype("cpu") and y.shape[1] == x.shape[1 if layout == "NCHW" else 3]
        assert torch.equal(y, tf(x))
        assert_matches_torchvision(y, x, layout, tf)


@pytest.mark.parametrize("channels", [1, 3, 4])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("in_dtype", [torch.uint8, torch.float32, torch.float16], ids=str)
def test_gpu_transform_in_cpu_loader_matches_torchvision(channels, layout, in_dtype):
    ds = Pictures(10, channels, in_dtype, layout)
    tf = hotloop.Normalize(MEANS[channels], STDS[channels], dtype=torch.float32)
    for num_workers in (0, 2):  # the batch whole, and the ring's slots
        check_loader_batches(ds, hotloop.DataLoader(ds, batch_size=4, num_workers=num_workers, gpu_transform=tf),
                             tf, layout)


@pytest.mark.parametrize("channels", [1, 3, 4])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("in_dtype", [torch.uint8, torch.float32], ids=str)
def test_gpu_transform_on_the_device_path_matches_torchvision(fake_cuda, channels, layout, in_dtype):
    """The device path's logic (staging in the leaf's dtype, the transform after the copy) on the CPU."""
    ds = Pictures(10, channels, in_dtype, layout)
    tf = hotloop.Normalize(MEANS[channels], STDS[channels], dtype=torch.float32)
    for num_workers in (0, 2):
        loader = fake_device(hotloop.DataLoader(ds, batch_size=4, num_workers=num_workers, gpu_transform=tf))
        check_loader_batches(ds, loader, tf, layout)


def test_device_path_default_dtype_is_float16(fake_cuda):
    """dtype=None on the device path: float16, the GPU's default, for every input kind."""
    ds = Pictures(8, 3, torch.float32, "NCHW")
    tf = hotloop.Normalize(MEANS[3], STDS[3])
    got = list(fake_device(hotloop.DataLoader(ds, batch_size=4, num_workers=0, gpu_transform=tf)))
    for (x, _, _), (y, _, _) in zip(TorchDataLoader(ds, batch_size=4), got, strict=True):
        assert y.dtype == torch.float16
        assert torch.equal(y, hotloop.Normalize(MEANS[3], STDS[3], dtype=torch.float16)(x))


class Constant(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.full((3, 8, 8), 200, dtype=torch.uint8)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_uint8_chw_batch_is_normalised_not_passed_through(num_workers):
    """Once a uint8 [4, 3, 8, 8] batch of 200s came out as it went in, raw, with no word."""
    tf = hotloop.Normalize((.5,) * 3, (.2,) * 3)
    got = next(iter(hotloop.DataLoader(Constant(), batch_size=4, num_workers=num_workers, gpu_transform=tf)))
    assert got.dtype == torch.float32 and got.shape == (4, 3, 8, 8)
    want = T.Normalize((.5,) * 3, (.2,) * 3)(torch.full((3, 8, 8), 200 / 255))
    torch.testing.assert_close(got, want.expand(4, 3, 8, 8), rtol=1e-6, atol=1e-6)


class Leaves(Dataset):
    def __init__(self, *leaves):
        self.leaves = leaves

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return tuple(t.clone() for t in self.leaves)


@pytest.mark.parametrize("where", ["whole", "ring", "device"])
def test_batches_it_cannot_normalise_raise(fake_cuda, where):
    tf = hotloop.Normalize(MEANS[3], STDS[3])

    def first_batch(ds):
        loader = hotloop.DataLoader(ds, batch_size=4, num_workers=0 if where == "whole" else 2, gpu_transform=tf)
        if where == "device":
            fake_device(loader)
        return next(iter(loader))

    # an image leaf of 4 channels beside a 3-channel one: refused, not passed on raw
    ds = Leaves(torch.zeros(3, 5, 5), torch.zeros(4, 5, 5, dtype=torch.uint8), torch.tensor(1))
    with pytest.raises(ValueError, match=r"cannot normalise.*got torch.uint8 of shape \[4, 4, 5, 5\]"):
        first_batch(ds)
    # no image leaf at all: grayscale [h, w] samples batch to [n, h, w]
    ds = Leaves(torch.zeros(5, 5, dtype=torch.uint8), torch.tensor(1))
    with pytest.raises(ValueError, match=r"no image leaf.*got torch.uint8 \[4, 5, 5\], torch.int64 \[4\]"):
        first_batch(ds)


def test_gpu_transform_with_gpu_decode_is_refused(tmp_path):
    ds = ImageFolder(make_folder(str(tmp_path), n=4), transform=TRAIN_V2(16))
    with pytest.raises(ValueError, match="gpu_transform does not apply to gpu_decode's images"):
        hotloop.DataLoader(ds, batch_size=2, gpu_decode="cpu", gpu_transform=hotloop.Normalize(MEANS[3], STDS[3]))
