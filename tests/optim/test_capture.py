"""hotloop.optim's step in a CUDA graph: captured after warm-up steps, replayed with fresh gradients copied
into the static ones (and an inf among them), against torch's fused capturable optimizer run eagerly on
the same data; and, without a GPU, what a capture refuses."""
import copy

import pytest
import torch

import hotloop.optim
from hotloop.amp import GradScaler
from hotloop.optim import fused as fused_module
from hotloop.optim import param_table, step_table

from ..seeding import derived_seed
from .adam_bound import AdamBound, state_of
from .conftest import SHAPES, assert_mostly_identical
from .sgd_bound import assert_close_to_torch as sgd_close_to_torch, rounded_one_way_by_torch

WARMUP, REPLAYS, INF_AT = 3, 6, 2  # the replay whose gradients hold an inf (with a scaler)

CASES = [
    ("AdamW", dict(lr="tensor")),  # lr a CUDA tensor, changed between replays
    ("Adam", dict(lr=3e-3, amsgrad=True, weight_decay=0.05)),
    ("SGD", dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-2)),
]


def gradients(seed, count, with_inf):
    gen = torch.Generator().manual_seed(seed)
    out = [[torch.randn(s, generator=gen).cuda() for s in SHAPES] for _ in range(count)]
    if with_inf:
        out[WARMUP + INF_AT][2].view(-1)[7] = float("inf")
    return out


def make_scaler(kind):
    """The gradients are copied in, not made by scale(loss).backward(): the scale is made here, as torch's
    own graph tests do."""
    args = dict(init_scale=2.0**10, growth_interval=3)  # the scale grows inside the replays
    if kind is None:
        return None
    scaler = GradScaler("cuda", **args) if kind == "hotloop" else torch.amp.GradScaler("cuda", **args)
    scaler._lazy_init_scale_growth_tracker(torch.device("cuda"))
    return scaler


def take_step(opt, scaler):
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()


@pytest.mark.gpu
@pytest.mark.parametrize("scaler_kind", [None, "hotloop", "torch"])
@pytest.mark.parametrize("name,kwargs", CASES)
def test_replays_match_torch_eager(name, kwargs, scaler_kind):
    seed = derived_seed()
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen).cuda() for s in SHAPES]
    grads = gradients(seed + 1, WARMUP + REPLAYS, scaler_kind is not None)
    lrs = [1e-3, 1e-3, 1e-3, 2e-3, 2e-3, 5e-4, 5e-4, 1e-3, 1e-3]  # per step, for the tensor lr
    tensor_lr = kwargs.get("lr") == "tensor"
    ours_lr = torch.tensor(lrs[0], device="cuda") if tensor_lr else kwargs["lr"]
    ref_lr = torch.tensor(lrs[0], device="cuda") if tensor_lr else kwargs["lr"]
    extra = {k: v for k, v in kwargs.items() if k != "lr"}
    ours_params = [torch.nn.Parameter(t.clone()) for t in init]
    ref_params = [torch.nn.Parameter(t.clone()) for t in init]
    ours = getattr(hotloop.optim, name)(ours_params, lr=ours_lr, **extra)
    ref_kwargs = dict(fused=True) if name == "SGD" else dict(fused=True, capturable=True)
    ref = getattr(torch.optim, name)(ref_params, lr=ref_lr, **extra, **ref_kwargs)
    ours_scaler, ref_scaler = make_scaler(scaler_kind), make_scaler(scaler_kind and "torch")
    for p in ours_params:
        p.grad = torch.zeros_like(p)  # the static gradients the graph reads

    # torch's, eagerly, all steps; the error bound of Adam carried along its trajectory
    bound = None
    if name != "SGD":
        g = ref.param_groups[0]
        bound = AdamBound(ref_params, 1.0, *g["betas"], g["eps"], g["weight_decay"], name == "AdamW", g["amsgrad"],
                          torch_on_cuda=True)
    skipped = 0
    for i, gs in enumerate(grads):
        if tensor_lr:
            ref_lr.fill_(lrs[i])
        bound_lr = lrs[i] if tensor_lr else kwargs["lr"]
        before = state_of(ref, ref_params)
        for p, g in zip(ref_params, gs, strict=True):
            p.grad = g.clone()
        take_step(ref, ref_scaler)
        if bound is not None:
            if scaler_kind is not None and i == WARMUP + INF_AT:
                skipped += 1
                continue
            bound.lr = bound_lr
            bound.step(i + 1 - skipped, [p.grad for p in ref_params], before, state_of(ref, ref_params))

    # ours: warm-up steps on the stream that then captures one step (torch's recommended pattern; the
    # scaler and the optimizer reuse the tables they uploaded there), replayed on the current stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(WARMUP):
            if tensor_lr:
                ours_lr.fill_(lrs[i])
            for p, g in zip(ours_params, grads[i], strict=True):
                p.grad.copy_(g)
            take_step(ours, ours_scaler)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        take_step(ours, ours_scaler)
    for i in range(WARMUP, WARMUP + REPLAYS):
        if tensor_lr:
            ours_lr.fill_(lrs[i])
        for p, g in zip(ours_params, grads[i], strict=True):
            p.grad.copy_(g)
        graph.replay()
    torch.cuda.synchronize()

    if scaler_kind is not None:
        assert ours_scaler.get_scale() == ref_scaler.get_scale()
    for p, q in zip(ours_params, ref_params, strict=True):
        for key, t in ref.state[q].items():
            if key == "step":
                assert float(ours.state[p]["step"]) == float(t) == WARMUP + REPLAYS - skipped
    only = None
    if name == "SGD":
        sgd_close_to_torch(ours, ref, ours_params, ref_params, WARMUP + REPLAYS, kwargs["lr"])
        keys = ["momentum_buffer"]
        only = rounded_one_way_by_torch(ref_params, scaled=scaler_kind is not None)
    else:
        bound.check(ours, ref, ours_params, ref_params)
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if extra.get("amsgrad") else [])
    assert_mostly_identical(ours, ref, ours_params, ref_params, keys, only=only)


@pytest.fixture
def capture(monkeypatch):
    """Make the optimizers (on CPU tensors) believe their stream is capturing a graph."""
    for module in (fused_module, step_table):
        monkeypatch.setattr(module, "capturing", lambda device: True)


def params_with_grads(n=3):
    ps = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES[:n]]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def snapshot(opt, ps):
    return [p.detach().clone() for p in ps] + [t.clone() for p in ps for t in opt.state[p].values()]


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_capture_refuses_what_would_be_frozen(name, capture, monkeypatch):
    """No state yet, tensors moved since the last step, a CPU tensor lr or beta: a clear error, nothing
    changed; after a warm-up step with the same tensors the captured path is the eager one."""
    cls = getattr(hotloop.optim, name)
    ps = params_with_grads()
    opt = cls(ps, lr=1e-2)
    with pytest.raises(RuntimeError, match="state is not made yet.*warm-up"):
        opt.step()
    assert len(opt.state) == 0
    monkeypatch.setattr(fused_module, "capturing", lambda device: False)
    monkeypatch.setattr(step_table, "capturing", lambda device: False)
    opt.step()  # the warm-up, outside the capture
    twin_ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(twin_ps, ps, strict=True):
        p.grad = q.grad.clone()
    twin = cls(twin_ps, lr=1e-2)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict may share tensors
    twin.step()  # eager
    monkeypatch.setattr(fused_module, "capturing", lambda device: True)
    monkeypatch.setattr(step_table, "capturing", lambda device: True)
    opt.step()  # "captured": the same tensors, the uploaded table
    for a, b in zip(snapshot(opt, ps), snapshot(twin, twin_ps), strict=True):
        assert torch.equal(a, b)
    before = snapshot(opt, ps)
    ps[1].grad = ps[1].grad.clone()  # a new gradient tensor: its address is not in the table
    with pytest.raises(RuntimeError, match="not those of the last step.*host memory"):
        opt.step()
    for a, b in zip(snapshot(opt, ps), before, strict=True):
        assert torch.equal(a, b)
    opt.param_groups[0]["betas"] = (torch.tensor(0.9), 0.999)
    with pytest.raises(RuntimeError, match=r"betas\[0\]: a CPU tensor"):
        opt.step()


def test_sgd_capture_refuses_a_first_step(capture, monkeypatch):
    ps = params_with_grads()
    opt = hotloop.optim.SGD(ps, lr=0.1, momentum=0.9)
    with pytest.raises(RuntimeError, match="momentum buffers are made at the first step"):
        opt.step()
    assert len(opt.state) == 0
    with pytest.raises(RuntimeError, match="not those of the last step"):  # no table uploaded yet
        hotloop.optim.SGD(params_with_grads(), lr=0.1).step()
    opt.param_groups[0]["weight_decay"] = torch.tensor(0.1)
    monkeypatch.setattr(fused_module, "capturing", lambda device: False)
    monkeypatch.setattr(step_table, "capturing", lambda device: False)
    opt.step()
    monkeypatch.setattr(fused_module, "capturing", lambda device: True)
    monkeypatch.setattr(step_table, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="weight_decay: a CPU tensor"):
        opt.step()


def test_lr_args():
    """lr as the kernels take it: a number, a float32 tensor on the parameters' device (read when the
    kernel runs), or a CPU tensor read now, which a capture of a CUDA step refuses."""
    cuda, meta = torch.device("cuda"), torch.device("meta")
    assert param_table.lr_args(0.5, cuda) == (0.5, None)
    assert param_table.lr_args(torch.tensor(0.25), cuda) == (0.25, None)
    assert param_table.lr_args(torch.tensor(0.25, dtype=torch.float64), torch.device("cpu")) == (0.25, None)
    with pytest.raises(RuntimeError, match="lr: a CPU tensor.*on the parameters' GPU"):
        param_table.lr_args(torch.tensor(0.25), cuda, capture=True)
    number, tensor = param_table.lr_args(torch.full((1,), 0.5, device="meta"), meta)
    assert number == 1.0 and tensor.device == meta and tensor.shape == ()
    lr = torch.tensor(0.5)
    assert param_table.lr_args(lr, torch.device("cpu"))[1] is not None  # the C reference reads it too
    with pytest.raises(TypeError, match="expected a float32 tensor"):
        param_table.lr_args(torch.tensor(0.5, dtype=torch.float64, device="meta"), meta)
    with pytest.raises(ValueError, match="one element"):
        param_table.lr_args(torch.ones(2), cuda)
    with pytest.raises(ValueError, match="expected a float or a tensor on the CPU or cpu"):
        param_table.lr_args(torch.tensor(0.5, device="meta"), torch.device("cpu"))


def test_lr_tensor_steps_as_its_value():
    """hotloop.optim with a CPU lr tensor (read by the C reference through its pointer) against the same
    optimizer with the number: bit for bit, also after the tensor changes in place."""
    for name, kw in (("AdamW", {}), ("SGD", dict(momentum=0.9))):
        a, b = params_with_grads(), None
        b = [torch.nn.Parameter(p.detach().clone()) for p in a]
        for p, q in zip(b, a, strict=True):
            p.grad = q.grad.clone()
        lr = torch.tensor(1e-2)
        oa = getattr(hotloop.optim, name)(a, lr=lr, **kw)
        ob = getattr(hotloop.optim, name)(b, lr=1e-2, **kw)
        for value in (1e-2, 3e-2):
            lr.fill_(value)
            ob.param_groups[0]["lr"] = float(lr)
            oa.step()
            ob.step()
        for p, q in zip(a, b, strict=True):
            assert torch.equal(p, q)
