"""Random pictures in every channel count, dtype and layout hotloop.Normalize takes, and its output checked
against torchvision's: for the Normalize tests on the CPU and on CUDA."""
import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision import transforms as T

MEANS = {1: (0.45,), 3: (0.485, 0.456, 0.406), 4: (0.485, 0.456, 0.406, 0.5)}
STDS = {1: (0.225,), 3: (0.229, 0.224, 0.225), 4: (0.229, 0.224, 0.225, 0.3)}
IN_DTYPES = [torch.uint8, torch.float32, torch.float16, torch.bfloat16, torch.float64]
OUT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_images(n, c, h, w, dtype, layout, generator=None):
    """Fresh random images [n, c, h, w] (NCHW) or [n, h, w, c] (NHWC): uint8 over 0-255, floats over [0, 1]."""
    if dtype == torch.uint8:
        x = torch.randint(0, 256, (n, h, w, c), dtype=torch.uint8, generator=generator)
    else:
        x = torch.rand((n, h, w, c), generator=generator, dtype=torch.float64).to(dtype)
    return x if layout == "NHWC" else x.permute(0, 3, 1, 2).contiguous()


def torchvision_normalized(x, layout, mean, std):
    """What torchvision's pipeline makes of each image, float32 [n, c, h, w]: uint8 through ToTensor()
    (from the numpy HWC array it takes) then Normalize; floats (already ToTensor's [0, 1]) through
    Normalize alone, in float32."""
    nhwc = x if layout == "NHWC" else x.permute(0, 2, 3, 1)
    norm = T.Normalize(mean, std)
    if x.dtype == torch.uint8:
        return torch.stack([norm(T.ToTensor()(np.ascontiguousarray(img.numpy()))) for img in nhwc])
    return torch.stack([norm(img.permute(2, 0, 1).float()) for img in nhwc])


def assert_matches_torchvision(got, x, layout, tf):
    """Every element against torchvision, rounded to the output's dtype: float inputs bit for bit (the
    same float32 sub and div); uint8 within one rounding of the output (x / 255 - m) / s against
    (x - 255 m) / (255 s))."""
    want = torchvision_normalized(x, layout, tf.mean, tf.std)
    out_dtype = got.dtype
    assert got.shape == want.shape
    if x.dtype != torch.uint8:
        assert torch.equal(got, want.to(out_dtype)), "float input: not torchvision's values bit for bit"
    else:
        eps = torch.finfo(out_dtype).eps if out_dtype != torch.float32 else 2e-6
        torch.testing.assert_close(got.float(), want.to(out_dtype).float(), rtol=eps, atol=eps)


class Pictures(Dataset):
    """Images of one dtype and layout (CHW or HWC per sample), a label and a float feature vector."""

    def __init__(self, n, channels, dtype, layout, size=6):
        g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
        self.images = random_images(n, channels, size, size + 1, dtype, layout, generator=g)
        self.features = torch.rand(n, 2, generator=g)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], i, self.features[i]
