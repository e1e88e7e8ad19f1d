"""non_finite_check against torch.isfinite, on the CPU (C reference) and the GPU (CUDA kernel)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import hotloop
from hotloop.amp import ops, tensor_table

SIZES = [1, 555, 65536, 65537, 2**20 + 3]
# five tensors of mixed dtypes: the first, a middle and the last get the bad values
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float32, torch.float16]
BAD = [float("inf"), float("-inf"), float("nan")]


def torch_says_non_finite(tensors):
    return float(not all(bool(torch.isfinite(t).all()) for t in tensors))


def make_tensors(size, device):
    # fresh random data, scaled so that float16 stays finite
    return [(torch.randn(size + k, device=device) * 100).to(dtype) for k, dtype in enumerate(DTYPES)]


def check_all_positions(size, device):
    tensors = make_tensors(size, device)
    assert ops.non_finite_check(tensors).item() == torch_says_non_finite(tensors) == 0.0
    for which in (0, len(tensors) // 2, len(tensors) - 1):
        t = tensors[which]
        for pos in sorted({0, t.numel() // 2, t.numel() - 1}):
            for bad in BAD:
                saved = t[pos].clone()
                t[pos] = bad
                found = ops.non_finite_check(tensors)
                assert found.device == t.device and found.dtype == torch.float32 and found.shape == (1,)
                assert found.item() == torch_says_non_finite(tensors) == 1.0, (which, pos, bad)
                t[pos] = saved
    assert ops.non_finite_check(tensors).item() == 0.0


@pytest.mark.parametrize("size", SIZES)
def test_cpu_finds_every_position(size):
    check_all_positions(size, "cpu")


def test_cpu_largest_finite_values_are_finite():
    tensors = [torch.full((9,), 65504.0, dtype=torch.float16), torch.full((9,), 3.3e38),
               torch.full((9,), 3.3e38, dtype=torch.bfloat16), torch.full((9,), -65504.0, dtype=torch.float16)]
    assert ops.non_finite_check(tensors).item() == torch_says_non_finite(tensors) == 0.0


def test_cpu_many_small_and_empty_tensors():
    tensors = [torch.randn(n % 7) for n in range(3000)]
    assert ops.non_finite_check(tensors).item() == 0.0
    tensors[2999 - 2999 % 7 + 6 - 7][3] = float("nan")  # a non-empty tensor near the end
    assert ops.non_finite_check(tensors).item() == torch_says_non_finite(tensors) == 1.0


def test_only_empty_tensors_are_finite():
    assert ops.non_finite_check([torch.empty(0), torch.empty(0, 3).half()]).item() == 0.0


def test_single_tensor_argument():
    t = torch.randn(100)
    t[99] = float("inf")
    assert ops.non_finite_check(t).item() == 1.0


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_cpu_any_thread_count_finds_the_last_chunk(threads):
    """The CPU check is cut into runs of chunks, one per thread: a bad value in the last chunk (another
    thread's run) and in a float16/bfloat16 tensor is found whatever the thread count."""
    tensors = [(torch.randn(2**20 + 7) * 100).to(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)]
    threads_before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert ops.non_finite_check(tensors).item() == 0.0
        for t in tensors:
            for bad in BAD:
                saved = t[-1].clone()
                t[-1] = bad
                assert ops.non_finite_check(tensors).item() == torch_says_non_finite(tensors) == 1.0
                t[-1] = saved
    finally:
        torch.set_num_threads(threads_before)


@pytest.mark.gpu
@pytest.mark.parametrize("size", SIZES)
def test_gpu_finds_every_position(size):
    check_all_positions(size, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [1, 2, 3, 5])
def test_gpu_unaligned_views(offset):
    # a view that starts off a 16-byte boundary takes the scalar path of the kernel
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        base = torch.randn(3 * 65536 + 17, device="cuda").to(dtype)
        view = base[offset:]
        assert ops.non_finite_check([view]).item() == 0.0
        for pos in (0, view.numel() // 3, view.numel() - 1):
            view[pos] = float("nan")
            assert ops.non_finite_check([view]).item() == 1.0
            view[pos] = 1.0


@pytest.mark.gpu
def test_gpu_many_tensors_one_launch():
    tensors = [torch.randn(1 + (n * 37) % 5000, device="cuda").to(DTYPES[n % 3]) for n in range(2500)]
    assert ops.non_finite_check(tensors).item() == 0.0
    for which in (0, 1234, 2499):
        tensors[which][-1] = float("inf")
        assert ops.non_finite_check(tensors).item() == 1.0
        tensors[which][-1] = 0.5


@pytest.mark.gpu
def test_gpu_no_host_sync_and_current_stream():
    tensors = make_tensors(65537, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tensors[2][100] = float("nan")  # written on the side stream, read there too
        torch.cuda.set_sync_debug_mode("error")
        try:
            found = ops.non_finite_check(tensors)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    side.synchronize()
    assert found.item() == 1.0


@pytest.mark.gpu
def test_gpu_output_on_wrong_device_is_refused():
    packed = tensor_table.pack([torch.randn(4, device="cuda")])
    with pytest.raises(ValueError, match="found: expected a tensor on cuda:0, got one on cpu"):
        hotloop._C.non_finite_check(packed, torch.zeros(1), None, 0)
    with pytest.raises(ValueError, match="all tensors on one device"):
        ops.non_finite_check([torch.randn(4, device="cuda"), torch.randn(4)])


CUDA_ERROR_SCRIPT = textwrap.dedent("""
    import struct, time, torch, hotloop
    from hotloop.amp import tensor_table
    found = torch.zeros(1, device="cuda")
    scratch = tensor_table.device_scratch(1, "cuda")
    bad_table = struct.pack("4q", 4096, 1 << 20, 0, 0)   # a pointer no allocation owns
    hotloop._C.non_finite_check(bad_table, found, scratch, torch.cuda.current_stream().cuda_stream)
    time.sleep(1.0)   # the fault is asynchronous; the next CUDA call reports it
    try:
        hotloop._C.non_finite_check(bad_table, found, scratch, torch.cuda.current_stream().cuda_stream)
    except hotloop.CudaError as err:
        print("CAUGHT", err, "|", err.error_name, err.call, err.file, err.line)
""")


@pytest.mark.gpu
def test_gpu_fault_becomes_cuda_error_with_call_file_line():
    out = subprocess.run([sys.executable, "-c", CUDA_ERROR_SCRIPT], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ))
    assert "CAUGHT" in out.stdout, out.stdout + out.stderr
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in out.stdout
    assert "csrc/" in out.stdout
