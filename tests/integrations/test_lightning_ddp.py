"""Lightning under DDP (2 gloo processes, accelerator="cpu", devices=2) with hotloop's DataLoader and
hotloop.integrations.lightning.MixedPrecision, against the same Trainer with torch's DataLoader and
Lightning's own plugin: each rank trains on the same shard (Lightning puts its DistributedSampler into
hotloop's loader as into torch's) with the same losses and parameters; a mid-epoch checkpoint resumes
on every rank with the uninterrupted run's batches and no warning about the sampler's epoch."""
import os
import warnings

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install hotloop[test])")

import hotloop  # noqa: E402

from ..distributed import run_ranks  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


class Pairs(Dataset):
    """Sample i: a fixed input and target, and i. (No random draws: Lightning keeps one checkpoint, rank
    0's, for every rank, so the RNG states of rank 1's workers are not in it.)"""

    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(44, 6, generator=g) * 3, torch.randn(44, 2, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def _module(seed):
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
            self.seen, self.losses = [], []

        def training_step(self, batch, i):
            x, y, ids = batch
            loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
            self.seen.append(ids.tolist())
            self.losses.append(loss.detach().float().item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3, foreach=False)

    return Regression()


def _fit(kind, seed, nw, ckpt_in=None, save_at=None, **trainer_kwargs):
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision

    from hotloop.integrations.lightning import MixedPrecision
    ds = Pairs(seed)
    args = dict(batch_size=4, shuffle=True, num_workers=nw, multiprocessing_context="fork" if nw else None)
    if kind == "torch":
        plugin = LightningMixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**12))
        loader = TorchDataLoader(ds, **args)
    else:
        plugin = MixedPrecision("16-mixed", "cpu", hotloop.GradScaler("cpu", init_scale=2.0**12))
        loader = hotloop.DataLoader(ds, **args)
    model = _module(seed)
    callbacks = []
    if save_at is not None:  # rank 0 writes it, with rank 0's loader state, as Lightning does
        folder, step = save_at
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=folder, filename="mid", every_n_train_steps=step,
                                                      save_top_k=1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin], logger=False,
                         enable_checkpointing=save_at is not None, callbacks=callbacks, enable_progress_bar=False,
                         enable_model_summary=False, gradient_clip_val=0.1, **trainer_kwargs)
    torch.manual_seed(seed + trainer.global_rank)  # the main process's draws (num_workers=0), per rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader, ckpt_path=ckpt_in)
    epoch_warnings = [str(w.message) for w in caught if "sampler's epoch" in str(w.message)]
    if kind == "hotloop":
        assert type(trainer.train_dataloader) is hotloop.DataLoader  # Lightning's copy kept the class
    return model.seen, model.losses, [p.detach().clone() for p in model.parameters()], epoch_warnings


def _ranks(rank, world_size, seed, nw, tmp):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    seen_t, losses_t, params_t, _ = _fit("torch", seed, nw, max_epochs=2)
    seen, losses, params, _ = _fit("hotloop", seed, nw, save_at=(tmp, 8), max_epochs=2)
    assert seen == seen_t, f"rank {rank}: batches {seen}, Lightning with torch's loader {seen_t}"
    # gradient_clip_val: hotloop's scaler scales each gradient by (clip coefficient / scale) once, from a norm
    # summed in float64, where Lightning's plugin unscales and then clips (two roundings, a float32 norm).
    # The gradients then differ in their last bit now and then, and float16 autocast turns that into
    # losses ~1e-4 apart (a seed showed 6e-5 at the fourth step; without clipping the runs are equal)
    torch.testing.assert_close(losses, losses_t, rtol=1e-3, atol=1e-5)
    for a, b in zip(params_t, params, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)

    # the checkpoint at step 8, in the middle of epoch 1 (6 batches per rank per epoch), resumed by a new Trainer
    ckpt = os.path.join(tmp, "mid.ckpt")
    rest, rest_losses, rest_params, epoch_warnings = _fit("hotloop", seed, nw, ckpt_in=ckpt, max_epochs=2)
    assert not epoch_warnings, epoch_warnings
    assert rest == seen[8:], f"rank {rank}: resumed with {rest}, expected {seen[8:]}"
    torch.testing.assert_close(rest_losses, losses[8:], rtol=1e-5, atol=1e-6)
    for a, b in zip(params, rest_params, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    return [i for b in seen for i in b]


@pytest.mark.parametrize("nw", [0, 2])
def test_ddp_trains_and_resumes_as_lightning_with_torchs_classes(tmp_path, nw):
    seed = int(torch.randint(1 << 20, ()).item())
    seen = run_ranks(_ranks, 2, args=(seed, nw, str(tmp_path)), timeout=300)
    first = [set(ids[:22]) for ids in seen]  # epoch 0: each rank's half of the 44 samples (DistributedSampler)
    assert not first[0] & first[1] and first[0] | first[1] == set(range(44))
