"""torch's private names that hotloop uses, in one file: when a torch release moves or renames one, this
file changes and the modules that import from it do not."""
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import _utils as _data_utils
from torch.utils.data._utils.collate import collate, default_collate, default_collate_fn_map
from torch.utils.data._utils.pin_memory import pin_memory
from torch.utils.data.dataloader import _BaseDataLoaderIter as BaseDataLoaderIter
from torch.utils.data.dataloader import _DatasetKind as DatasetKind
from torch.utils.data.dataloader import _sharding_worker_init_fn as sharding_worker_init_fn
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter as SingleProcessDataLoaderIter

__all__ = ["BaseDataLoaderIter", "DatasetKind", "ExceptionWrapper", "SingleProcessDataLoaderIter", "collate",
           "default_collate", "default_collate_fn_map", "numpy_worker_seed", "pin_memory", "raw_current_stream",
           "set_worker_info", "sharding_worker_init_fn"]

# torch's call behind torch.cuda.current_stream().cuda_stream, without the Stream object; CUDA builds only
raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def numpy_worker_seed(base_seed, worker_id):
    """The seed torch's DataLoader worker gives numpy's global RNG (its _worker_loop's _generate_state)."""
    return _data_utils.worker._generate_state(base_seed, worker_id)


def set_worker_info(**fields):
    """What get_worker_info() answers in this process from now on: torch's WorkerInfo(**fields), set
    where torch's _worker_loop sets it."""
    _data_utils.worker._worker_info = _data_utils.worker.WorkerInfo(**fields)
