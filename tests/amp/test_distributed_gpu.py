"""hotloop.GradScaler on two GPUs (NCCL): DDP and FSDP2 training of a small transformer under float16 autocast, against torch's scaler."""
import math

import pytest
import torch

from hotloop.amp import GradScaler
from tests.distributed import run_ranks

from ..seeding import current_seed, seed_test

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

STEPS = 10
VOCAB, SEQ = 256, 32


class TinyTransformer(torch.nn.Module):
    """Token embedding, two pre-norm encoder blocks, a head: every kind of layer a GPT has."""

    def __init__(self, d=64, heads=4, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, d)
        self.pos = torch.nn.Parameter(torch.randn(SEQ, d) * 0.02)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def tokens(rank, step, device):
    gen = torch.Generator().manual_seed(current_seed() + 1000 * step + rank)
    return torch.randint(0, VOCAB, (8, SEQ + 1), generator=gen).to(device)


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def copy_training_state(src_model, src_opt, dst_model, dst_opt):
    """dst := src (parameters and optimizer state, shard by shard): each step is then compared from the
    same state (why: test_grad_scaler.test_autocast_fp16_training_matches_torch)."""
    for ps, pd in zip(src_model.parameters(), dst_model.parameters(), strict=True):
        local(pd).copy_(local(ps))
        for key, value in src_opt.state[ps].items():
            local(dst_opt.state[pd][key]).copy_(local(value))


def rel_err(ours, ref):
    worst = 0.0
    for a, b in zip(ours, ref, strict=True):
        a, b = local(a.detach()), local(b.detach())
        if b.numel():
            worst = max(worst, (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30))
    return worst


def train_side_by_side(rank, ref, ours, opt_ref, opt_ours, group, device, inject_ranks):
    """Steps of torch's scaler (unscale_ + clip_grad_norm_) and hotloop's (clip_grad_norm_) from the same
    state, with an inf in one gradient at steps 3 and 7 on `inject_ranks`. Returns one row a step."""
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    sc_ref = torch.amp.GradScaler(device, init_scale=2.0**16, growth_interval=4)
    sc_ours = GradScaler(device, init_scale=2.0**16, growth_interval=4)
    rows = []
    for step in range(STEPS):
        t = tokens(rank, step, device)
        row = {"step": step}
        for model, opt, scaler in ((ref, opt_ref, sc_ref), (ours, opt_ours, sc_ours)):
            opt.zero_grad()
            with torch.autocast(device, dtype=dtype):
                logits = model(t[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), t[:, 1:].reshape(-1))
            scaler.scale(loss).backward()
            if step in (3, 7) and rank in inject_ranks:
                local(list(model.parameters())[5].grad).view(-1)[step] = math.inf
            before = group._get_sequence_number_for_group()
            if scaler is sc_ref:
                scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                row["norm_ref"] = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
            else:
                row["norm"] = scaler.clip_grad_norm_(opt, 0.5).item()
            scaler.step(opt)
            row["found" if scaler is sc_ours else "found_ref"] = sum(
                v.item() for v in scaler._found_inf_per_device(opt).values())
            scaler.update()
            if scaler is sc_ours:
                row["collectives"] = group._get_sequence_number_for_group() - before
        row["scale"], row["scale_ref"] = sc_ours.get_scale(), sc_ref.get_scale()
        if step > 0:  # step 0 creates the optimizer state
            row["param_err"] = rel_err(ours.parameters(), ref.parameters())
        copy_training_state(ref, opt_ref, ours, opt_ours)
        rows.append(row)
    # no host sync in clip_grad_norm_, the gather included (a long kernel ahead: the stream stays busy)
    if device == "cuda":
        t = tokens(rank, STEPS, device)
        opt_ours.zero_grad()
        with torch.autocast(device, dtype=dtype):
            logits = ours(t[:, :-1])
        sc_ours.scale(torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), t[:, 1:].reshape(-1))
                      ).backward()
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        torch.cuda.set_sync_debug_mode("error")
        try:
            sc_ours.clip_grad_norm_(opt_ours, 0.5)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        rows.append({"stream_busy": not torch.cuda.current_stream().query()})
        sc_ours.step(opt_ours)
        sc_ours.update()
    return rows


def ddp_body(rank, world_size, seed, device="cuda"):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    seed_test(seed)  # the test's seed, on every rank: the same model on each, batches of their own
    base = TinyTransformer().to(device)
    ref = DistributedDataParallel(base)
    ours = DistributedDataParallel(TinyTransformer().to(device))
    with torch.no_grad():
        for ps, pd in zip(ref.parameters(), ours.parameters(), strict=True):
            pd.copy_(ps)
    fused = device == "cuda"
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=fused, foreach=None if fused else True)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3, fused=fused, foreach=None if fused else True)
    # DDP all-reduces gradients: an inf is on every rank or none
    return train_side_by_side(rank, ref, ours, opt_ref, opt_ours, dist.group.WORLD, device, range(world_size))


def fsdp2_body(rank, world_size, seed, device="cuda"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    seed_test(seed)  # the test's seed, on every rank: the same models on each, batches of their own
    mesh = init_device_mesh(device, (world_size,))
    models = []
    for _ in range(2):
        torch.manual_seed(seed)
        model = TinyTransformer().to(device)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        models.append(fully_shard(model, mesh=mesh))
    ref, ours = models
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=True)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3, foreach=True)
    # an inf in rank 1's shard only: both ranks must skip
    return train_side_by_side(rank, ref, ours, opt_ref, opt_ours, mesh.get_group(), device, (1,))


def check(results, collectives):
    for rank, rows in enumerate(results):
        if rows[-1].keys() == {"stream_busy"}:
            assert rows.pop()["stream_busy"], rank  # the host never waited for the sleeping stream
        for row in rows:
            skipped = row["step"] in (3, 7)
            assert row["found"] == row["found_ref"] == (1.0 if skipped else 0.0), (rank, row)
            assert row["scale"] == row["scale_ref"], (rank, row)
            assert row["collectives"] == collectives, (rank, row)
            if not skipped:
                assert row["norm"] == pytest.approx(row["norm_ref"], rel=1e-5), (rank, row)
            if "param_err" in row:
                assert row["param_err"] <= 1e-6, (rank, row)
    for r0, r1 in zip(*results, strict=True):
        if not math.isinf(r0["norm"]):
            assert r0["norm"] == r1["norm"], (r0, r1)  # one clip coefficient on every rank


def test_ddp_transformer_matches_torch_without_a_collective():
    check(run_ranks(ddp_body, 2, args=(current_seed(),), backend="nccl", timeout=300), collectives=0)


def test_fsdp2_transformer_matches_torch_with_inf_on_one_rank():
    check(run_ranks(fsdp2_body, 2, args=(current_seed(),), backend="nccl", timeout=300), collectives=1)
