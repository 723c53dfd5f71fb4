"""ZeroOptimizer on a CUDA model, and the Engine binding's CUDA views, on one rank. Every test
here skips, saying why, unless torch sees a CUDA GPU and zeroshard was built with CUDA
(`pip install . -Ccmake.define.ZEROSHARD_WITH_CUDA=ON`; the default wheel is the CPU build).

The parity bound is test_torch.py's (see mpi/test_parity.py for its derivation), for the same
reason: the reference (torch.optim.AdamW on a copy of the same CUDA model, whole batch, clipped
by clip_grad_norm_) and ZeroOptimizer run the same forward and backward kernels on the same
device, so their gradients differ only through the parameters, and the parameters only through
the update's float32 rounding: the engine's fused AdamW kernel (bitwise equal to its CPU kernel)
parenthesises the bias corrections differently from torch's, and its clipping factor comes from
a norm summed in another order. Those are the sources the CPU bound was measured against (largest
difference over 20 steps ~1.5e-6, bound 2e-5). TF32 matrix products are switched off for these
tests: with them a last-bit difference in a parameter can flip the rounding of a TF32 input and
move a gradient by ~1e-3 relative, which is a property of TF32, not of zeroshard.
"""

import copy

import pytest

torch = pytest.importorskip("torch")

import zeroshard as zs  # noqa: E402
import zeroshard.torch as zt  # noqa: E402
from zs_testutil import (  # noqa: E402
    CLIP, EPS, LR, batches, groups, loss_fn, make_model, max_abs_diff, train_reference,
    train_zero)

BOUND = 2e-5


def _skip_reason():
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU (torch.cuda.is_available() is False)"
    try:
        zs.Engine(zs.Config(device="cuda", device_index=torch.cuda.current_device()),
                  zs.make_self_communicator())
    except zs.ConfigError as e:  # "built without CUDA"; a CudaError on a GPU is a failure
        return f"zeroshard was built without CUDA: {e}"
    return None


@pytest.fixture(scope="module", autouse=True)
def cuda_only():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def dev():
    return torch.device("cuda", torch.cuda.current_device())


def on(data, device):
    return [(t.to(device), y.to(device)) for t, y in data]


def cpu(state):
    return {k: v.detach().cpu() for k, v in state.items()}


def zero(model, stage, **kw):
    kw.setdefault("param_groups", groups(model))
    return zt.ZeroOptimizer(model, stage=stage, lr=LR, eps=EPS, gradient_clipping=CLIP,
                            comm=zs.make_self_communicator(), **kw)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cuda_model_matches_adamw_on_cuda(stage):
    model, data = make_model().to(dev()), on(batches(20), dev())
    ref = train_reference(model, data)  # a deep copy, on the same GPU
    opt = zero(model, stage)
    cfg = opt.engine.config()
    assert cfg.device == zs.Device.cuda and cfg.device_index == dev().index
    train_zero(opt, model, data, 0, 1)
    torch.cuda.synchronize()
    got = opt.model_state_dict()
    assert all(v.device == dev() for v in got.values())
    got, want = cpu(got), cpu(ref.state_dict())
    assert max_abs_diff(got, want) <= BOUND
    assert max_abs_diff(got, make_model().state_dict()) > 100 * BOUND  # it trained
    assert opt.last_result.step == 20 and opt.last_result.grad_norm > 0


def test_nccl_bootstrapped_through_a_torch_store_trains_like_adamw():
    # torchrun's path without torchrun: NCCL's set-up carried by a torch.distributed store
    # (here a one-rank TCPStore of this process), then stage-3 training over that NCCL.
    import datetime
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True, datetime.timedelta(seconds=60))
    comm = zs.make_nccl_communicator(dev().index, zs.store_communicator(store, 0, 1))
    assert comm.size() == 1 and comm.rank() == 0
    model, data = make_model().to(dev()), on(batches(20), dev())
    ref = train_reference(model, data)
    opt = zt.ZeroOptimizer(model, stage=3, lr=LR, eps=EPS, gradient_clipping=CLIP,
                           param_groups=groups(model), comm=comm)
    train_zero(opt, model, data, 0, 1)
    torch.cuda.synchronize()
    got, want = cpu(opt.model_state_dict()), cpu(ref.state_dict())
    assert max_abs_diff(got, want) <= BOUND
    assert max_abs_diff(got, make_model().state_dict()) > 100 * BOUND


def test_parameters_are_cuda_tensors_sharing_engine_memory():
    model = make_model().to(dev())
    opt = zero(model, 2)
    # The engine works on torch's current stream (the default one, passed as cudaStreamLegacy).
    assert opt.engine.stream() == (torch.cuda.current_stream(dev()).cuda_stream or 1)
    for u in range(opt.engine.num_units()):
        for p, v in zip(opt._units[u].params, opt.engine.params(u)):
            t = torch.from_dlpack(v)  # a DLPack kDLCUDA array: a CUDA tensor, no copy
            assert p.device == t.device == dev() and p.data_ptr() == t.data_ptr()
    w = model.proj.weight.detach().clone()
    train_zero(opt, model, on(batches(1), dev()), 0, 1)
    assert not torch.equal(w, model.proj.weight)  # updated in place by the engine
    # The gradients live in the engine; .grad says so (reading it raises).
    assert all(isinstance(p.grad, zt.HandedGrad) for p in model.parameters())


def test_stage3_parameters_are_gathered_on_the_gpu():
    model = make_model().to(dev())
    opt = zero(model, 3)
    assert model.proj.weight.numel() == 0 and model.proj.weight.device == dev()
    seen = {}

    def look(module, inputs):  # runs after the optimizer's pre-hook has gathered the unit
        seen.setdefault("weight", (tuple(module.weight.shape), module.weight.device))
    model.proj.register_forward_pre_hook(look)
    train_zero(opt, model, on(batches(2), dev()), 0, 1)
    assert seen["weight"] == ((32, 16), dev())
    assert model.proj.weight.numel() == 0
    with torch.no_grad():
        assert model(batches(1)[0][0].to(dev())).shape == (16, 7)


def test_state_dict_round_trip_on_the_gpu():
    data = on(batches(6), dev())
    a_model = make_model().to(dev())
    a = zero(a_model, 2)
    train_zero(a, a_model, data[:3], 0, 1)
    sd = a.state_dict()
    assert all(e["master"].device.type == "cpu" for e in sd["state"]["units"])
    sd = copy.deepcopy(sd)
    train_zero(a, a_model, data[3:], 0, 1)
    b_model = make_model(seed=123).to(dev())
    b = zero(b_model, 2)
    b.load_state_dict(sd)
    train_zero(b, b_model, data[3:], 0, 1)
    got, want = cpu(b.model_state_dict()), cpu(a.model_state_dict())
    assert all(torch.equal(got[k], want[k]) for k in want), "not bitwise identical"


def test_config_that_disagrees_with_the_model_is_refused():
    model = make_model().to(dev())
    with pytest.raises(zs.ConfigError, match="device is cpu but the model's trainable"):
        zero(model, 2, device="cpu")
    with pytest.raises(zs.ConfigError, match="device_index is 7 but"):
        zero(model, 2, device_index=7)
    half = make_model()
    half.proj.to(dev())
    with pytest.raises(zs.InvalidArgumentError, match="on several devices"):
        zero(half, 2)


@pytest.mark.parametrize("moments", ["f32", "bf16", "8bit"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_engine_on_the_gpu_equals_the_engine_on_the_cpu(stage, moments):
    # The low-level binding: CUDA views out, CUDA gradients in (and gradients written into the
    # engine's own CUDA views), against a CPU engine given the same gradients. Without clipping
    # the CUDA kernels are bitwise equal to the CPU ones (tests/gpu/test_gpu_engine.cpp), in
    # every format of the moments.
    sizes = (300, 7)
    inits = [torch.linspace(-1, 1, n) for n in sizes]

    def engine(device):
        e = zs.Engine(zs.Config(stage=stage, device=device, optimizer={"lr": 0.01},
                                optimizer_state=moments, state_block=256),
                      zs.make_self_communicator())
        if device != "cpu":
            e.set_stream(torch.cuda.current_stream(dev()).cuda_stream or 1)
        u = e.add_unit("u", [zs.Param(f"p{i}", init=t) for i, t in enumerate(inits)])
        e.finalize()
        return e, u

    g_eng, gu = engine(str(dev()))
    c_eng, cu = engine("cpu")
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        grads = [torch.randn(n, generator=gen) for n in sizes]
        if step % 2:  # the copying form, from CUDA tensors
            g_eng.grads_ready(gu, [g.to(dev()) for g in grads])
        else:  # written into the engine's CUDA gradient views
            for v, g in zip(g_eng.grads(gu), grads):
                t = torch.from_dlpack(v)
                assert t.device == dev()
                t.copy_(g)
            g_eng.grads_ready(gu)
        c_eng.grads_ready(cu, grads)
        rg, rc = g_eng.step(), c_eng.step()
        assert rg.grad_norm == pytest.approx(rc.grad_norm, rel=1e-12)
    gv = [torch.from_dlpack(v) for v in g_eng.gather(gu)]
    cv = [torch.from_dlpack(v) for v in c_eng.gather(cu)]
    assert all(g.device == dev() for g in gv)
    torch.cuda.synchronize()
    assert all(torch.equal(g.cpu(), c) for g, c in zip(gv, cv))
    assert not torch.equal(cv[0], inits[0])  # it trained
    g_eng.release(gu)
    c_eng.release(cu)
    for kind in (zs.StateKind.master, zs.StateKind.state0, zs.StateKind.state1):
        assert torch.equal(torch.from_dlpack(g_eng.read_shard(gu, kind)),
                           torch.from_dlpack(c_eng.read_shard(cu, kind))), kind


def test_cuda_tensors_where_the_engine_reads_the_host_are_refused():
    e = zs.Engine(zs.Config(stage=2, device="cuda", device_index=dev().index),
                  zs.make_self_communicator())
    with pytest.raises(zs.InvalidArgumentError,
                       match=r"initial values of 'w'.*device type 2 \(cuda:\d+\).*tensor\.cpu\(\)"):
        e.add_unit("u", [zs.Param("w", init=torch.ones(4, device=dev()))])
    with pytest.raises(zs.InvalidArgumentError, match=r"broadcast\(\): buffer.*device type 2"):
        zs.make_self_communicator().broadcast(torch.ones(4, device=dev()))
    # A CPU engine takes no CUDA gradients.
    c = zs.Engine(zs.Config(stage=2), zs.make_self_communicator())
    u = c.add_unit("u", [zs.Param("w", shape=[4])])
    c.finalize()
    with pytest.raises(zs.InvalidArgumentError, match=r"gradient of 'w'.*device type 2"):
        c.grads_ready(u, [torch.ones(4, device=dev())])


@pytest.mark.parametrize("stage,offload", [(1, None), (3, None), (2, "cpu")])
def test_muon_on_cuda_matches_the_float64_reference(stage, offload):
    # Muon with its state on the GPU (the GPU's kernels, cuBLAS's products) or offloaded (the
    # CPU's), against test_muon.py's float64 reference of torch.optim.Muon's algorithm. The
    # bound is test_muon.py's on the CPU, 2e-5, with room for the GPU's forward, backward and
    # iteration summing in other orders: 5e-5.
    import test_muon

    model, data = make_model(), batches(12)
    ref, _ = test_muon.train_reference(model, data)
    model = model.to(dev())
    opt = zt.ZeroOptimizer(model, stage=stage, optimizer="muon",
                           param_groups=test_muon.param_groups(model),
                           comm=zs.make_self_communicator(), offload_optimizer=offload)
    for tokens, labels in on(data, dev()):
        opt.zero_grad()
        loss_fn(model, tokens, labels).backward()
        opt.step()
    torch.cuda.synchronize()
    got = cpu(opt.model_state_dict())
    want = {k: v.float() for k, v in ref.state_dict().items()}
    assert max_abs_diff(got, want) <= 5e-5
    assert max_abs_diff(got, make_model().state_dict()) > 0.05  # it trained
    opt.close()
