"""The GradScaler's kernels (check, epilogue, apply, update): C reference against torch on the CPU, CUDA kernels against both on a GPU."""
import math

import pytest
import torch

from hotloop import _C
from hotloop.amp.tensor_table import GradientTable

from ..seeding import seeded_generator

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 555, 65536, 65537, 2**20 + 3]  # straddle the 32768-element chunks and the vector width
L2, INF, P = 1, 2, 3


def stream_of(device):
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def run_check(tensors, *, scale=None, write=False, mode=L2, p=2.0, max_norm=-1.0, blocks=0, extra=None):
    """Check pass + epilogue over `tensors` (and the `extra` partials, AMP_EXTRA_LEN floats each);
    returns (aux on the device, report, table)."""
    dev = tensors[0].device
    table = GradientTable(None, tensors, list(range(len(tensors))), dev, stream_of(dev))
    table.partials.fill_(float("nan"))  # poisoned: every chunk's partial must be written
    aux = torch.full((_C.AMP_AUX_LEN,), float("nan"), device=dev)
    report = torch.zeros(_C.AMP_REPORT_LEN, dtype=torch.int64, device=dev)
    report[0] = -1
    _C.amp_check(device=table.device_index, table=table.table_ptr, count=table.count,
                 total_chunks=table.total_chunks, partials=table.partials_ptr,
                 scale=scale.data_ptr() if scale is not None else 0, write=write, mode=mode, p=p, max_norm=max_norm,
                 aux=aux.data_ptr(), param_index=table.index_ptr, report=report.data_ptr(), step=5,
                 extra=extra.data_ptr() if extra is not None else 0,
                 n_extra=extra.numel() // _C.AMP_EXTRA_LEN if extra is not None else 0, blocks=blocks,
                 stream=stream_of(dev))
    return aux, report.cpu(), table


def run_apply(table, aux, unscale, clip):
    _C.amp_apply(device=table.device_index, table=table.table_ptr, count=table.count, total_chunks=table.total_chunks,
                 aux=aux.data_ptr(), unscale=unscale, clip=clip, stream=stream_of(aux.device))


def randn(n, dtype, device, gen_scale=1.0):
    return (torch.randn(n, device=device) * gen_scale).to(dtype)


def unscaled(x, inv):
    """What torch's unscale_ leaves in the gradient: x * inv in float32, rounded to x's dtype."""
    return (x.float() * inv).to(x.dtype)


def same_bits(a, b):
    return torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a.view(torch.int32),
                       b.view(torch.uint8) if b.dtype != torch.float32 else b.view(torch.int32))


def inv_of(scale):
    return scale.double().reciprocal().float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_unscale_writes_what_torch_writes(device, dtype):
    dev = torch.device(device)
    grads = [randn(n, dtype, dev, 1000.0) for n in SIZES]
    expect = [g.clone() for g in grads]
    scale = torch.full((), 3.0 * 2**13, device=dev)
    aux, report, _ = run_check(grads, scale=scale, write=True, mode=0)
    inv = inv_of(scale)
    for g, e in zip(grads, expect, strict=True):
        assert same_bits(g, unscaled(e, inv))
    aux = aux.cpu()
    assert aux[0].item() == 0.0 and report[2].item() == 0
    assert aux[3].item() == inv.item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which_tensor", [0, 2, 4])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_every_non_finite_is_found(device, dtype, which_tensor, where, bad):
    dev = torch.device(device)
    grads = [randn(n, dtype, dev) for n in SIZES]
    g = grads[which_tensor]
    index = {"first": 0, "middle": g.numel() // 2, "last": g.numel() - 1}[where]
    g[index] = bad
    before = [x.clone() for x in grads]
    aux, report, _ = run_check(grads, scale=torch.full((), 1024.0, device=dev), mode=L2, max_norm=1.0)
    aux = aux.cpu()
    assert aux[0].item() == 1.0
    assert report[0].item() == which_tensor and report[1].item() == 5 and report[2].item() == 1
    assert math.isnan(aux[1].item()) or math.isinf(aux[1].item())
    # the read-only check wrote nothing, and apply writes nothing when the step is skipped
    table = GradientTable(None, grads, list(range(len(grads))), dev, stream_of(dev))
    run_apply(table, aux.to(dev), True, True)
    for x, y in zip(grads, before, strict=True):
        assert same_bits(x, y)


@pytest.mark.parametrize("device", DEVICES)
def test_half_that_overflows_only_once_unscaled_is_found(device):
    dev = torch.device(device)
    g = randn(70000, torch.float16, dev)
    g[1234] = 40000.0  # finite in fp16, 160000 once divided by 0.25: inf in fp16
    aux, _, _ = run_check([randn(10, torch.float32, dev), g], scale=torch.full((), 0.25, device=dev), mode=L2)
    assert aux[0].item() == 1.0
    g[1234] = 1000.0
    aux, _, _ = run_check([g], scale=torch.full((), 0.25, device=dev), mode=L2)
    assert aux[0].item() == 0.0


def reference_norm(grads, inv, norm_type):
    values = torch.cat([unscaled(g, inv).double().flatten().cpu() for g in grads])
    if math.isinf(norm_type):
        return values.abs().max().item()
    return values.abs().pow(norm_type).sum().pow(1.0 / norm_type).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0, 3.0])
def test_norm_of_mixed_dtypes(device, norm_type):
    dev = torch.device(device)
    grads = [randn(n, dt, dev, 500.0) for n, dt in zip(SIZES + [7, 40000], DTYPES * 3)]
    scale = torch.full((), 512.0, device=dev)
    mode = L2 if norm_type == 2.0 else INF if math.isinf(norm_type) else P
    aux, _, _ = run_check(grads, scale=scale, mode=mode, p=norm_type if mode == P else 0.0, max_norm=0.25)
    aux = aux.cpu()
    expect = reference_norm(grads, inv_of(scale), norm_type)
    assert aux[0].item() == 0.0
    assert aux[1].item() == pytest.approx(expect, rel=1e-6)
    # the clip coefficient exactly as torch computes it from that norm
    coef = torch.clamp(0.25 / (aux[1] + 1e-6), max=1.0)
    assert aux[2].item() == coef.item()
    assert aux[4].item() == (torch.tensor(512.0) / coef).item()


@pytest.mark.parametrize("device", DEVICES)
def test_norm_matches_torch_clip_after_unscale(device):
    dev = torch.device(device)
    grads = [randn(n, torch.float32, dev, 300.0) for n in SIZES]
    scale = torch.full((), 2.0**10, device=dev)
    aux, _, _ = run_check(grads, scale=scale, mode=L2, max_norm=1.0)
    theirs = [g.clone() for g in grads]
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, torch.zeros((), device=dev), inv_of(scale))
    total = torch.nn.utils.get_total_norm(theirs, 2.0)
    exact = torch.cat([t.double().flatten() for t in theirs]).norm().item()
    # torch's CPU norm of a 2**20-element float32 tensor is itself off by ~1e-5; ours is not
    assert aux[1].item() == pytest.approx(exact, rel=1e-6)
    assert aux[1].item() == pytest.approx(total.item(), rel=2e-6 if device == "cuda" else 1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unscale,clip", [(True, True), (True, False), (False, True)])
def test_apply_is_torch_unscale_then_clip_bit_for_bit(device, dtype, unscale, clip):
    dev = torch.device(device)
    grads = [randn(n, dtype, dev, 2000.0) for n in SIZES]
    # an unaligned view takes the scalar path
    base = randn(1001, dtype, dev, 2000.0)
    grads.append(base[1:])
    expect = [g.clone() for g in grads]
    scale = torch.full((), 3000.0, device=dev)
    aux, _, table = run_check(grads, scale=scale if unscale else None, mode=L2, max_norm=0.5 if clip else -1.0)
    run_apply(table, aux, unscale, clip)
    inv = inv_of(scale)
    coef = aux[2].cpu()
    for g, e in zip(grads, expect, strict=True):
        if unscale:
            e = unscaled(e, inv)
        if clip:
            e = (e.float() * coef.to(dev)).to(dtype)  # torch._foreach_mul_ with the clip tensor
        assert same_bits(g, e)


@pytest.mark.parametrize("device", DEVICES)
def test_check_is_deterministic(device):
    dev = torch.device(device)
    grads = [randn(n, torch.float32, dev, 10.0) for n in SIZES * 2]
    scale = torch.full((), 100.0, device=dev)
    first, _, _ = run_check(grads, scale=scale, mode=L2, max_norm=1.0)
    for blocks in [0, 1, 3, 64, 1000]:
        again, _, _ = run_check(grads, scale=scale, mode=L2, max_norm=1.0, blocks=blocks)
        assert same_bits(first[:5].cpu(), again[:5].cpu())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [0, L2, INF, P])
def test_cpu_results_do_not_depend_on_the_thread_count(dtype, mode):
    """The C reference spreads whole chunks over threads: partials, factors, the found flag and
    the gradients written are bit for bit those of one thread, for every dtype and norm."""
    def fresh():
        gen = seeded_generator(11)
        grads = [(torch.randn(n, generator=gen) * 30).to(dtype) for n in [2**20 + 3, 5, 2**19 + 1]]
        grads[2][-1] = float("inf")  # in the last chunk: the last thread's run
        return grads

    scale = torch.full((), 8.0)
    runs = []
    for threads in [1, 3, 7]:
        grads = fresh()
        aux, report, table = run_check(grads, scale=scale, write=mode == 0, mode=mode, p=1.5, max_norm=1.0,
                                       blocks=threads)
        aux[_C.AMP_AUX_FOUND] = 0.0  # apply anyway, to compare what each thread count writes
        _C.amp_apply(device=-1, table=table.table_ptr, count=table.count, total_chunks=table.total_chunks,
                     aux=aux.data_ptr(), unscale=True, clip=True, stream=0, threads=threads)
        runs.append((aux, report, table.partials.clone(), grads))
    for aux, report, partials, grads in runs[1:]:
        assert same_bits(aux, runs[0][0]) and torch.equal(report, runs[0][1])
        assert same_bits(partials, runs[0][2])
        assert all(same_bits(g, e) for g, e in zip(grads, runs[0][3], strict=True))
    assert report[0].item() == 2  # the inf's parameter, found by another thread than the caller's


@pytest.mark.parametrize("device", DEVICES)
def test_empty_tensors_and_one_element(device):
    dev = torch.device(device)
    grads = [torch.empty(0, device=dev), randn(1, torch.float32, dev), torch.empty(0, device=dev),
             randn(3, torch.bfloat16, dev), torch.empty(0, dtype=torch.float16, device=dev)]
    aux, report, _ = run_check(grads, mode=L2, max_norm=-1.0)
    expect = reference_norm([g for g in grads if g.numel()], torch.tensor(1.0), 2.0)
    assert aux[1].item() == pytest.approx(expect, rel=1e-6)
    grads[3][2] = float("nan")
    aux, report, _ = run_check(grads, mode=L2)
    assert aux[0].item() == 1.0 and report[0].item() == 3


def run_update(device, scale, tracker, state, found, growth, backoff, interval, hysteresis=1, lo=0.0, hi=math.inf):
    _C.amp_update(device=-1 if device.type == "cpu" else device.index or 0, scale=scale.data_ptr(),
                  growth_tracker=tracker.data_ptr(), state=state.data_ptr(), found=tuple(f.data_ptr() for f in found),
                  growth_factor=growth, backoff_factor=backoff, growth_interval=interval, hysteresis=hysteresis,
                  min_scale=lo, max_scale=hi, adjust=True, stream=stream_of(device))


def scale_state(dev, scale, hysteresis=1):
    """a scale, torch's growth tracker and hotloop's state ([skipped, hysteresis left]) on `dev`"""
    return (torch.full((), scale, device=dev), torch.zeros((), dtype=torch.int32, device=dev),
            torch.tensor([0, hysteresis], dtype=torch.int64, device=dev))


@pytest.mark.parametrize("device", DEVICES)
def test_update_matches_torch_update_scale(device):
    dev = torch.device(device)
    gen = seeded_generator(1)
    ours_scale, ours_tracker, state = scale_state(dev, 3.7e4)
    their_scale, their_tracker = ours_scale.clone(), ours_tracker.clone()
    skipped = 0
    for i in range(300):
        bad = torch.rand((), generator=gen).item() < 0.15
        found = torch.full((), 1.0 if bad else 0.0, device=dev)
        growth, backoff, interval = 2.0 + (i % 3) * 0.37, 0.5 - (i % 5) * 0.031, 3 + i % 2
        skipped += bad
        run_update(dev, ours_scale, ours_tracker, state, [found], growth, backoff, interval)
        torch._amp_update_scale_(their_scale, their_tracker, found, growth, backoff, interval)
        assert ours_scale.item() == their_scale.item() and ours_tracker.item() == their_tracker.item()
    assert state[0].item() == skipped


@pytest.mark.parametrize("device", DEVICES)
def test_update_hysteresis_and_bounds(device):
    dev = torch.device(device)
    scale, tracker, state = scale_state(dev, 1024.0, hysteresis=2)
    one, zero = torch.ones((), device=dev), torch.zeros((), device=dev)

    def step(found):
        run_update(dev, scale, tracker, state, [found], 2.0, 0.5, 2, hysteresis=2, lo=256.0, hi=2048.0)
        return scale.item()

    assert step(one) == 1024.0  # first overflow tolerated
    assert step(one) == 512.0  # second backs off
    assert step(one) == 256.0
    assert step(one) == 256.0  # min_scale holds
    assert step(zero) == 256.0 and step(zero) == 512.0  # growth after 2 clean steps, tracker reset
    assert state[1].item() == 2
    assert step(one) == 512.0  # tolerated again after a growth
    assert step(zero) == 512.0 and step(zero) == 1024.0
    assert step(zero) == 1024.0 and step(zero) == 2048.0
    assert step(zero) == 2048.0 and step(zero) == 2048.0  # max_scale holds
    assert state[0].item() == 5


@pytest.mark.parametrize("device", DEVICES)
def test_update_sums_several_found_tensors(device):
    dev = torch.device(device)
    scale, tracker, state = scale_state(dev, 8.0)
    found = [torch.zeros((), device=dev) for _ in range(_C.AMP_MAX_FOUND)]
    found[-1].fill_(1.0)
    run_update(dev, scale, tracker, state, found, 2.0, 0.5, 100)
    assert scale.item() == 4.0 and state[0].item() == 1
    with pytest.raises(ValueError, match="at most"):
        run_update(dev, scale, tracker, state, found + found[:1], 2.0, 0.5, 100)


def test_table_rejects_bad_gradients():
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        GradientTable(None, [torch.zeros(3, dtype=torch.int32)], [0], torch.device("cpu"), 0)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        GradientTable(None, [torch.zeros(3, dtype=torch.complex64)], [0], torch.device("cpu"), 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.5])
def test_cuda_kernels_match_c_reference(dtype, norm_type):
    """Same data through the CUDA kernels and the C reference: flags and factors equal, norm to 1e-6,
    unscale and apply bit for bit."""
    gpu = [randn(n, dtype, torch.device("cuda"), 1e3) for n in SIZES + [3, 1 << 16]]
    gpu[3][777] = float("inf") if norm_type == 1.5 else 1.0  # one case with a non-finite value
    cpu = [g.cpu() for g in gpu]
    mode = L2 if norm_type == 2.0 else INF if math.isinf(norm_type) else P
    results = []
    for grads in (gpu, cpu):
        scale = torch.full((), 4096.0, device=grads[0].device)
        aux, report, table = run_check(grads, scale=scale, mode=mode, p=norm_type, max_norm=2.0)
        results.append((aux.cpu(), report, table))
    (ga, gr, gt), (ca, cr, ct) = results
    assert ga[0].item() == ca[0].item() and torch.equal(gr, cr)
    if ga[0].item() == 0.0:
        assert ga[1].item() == pytest.approx(ca[1].item(), rel=1e-6)
        gpu_coef = torch.clamp(2.0 / (ga[1] + 1e-6), max=1.0)
        assert ga[2].item() == gpu_coef.item()
        assert torch.equal(gt.partials.cpu()[1::2], ct.partials[1::2])
        # apply with the same factors on both sides: bit for bit
        run_apply(gt, ca.cuda(), True, True)
        run_apply(ct, ca, True, True)
        for g, c in zip(gpu, cpu, strict=True):
            assert same_bits(g.cpu(), c)
    for grads in (gpu, cpu):
        run_check(grads, scale=torch.full((), 8.0, device=grads[0].device), write=True, mode=0)
    for g, c in zip(gpu, cpu, strict=True):
        assert same_bits(g.cpu(), c)


@pytest.mark.gpu
def test_cuda_norm_is_bit_identical_whatever_the_grid():
    grads = [randn(n, torch.float32, torch.device("cuda")) for n in [2**22 + 5, 3, 2**20]]
    norms = set()
    for blocks in [0, 1, 2, 5, 132, 264, 10000]:
        for _ in range(3):
            aux, _, table = run_check(grads, scale=torch.full((), 2.0, device="cuda"), mode=L2, max_norm=1.0,
                                      blocks=blocks)
            norms.add(aux[1].item())
    assert len(norms) == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [1, 3, 7])
def test_views_at_odd_offsets(device, dtype, offset):
    """a gradient inside a larger buffer (a DDP bucket): scalar head, vectors, scalar tail"""
    dev = torch.device(device)
    buf = randn(offset + 65537 + 40, dtype, dev, 100.0)
    view = buf[offset:offset + 65537]
    scale = torch.full((), 64.0, device=dev)
    aux, _, _ = run_check([view], scale=scale, mode=L2)
    assert aux[0].item() == 0.0
    assert aux[1].item() == pytest.approx(reference_norm([view], inv_of(scale), 2.0), rel=1e-6)
    for where in (0, 5, 40000, 65536):
        saved = view[where].clone()
        view[where] = math.nan
        aux, report, _ = run_check([randn(9, torch.float32, dev), view], scale=scale, mode=L2)
        assert aux[0].item() == 1.0 and report[0].item() == 1
        view[where] = saved
    before, expect = buf.clone(), unscaled(view, inv_of(scale))
    run_check([view], scale=scale, write=True, mode=0)
    assert same_bits(view, expect)
    assert same_bits(buf[:offset], before[:offset]) and same_bits(buf[offset + 65537:], before[offset + 65537:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [L2, INF])
def test_extra_partials_fold_into_the_epilogue(device, mode):
    """Partials of gradients outside the table (or of other devices) join the table's in the epilogue:
    the norm, the found flag, and the lowest bad parameter index; alone when there is no table."""
    dev = torch.device(device)
    x = torch.randn(70001, device=dev)  # three chunks
    extra = torch.stack([torch.rand(3, device=dev) * 100, torch.tensor([0.0, 1.0, 1.0], device=dev),
                         torch.tensor([9.0, 7.0, 4.0], device=dev)], dim=1).contiguous()
    aux, report, _ = run_check([x], mode=mode, max_norm=1.0, extra=extra.view(-1))
    acc = x.double().square().sum() + extra[:, 0].double().sum() if mode == L2 else \
        torch.maximum(x.double().abs().max(), extra[:, 0].double().max())
    norm = acc.sqrt() if mode == L2 else acc
    aux = aux.cpu()
    assert aux[_C.AMP_AUX_NORM].item() == pytest.approx(norm.item(), rel=1e-6)
    assert aux[_C.AMP_AUX_ACC].item() == pytest.approx(acc.item(), rel=1e-6)
    assert aux[_C.AMP_AUX_FOUND].item() == 1.0 and aux[_C.AMP_AUX_PARAM].item() == 4.0
    assert report[0].item() == 4 and report[2].item() == 1
    x[70000] = math.nan  # the table's parameter 0 comes before the extras' 4
    aux, report, _ = run_check([x], mode=mode, extra=extra.view(-1))
    assert aux[_C.AMP_AUX_PARAM].item() == 0.0 and report[0].item() == 0
    # no table at all: the epilogue on the extras alone
    alone = torch.full((_C.AMP_AUX_LEN,), math.nan, device=dev)
    _C.amp_check(device=x.get_device(), table=0, count=0, total_chunks=0, partials=0, mode=mode, p=2.0, max_norm=1.0,
                 aux=alone.data_ptr(), extra=extra.data_ptr(), n_extra=3, stream=stream_of(dev))
    acc = extra[:, 0].double().sum() if mode == L2 else extra[:, 0].double().max()
    norm = (acc.sqrt() if mode == L2 else acc).float()
    alone = alone.cpu()
    assert alone[_C.AMP_AUX_NORM].item() == pytest.approx(norm.item(), rel=1e-6)
    assert alone[_C.AMP_AUX_CLIP].item() == pytest.approx(min(1.0 / (norm.item() + 1e-6), 1.0), rel=1e-6)
    assert alone[_C.AMP_AUX_FOUND].item() == 1.0 and alone[_C.AMP_AUX_PARAM].item() == 4.0
    with pytest.raises(ValueError, match="missing"):  # a count without a table
        _C.amp_check(device=-1, table=0, count=1, total_chunks=0, partials=0, mode=mode, p=2.0, max_norm=1.0,
                     aux=alone.data_ptr(), stream=0)
