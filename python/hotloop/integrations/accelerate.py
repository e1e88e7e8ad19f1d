"""Accelerate's prepare_data_loader for a hotloop.DataLoader: Accelerate's own sharding and its
DataLoaderShard around the loader, with hotloop's DataLoader (ring, workers, device copies, transform,
stats, state_dict) in place of the torch DataLoader Accelerate would build from torch's arguments."""
import warnings

import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderShard

from ..data import DataLoader

__all__ = ["prepare_data_loader"]

# the arguments of torch's DataLoader that Accelerate passes on to the loader it builds, read back
# from that loader (sampler, batch_sampler, batch_size and drop_last are chosen apart, below)
_TORCH_ARGUMENTS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                    "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")


def prepare_data_loader(accelerator, loader, device_placement=None):
    """`accelerator.prepare_data_loader(loader)` for a hotloop.DataLoader, which keeps it.

        loader = hotloop.integrations.accelerate.prepare_data_loader(accelerator, loader)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # passes it through

    Accelerate's own `prepare` builds a new torch DataLoader from the 16 arguments torch knows, so
    hotloop's ring, workers, stats, state_dict, device=, gpu_decode and gpu_transform are dropped
    (hotloop.DataLoader warns when that happens). This runs Accelerate's own prepare_data_loader
    (its sharding: a BatchSamplerShard, or an IterableDatasetShard; split_batches, even_batches, its
    seedable sampler and synchronised generator), then makes the hotloop loader again, as Lightning
    does, from the loader Accelerate built: its dataset, batch sampler and torch arguments, with this
    loader's hotloop arguments. So each process sees the batches Accelerate would give it with torch's
    loader, through hotloop's. What is returned is Accelerate's DataLoaderShard (its end-of-epoch
    tracking for gradient accumulation and gather_for_metrics, set_epoch, RNG synchronisation) around it.

    Device placement: a loader with device= puts its batches there itself, and Accelerate's
    send_to_device is turned off for it; a loader without one is placed by Accelerate, as a torch
    loader would be (give it device=accelerator.device to have the ring's copies instead).

    State: accelerator.save_state / load_state save and load the loader's state_dict() (as they do a
    torchdata StatefulDataLoader's): a resumed run goes on from the next batch of the saved epoch,
    on each process its own shard. Use that rather than accelerator.skip_first_batches, which makes
    a torch DataLoader again.

    device_placement: as accelerator.prepare_data_loader's. Not supported: dispatch_batches=True
    (one process loads and sends to the others) and XLA, whose loaders are other classes (ValueError).
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"prepare_data_loader: expected an accelerate.Accelerator, got {type(accelerator).__name__}")
    if issubclass(type(loader), DataLoaderShard) and isinstance(loader.base_dataloader, DataLoader):
        return loader  # prepared by this function already (type(): an adapter answers __class__ with its loader's)
    if not isinstance(loader, DataLoader):
        raise TypeError(f"prepare_data_loader: expected a hotloop.DataLoader, got {type(loader).__name__} (a torch "
                        "DataLoader needs none of this: accelerator.prepare(loader))")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_REPLACED_MESSAGE_START)  # it is replaced back below
        shard = accelerator.prepare_data_loader(loader, device_placement=device_placement)
    if not issubclass(type(shard), DataLoaderShard):  # type(): an adapter answers __class__ with its loader's
        raise ValueError(f"prepare_data_loader: Accelerate made a {type(shard).__name__} of this loader (dispatch_batches"
                         "=True or XLA); hotloop's loader takes the place of a DataLoaderShard's only")
    ours = _remade(loader, shard.base_dataloader)
    shard.base_dataloader = ours
    if vars(loader)["device"] is not None:
        shard.device = None  # the batches arrive on the device: no send_to_device
    # accelerator.save_state / load_state save and load state_dict() of an adapter that says so
    shard.use_stateful_dataloader = True
    shard.dl_state_dict = ours.state_dict()
    # Accelerate's own mark on what it prepared: a later accelerator.prepare() passes the shard through
    setattr(shard, "_is_accelerate_prepared", True)
    return shard


_REPLACED_MESSAGE_START = "accelerator.prepare"  # hotloop.DataLoader's warning when Accelerate replaces it


def _remade(loader, built):
    """`loader`'s class made again from the torch DataLoader that Accelerate built in its place, with
    `loader`'s hotloop arguments (vars(loader) holds them as given)."""
    kwargs = {name: getattr(built, name) for name in _TORCH_ARGUMENTS}
    if isinstance(built.dataset, torch.utils.data.IterableDataset):
        kwargs.update(batch_size=built.batch_size, drop_last=built.drop_last)
    elif built.batch_sampler is not None:
        kwargs.update(batch_sampler=built.batch_sampler)
    else:  # a loader whose sampler yields whole batches (batch_size=None)
        kwargs.update(sampler=built.sampler, batch_size=built.batch_size, drop_last=built.drop_last)
    own = vars(loader)
    return type(loader)(built.dataset, device=own["device"], prefetch_batches=own["prefetch_batches"],
                        gpu_transform=own["gpu_transform"], max_worker_restarts=own["max_worker_restarts"],
                        gpu_decode=own["gpu_decode"], **kwargs)
