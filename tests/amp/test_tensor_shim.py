"""The tensor shim: DLPack capsules (versioned and legacy) and packed tensor tables, and their errors."""
import struct

import numpy as np
import pytest
import torch
from torch.utils.dlpack import to_dlpack

from hotloop import _C
from hotloop.amp import ops, tensor_table

ALL_DTYPES = (1 << 12) - 1
FLOATING = _C.FLOATING_DTYPE_MASK


class LegacyProducer:
    """An object that only speaks the pre-1.0 protocol: no max_version, an unversioned capsule."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack__(self, stream=None):
        return to_dlpack(self.tensor)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


@pytest.mark.parametrize("dtype,name", [(torch.float32, "float32"), (torch.float16, "float16"),
                                        (torch.bfloat16, "bfloat16"), (torch.uint8, "uint8"),
                                        (torch.int32, "int32"), (torch.int64, "int64")])
@pytest.mark.parametrize("legacy", [False, True])
def test_describe_reads_pointer_shape_dtype(dtype, name, legacy):
    t = (torch.rand(3, 5, 7) * 100).to(dtype)
    info = _C.describe_tensor(LegacyProducer(t) if legacy else t)
    assert info == {"data_ptr": t.data_ptr(), "device": -1, "dtype": name, "shape": (3, 5, 7), "numel": 105,
                    "read_only": False}


def test_describe_numpy_and_read_only_flag():
    a = np.random.rand(4, 6).astype(np.float32)
    assert _C.describe_tensor(a)["data_ptr"] == a.ctypes.data
    a.flags.writeable = False
    assert _C.describe_tensor(a)["read_only"] is True


def test_byte_offset_of_a_view_is_applied():
    t = torch.rand(10, 4)
    view = t[3:]
    assert _C.describe_tensor(view)["data_ptr"] == view.data_ptr() == t.data_ptr() + 12 * 4


def test_size_one_dims_with_odd_strides_count_as_contiguous():
    t = torch.rand(1, 8).expand(1, 8)
    assert _C.describe_tensor(t.as_strided((1, 8), (999, 1)))["numel"] == 8


def test_non_contiguous_is_a_value_error():
    with pytest.raises(ValueError, match="expected a contiguous tensor"):
        _C.describe_tensor(torch.rand(4, 6).t())


def test_not_a_tensor_is_a_type_error():
    with pytest.raises(TypeError, match=r"expected a tensor \(an object with __dlpack__\), got list"):
        _C.describe_tensor([1.0, 2.0])


def test_wrong_dtype_names_expected_and_got():
    packed = tensor_table.pack([torch.rand(3)])
    with pytest.raises(TypeError, match="found: expected float32, got float16"):
        _C.non_finite_check(packed, torch.zeros(1, dtype=torch.float16), None, 0)


def test_read_only_output_is_refused():
    packed = tensor_table.pack([torch.rand(3)])
    found = np.zeros(1, dtype=np.float32)
    found.flags.writeable = False
    with pytest.raises(ValueError, match="found: expected a writable tensor"):
        _C.non_finite_check(packed, found, None, 0)


def test_requires_grad_is_read_not_refused():
    w = torch.rand(50, requires_grad=True)
    assert ops.non_finite_check([w]).item() == 0.0
    with torch.no_grad():
        w[7] = float("nan")
    assert ops.non_finite_check([w]).item() == 1.0


def raw_table(*entries):
    return struct.pack(f"{4 * len(entries)}q", *[f for e in entries for f in e])


def test_table_counts_chunks_and_elements():
    chunk = _C.CHUNK_ELEMS
    tensors = [torch.rand(chunk + 1), torch.rand(0), torch.rand(5).half(), torch.rand(chunk).bfloat16()]
    assert _C.check_table(tensor_table.pack(tensors), FLOATING) == (4, 2 * chunk + 6, 2 + 0 + 1 + 1, -1)


def test_table_empty_list_is_a_value_error():
    with pytest.raises(ValueError, match="expected at least one tensor, got an empty list"):
        ops.non_finite_check([])


def test_table_mixed_devices_is_a_value_error():
    with pytest.raises(ValueError, match="tensor 0 is on cpu, tensor 1 on cuda:0"):
        _C.check_table(raw_table((1000, 4, 0, -1), (2000, 4, 0, 0)), FLOATING)


def test_table_null_pointer_for_data_is_a_value_error():
    with pytest.raises(ValueError, match="tensor 1: null data pointer for 4 elements"):
        _C.check_table(raw_table((1000, 4, 0, -1), (0, 4, 0, -1)), FLOATING)
    # an empty tensor may have a null pointer
    assert _C.check_table(raw_table((1000, 4, 0, -1), (0, 0, 0, -1)), FLOATING)[0] == 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.complex64, torch.bool])
def test_table_unsupported_dtype_is_a_type_error(dtype):
    t = torch.ones(3, dtype=dtype)
    with pytest.raises(TypeError, match=f"tensor 1: expected float32, float16 or bfloat16, got {str(dtype)[6:]}"):
        ops.non_finite_check([torch.rand(2), t])


def test_table_malformed_bytes():
    with pytest.raises(ValueError, match="4 int64 per tensor"):
        _C.check_table(b"\0" * 31, FLOATING)
    with pytest.raises(TypeError, match="packed tensor table"):
        _C.check_table(bytearray(32), FLOATING)


def test_sparse_and_gapped_refused_in_python():
    with pytest.raises(TypeError, match="dense"):
        ops.non_finite_check([torch.rand(3, 3).to_sparse()])
    # every other column: the elements do not fill the memory they span
    with pytest.raises(ValueError, match=r"tensors\[1\]: expected a dense tensor"):
        ops.non_finite_check([torch.rand(3), torch.rand(3, 8)[:, ::2]])


@pytest.mark.parametrize("make", [lambda: torch.randn(6, 9).t(),
                                  lambda: torch.randn(2, 3, 5, 7).contiguous(memory_format=torch.channels_last)])
def test_dense_in_another_order_is_accepted(make):
    # a transposed or channels_last tensor (as conv weight gradients are) is read in memory order
    t = make()
    assert not t.is_contiguous()
    assert ops.non_finite_check([t]).item() == 0.0
    flat = t.as_strided((t.numel(),), (1,))  # the same memory, in memory order
    for pos in (0, t.numel() // 2, t.numel() - 1):
        flat[pos] = float("nan")
        assert ops.non_finite_check([t]).item() == 1.0
        flat[pos] = 0.25
    with pytest.raises(TypeError, match=r"tensors\[0\]: expected a torch.Tensor, got float"):
        ops.non_finite_check([1.0])
