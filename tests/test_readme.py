"""The Python blocks of the README and docs/ run as written: the CPU recipe (docs/cpu.md) here, the GPU loop
(README) and the JPEG folder block (docs/gpu-decode.md) on a GPU, with a small dataset, model and loss of
our own, the names the blocks leave to the reader; and every link between those pages leads to a file."""
import glob
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
PAGES = [README] + sorted(glob.glob(os.path.join(DOCS, "*.md")))


def python_blocks(page):
    with open(page) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)


def block_with(words, page):
    found = [b for b in python_blocks(page) if words in b]
    assert len(found) == 1, f"expected one python block with {words!r} in {page}, found {len(found)}"
    return found[0]


def run_script(code):
    # a fresh interpreter, as a reader pasting the block: its workers fork from a clean process
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_readme_cpu_recipe_runs_as_written():
    block = block_with('GradScaler("cpu")', os.path.join(DOCS, "cpu.md"))
    env_code = "import torch\ntorch.cuda.is_available = lambda: False\n"  # as on a machine without a GPU
    out = run_script(env_code + block)
    assert out.returncode == 0, out.stderr
    assert re.search(r"last loss \d+\.\d{3}; the loop waited for data \d+% of the time", out.stdout), out.stdout
    if not torch.cuda.is_available():
        assert "hotloop memory report: host (no GPU)" in out.stderr and "peak host memory (PSS)" in out.stderr


GPU_STAND_INS = textwrap.dedent("""
    import torch
    class _Images(torch.utils.data.Dataset):
        def __len__(self):
            return 64
        def __getitem__(self, i):
            return torch.randint(0, 256, (32, 32, 3), dtype=torch.uint8), i % 10
    dataset = _Images()
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10)).cuda()
    loss_fn = torch.nn.CrossEntropyLoss()
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_readme_gpu_loop_runs():
    block = block_with("hotloop.GradScaler()", README)
    out = run_script(GPU_STAND_INS + block + "\ntrain_one_epoch()\nprint('epoch done')\n")
    assert out.returncode == 0, out.stderr
    assert "epoch done" in out.stdout
    assert "peak" in out.stderr.lower()  # the memory report


IMAGE_STAND_INS = textwrap.dedent("""
    import os, tempfile
    import numpy as np
    import torch, hotloop
    import torchvision.transforms as T
    from PIL import Image
    from torchvision.datasets import ImageFolder
    root = tempfile.mkdtemp()
    for i in range(40):
        os.makedirs(os.path.join(root, f"c{i % 2}"), exist_ok=True)
        pixels = np.random.randint(0, 256, (300 + i, 400 - i, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(os.path.join(root, f"c{i % 2}", f"{i}.jpg"), quality=90)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_readme_image_folder_block_runs():
    block = block_with("gpu_decode=True", os.path.join(DOCS, "gpu-decode.md"))
    check = "\nimages, labels = next(iter(loader))\nprint(tuple(images.shape), images.device, loader.stats.decoder)\n"
    out = run_script(IMAGE_STAND_INS + block.replace("batch_size=256", "batch_size=16") + check)
    assert out.returncode == 0, out.stderr
    assert "(16, 3, 224, 224) cuda:0" in out.stdout, out.stdout


def test_links_between_the_pages_lead_to_files():
    """The README's paragraphs end in links into docs/, and the pages link to each other and to the results."""
    for page in PAGES:
        with open(page) as f:
            targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", f.read())
        local = [t for t in targets if "://" not in t]
        if page == README:
            assert sum(t.startswith("docs/") for t in local) >= 7, "the README's paragraphs link into docs/"
        for target in local:
            path = os.path.normpath(os.path.join(os.path.dirname(page), target))
            assert os.path.exists(path), f"{os.path.relpath(page, ROOT)} links to {target}, which is not there"
