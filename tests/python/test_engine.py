"""The Engine binding on one rank: zero-copy views, the copying grads_ready form, tensor
validation (never a silent copy), error translation, the GIL, and the memory report."""

import json
import threading
import time

import pytest

torch = pytest.importorskip("torch")

import zeroshard as zs  # noqa: E402


def make_engine(stage=2, dtype="f32", sizes=(24, 5), **kw):
    e = zs.Engine(zs.Config(stage=stage, dtype=dtype, **kw), zs.make_self_communicator())
    tdt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    inits = [torch.linspace(-1, 1, n).to(tdt) for n in sizes]
    u = e.add_unit("u", [zs.Param(f"p{i}", init=t) for i, t in enumerate(inits)])
    e.finalize()
    return e, u, inits


def test_params_are_zero_copy_views_updated_by_step():
    e, u, inits = make_engine(stage=1, optimizer={"lr": 0.1, "weight_decay": 0.0})
    views = [torch.from_dlpack(v) for v in e.params(u)]
    assert [tuple(v.shape) for v in views] == [(24,), (5,)]
    assert torch.equal(views[0], inits[0])
    # Two calls see the same memory: the views are the engine's buffer, not copies.
    assert torch.from_dlpack(e.params(u)[0]).data_ptr() == views[0].data_ptr()
    before = views[0].clone()
    e.grads_ready(u, [torch.ones(24), torch.ones(5)])
    r = e.step()
    assert r.step == 1 and not r.skipped and r.grad_norm == pytest.approx(29 ** 0.5, rel=1e-6)
    # Adam's first step moves every element by lr against the gradient's sign.
    assert torch.allclose(views[0], before - 0.1, atol=1e-5)


def test_grads_views_and_no_copy_form():
    e, u, _ = make_engine(stage=2, optimizer={"lr": 0.1, "weight_decay": 0.0})
    g = [torch.from_dlpack(v) for v in e.grads(u)]
    assert all(float(t.abs().sum()) == 0 for t in g)  # handed out zeroed
    g[0].fill_(-2.0)
    g[1].fill_(3.0)
    e.grads_ready(u)
    e.step()
    p = torch.from_dlpack(e.gather(u)[0])
    assert torch.allclose(p, torch.linspace(-1, 1, 24) + 0.1, atol=1e-5)


def test_state_shards_round_trip():
    e, u, _ = make_engine(stage=0)
    info = e.shard_info(u)
    assert info.numel == 29 and info.shard_numel == info.padded_numel
    m = torch.from_dlpack(e.read_shard(u, zs.StateKind.master))
    assert m.dtype == torch.float32 and m.shape == (info.shard_numel,)
    new = torch.zeros_like(m)
    new[:29] = 0.5
    e.write_shard(u, zs.StateKind.master, new)
    e.commit_shards()
    assert torch.equal(torch.from_dlpack(e.params(u)[1]), torch.full((5,), 0.5))
    e.set_step_count(7)
    assert e.step_count() == 7


@pytest.mark.parametrize("bad,match", [
    (lambda: torch.ones(24, dtype=torch.float64), r"dtype float64 does not match the expected float32"),
    (lambda: torch.ones(24, dtype=torch.bfloat16), r"dtype bfloat16 does not match the expected float32"),
    (lambda: torch.ones(8, 3).t(), r"not contiguous \(shape \[3, 8\], strides \[1, 3\]\)"),
    (lambda: torch.ones(4, 12)[:, ::2], r"not contiguous .*pass tensor\.contiguous\(\)"),
    (lambda: torch.ones(25), r"has 25 elements \(shape \[25\]\), expected 24"),
    (lambda: [1.0] * 24, r"expected a CPU tensor or array supporting DLPack"),
])
def test_bad_gradient_tensors_are_rejected_not_copied(bad, match):
    e, u, _ = make_engine(stage=2)
    with pytest.raises(zs.InvalidArgumentError, match=match) as info:
        e.grads_ready(u, [bad(), torch.ones(5)])
    assert "gradient of 'p0'" in str(info.value)
    assert isinstance(info.value, ValueError) and info.value.code == "invalid_argument"


def test_strided_view_of_right_size_is_rejected():
    # 24 elements with a stride of 2: the numel matches, only the layout is wrong. A binding
    # that copied would accept it; this one must not.
    e, u, _ = make_engine(stage=0)
    strided = torch.arange(48, dtype=torch.float32)[::2]
    assert strided.numel() == 24 and not strided.is_contiguous()
    with pytest.raises(zs.InvalidArgumentError, match="not contiguous"):
        e.grads_ready(u, [strided, torch.ones(5)])


def test_init_tensor_is_validated():
    e = zs.Engine(zs.Config(), zs.make_self_communicator())
    with pytest.raises(zs.InvalidArgumentError, match=r"initial values of 'w'.*not contiguous"):
        e.add_unit("u", [zs.Param("w", shape=[8, 3], init=torch.ones(3, 8).t())])
    with pytest.raises(zs.InvalidArgumentError, match=r"initial values of 'w'.*dtype int64"):
        e.add_unit("u", [zs.Param("w", shape=[4], init=torch.ones(4, dtype=torch.int64))])


def test_cpp_errors_become_python_exceptions_with_the_same_message():
    e, u, _ = make_engine(stage=2)
    with pytest.raises(zs.InvalidArgumentError) as info:
        e.step()  # no gradients this step
    msg = str(info.value)
    # The C++ message names the rank, the unit and the call.
    assert msg.startswith("step(): rank 0, unit 'u'") and "micro-steps" in msg
    with pytest.raises(zs.InvalidArgumentError, match=r"write_shard\(\): rank 0, unit 'u': got 3 values"):
        e.write_shard(u, zs.StateKind.master, torch.zeros(3))
    with pytest.raises(zs.ConfigError, match="nvme"):
        zs.Engine(zs.Config(offload_optimizer={"device": "nvme"}), zs.make_self_communicator())


def test_device_cuda_without_a_usable_gpu_is_a_clear_error():
    # A CPU-only build refuses device cuda with ConfigError ("built without CUDA"); a CUDA build
    # on a machine without a GPU with CudaError ("no GPU can be used"). Either way the message
    # says what was asked for. On a CUDA build with a GPU it is a real engine (tests in
    # test_gpu_torch.py), which this checks too rather than skipping.
    try:
        e = zs.Engine({"zeroshard": {"device": "cuda"}}, zs.make_self_communicator())
    except zs.Error as err:
        msg = str(err)
        assert "cuda" in msg
        assert isinstance(err, (zs.ConfigError, zs.CudaError)), type(err)
        if isinstance(err, zs.ConfigError):
            assert "built without CUDA" in msg
        else:
            assert "no GPU can be used" in msg
    else:
        assert e.config().device == zs.Device.cuda and e.stream() != 0


def test_stream_on_the_cpu():
    # Streams belong to the cuda device: a CPU engine has none, and refuses one.
    e, u, _ = make_engine(stage=1)
    assert e.stream() == 0
    e.set_stream(0)  # "the engine's own stream": nothing to do on the CPU
    with pytest.raises(zs.InvalidArgumentError,
                       match=r"set_stream\(\): the engine runs on the CPU"):
        e.set_stream(0x1234)
    with pytest.raises(TypeError):
        e.set_stream(-1)  # not a handle
    # The views of a CPU engine are CPU arrays (DLPack device type 1, kDLCPU).
    for v in e.params(u) + e.grads(u):
        assert torch.from_dlpack(v).device == torch.device("cpu")


def test_memory_report():
    e, u, _ = make_engine(stage=2, offload_optimizer="cpu")
    m = e.memory()
    d = m.as_dict()
    assert set(d) == {"device", "host", "nvme"}
    assert m.total() == sum(c["bytes"] for row in d.values() for c in row.values())
    assert m.at(zs.Tier.host, zs.MemKind.optim_state) > 0  # Adam's moments on the host tier
    assert "optim_state" in str(m)


def test_plan_memory_equals_the_ledger():
    # The plan of an engine is its own setup with nothing allocated: every cell of the report
    # matches the engine's, here with the optimizer on the host tier, two groups, and a plan of
    # rank 3 of 4 differing from rank 0's only where the shards do.
    cfg = zs.Config(stage=2, offload_optimizer="cpu", dtype="bf16")
    bias = zs.OptimizerOptions(weight_decay=0.0)
    units = [("embed", [zs.Param("w", shape=[300, 7])]),
             ("head", [zs.Param("w", shape=[7, 300]), zs.Param("b", shape=[300], group=1)])]
    e = zs.Engine(cfg, zs.make_self_communicator())
    e.add_group(bias)
    for name, params in units:
        e.add_unit(name, params)
    e.finalize()
    plan = zs.plan_memory(cfg, units, world=1, groups=[bias])
    assert plan.as_dict() == e.memory().as_dict() and plan.total() > 0
    big = zs.plan_memory(cfg, units, world=4, rank=3, groups=[bias])
    assert big.at(zs.Tier.host, zs.MemKind.optim_state) < plan.at(zs.Tier.host,
                                                                    zs.MemKind.optim_state)
    with pytest.raises(zs.InvalidArgumentError, match="rank 4 of 4"):
        zs.plan_memory(cfg, units, world=4, rank=4)
    # A model far larger than this machine's memory plans in no time and allocates nothing.
    huge = [(f"layer{i}", [zs.Param("w", shape=[1 << 15, 1 << 15])]) for i in range(64)]
    nvme = {"device": "nvme", "nvme_path": "/nonexistent/nvme"}
    p = zs.plan_memory(zs.Config(stage=3, offload_optimizer=nvme, offload_param=nvme,
                                 dtype="bf16"), huge, world=8)
    assert p.at(zs.Tier.nvme, zs.MemKind.optim_state) == 2 * 4 * (64 << 30) // 8


def test_estimate_predicts_the_step_from_a_calibration_file(tmp_path):
    # With a calibration file every row the model covers gets the engine's step split as
    # predict_step() computes it: on 2 ranks stage 0 updates the whole unit, twice stage 1's
    # shard; the nvme rows take the nvme tier's step instead of the update; parameters on the
    # host tier are a CPU engine's memory, on the nvme tier they need the file's parameter-tier
    # rates (a row without them says so). A file of another schema is refused by name.
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({
        "schema": "zeroshard-calibration/1",
        "optimizer": {"adamw": {"f32": {"params_per_s": 1e9}, "bf16": {"params_per_s": 1e9}}},
        "collectives": {k: {"latency_s": 1e-5, "bandwidth_gbs": 1.0,
                            "points_bytes_s": [[4096, 1e-5], [1 << 20, 1e-3]]}
                        for k in ("reduce_scatter", "all_gather")},
        "nvme": {"step_params_per_s": 1e8}}))
    units = [(f"l{i}", [zs.Param("w", shape=[256, 256])]) for i in range(4)]
    est = zs.estimate(units, world=2, dtype="bf16", calibration=cal, compute_s=0.25)
    rows = {(r["stage"], r["optimizer"], r["params"]): r for r in est.rows}
    for key, r in rows.items():
        if key[2] == "nvme":
            assert r["step"] is None and "parameter tier" in r["step_note"], key
            continue
        st = r["step"]
        assert st["compute_s"] == 0.25
        assert st["total_s"] == pytest.approx(st["compute_s"] + st["comm_s"] + st["optimizer_s"]
                                              + st["nvme_s"]), key
        assert (st["nvme_s"] > 0) == (key[1] == "nvme") and (st["optimizer_s"] > 0) != (key[1] == "nvme")
    s0, s1 = rows[(0, "device", "device")]["step"], rows[(1, "device", "device")]["step"]
    assert s0["optimizer_s"] == pytest.approx(2 * s1["optimizer_s"])
    assert s1["optimizer_s"] == pytest.approx(4 * 256 * 256 / 2 / 1e9)
    assert rows[(2, "nvme", "device")]["step"]["nvme_s"] == pytest.approx(4 * 256 * 256 / 2 / 1e8)
    assert rows[(3, "host", "host")]["step"] == rows[(3, "host", "device")]["step"]
    c = json.loads(cal.read_text())
    c["nvme"]["param_tier"] = {"read_gbs": 0.1, "write_gbs": 1.0, "write_with_records_gbs": 2.0}
    cal.write_text(json.dumps(c))
    rows = {(r["stage"], r["optimizer"], r["params"]): r
            for r in zs.estimate(units, world=2, dtype="bf16", calibration=cal).rows}
    # Stage 3 on 2 ranks: this rank's shards (half the model's bf16 bytes) read twice at
    # 0.1 GB/s, far slower than the 8 gathers of 64 KiB shards (under 1 ms in all), which they
    # then pace, and written once at 1 GB/s.
    shards = 4 * 256 * 256 // 2 * 2
    nv, dev = rows[(3, "host", "nvme")]["step"], rows[(3, "host", "device")]["step"]
    slowest = 2 * shards / 1e8 + shards / 1e9
    assert slowest - 1e-3 < nv["nvme_s"] < slowest and nv["comm_s"] == dev["comm_s"]
    assert "step s" in str(est)
    assert all(r["step"] is None for r in zs.estimate(units, world=2).rows)
    # 8-bit moments and a bf16 master: their own rate, and half the master's bytes.
    doc = json.loads(cal.read_text())
    doc["nvme"]["state_formats"] = {"8bit/bf16": {"step_params_per_s": 4e8}}
    doc["optimizer"]["adamw"]["bf16"]["state_formats"] = {"8bit/bf16": {"params_per_s": 2e9}}
    cal.write_text(json.dumps(doc))
    small = zs.estimate(units, world=2, dtype="bf16", optimizer_state="8bit", bf16_master=True,
                        calibration=cal)
    srows = {(r["stage"], r["optimizer"], r["params"]): r for r in small.rows}
    assert srows[(2, "nvme", "device")]["step"]["nvme_s"] == pytest.approx(4 * 256 * 256 / 2 / 4e8)
    assert srows[(1, "device", "device")]["step"]["optimizer_s"] == pytest.approx(
        4 * 256 * 256 / 2 / 2e9)
    wide = zs.estimate(units, world=2, dtype="bf16", optimizer_state="8bit")
    w = {(r["stage"], r["optimizer"], r["params"]): r for r in wide.rows}
    master = 4 * 256 * 256 // 2 * 2  # 2 bytes fewer per parameter of this rank's shards
    assert w[(2, "host", "device")]["host"] - srows[(2, "host", "device")]["host"] == master
    cal.write_text('{"schema": "zeroshard-calibration/7"}')
    with pytest.raises(zs.InvalidArgumentError, match="zeroshard-calibration/7"):
        zs.estimate(units, world=2, calibration=cal)


def test_estimate_times_muons_iteration_on_its_owners():
    # optimizer="muon": a module's matrices are Muon's and its biases AdamW's (as ZeroOptimizer
    # splits it); on 2 ranks each unit's one matrix is orthogonalised by one rank, so the step's
    # iteration is the sum of both matrices' (5 steps of 2·m²·n + m³ multiply-adds, m <= n) at
    # ns_gflops (2 flops a multiply-add). Without that rate the step is not predicted, and says so.
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    est = zs.estimate(model, world=2, optimizer="muon", memory_gbs=10, bus_gbs=5, ns_gflops=2.0)
    rows = {(r["stage"], r["optimizer"], r["params"]): r for r in est.rows}
    st = rows[(2, "device", "device")]["step"]
    madds = 5 * (3 * 64 ** 3) + 5 * (2 * 32 * 32 * 64 + 32 ** 3)
    assert st["newton_schulz_s"] == pytest.approx(madds / 1e9)
    assert st["optimizer_s"] > st["newton_schulz_s"]
    plain = zs.estimate(model, world=2, memory_gbs=10, bus_gbs=5)
    p = {(r["stage"], r["optimizer"], r["params"]): r for r in plain.rows}[(2, "device", "device")]
    assert p["step"]["newton_schulz_s"] == 0 and p["step"]["comm_s"] < st["comm_s"]
    untimed = zs.estimate(model, world=2, optimizer="muon", memory_gbs=10, bus_gbs=5)
    assert all(r["step"] is None and "ns-gflops" in r["step_note"] for r in untimed.rows
               if r["optimizer"] != "nvme")
    with pytest.raises(zs.InvalidArgumentError, match="ns_gflops is Muon's"):
        zs.estimate(model, world=2, ns_gflops=2.0)


def test_estimate_plans_gpu_engines_without_a_gpu(tmp_path, monkeypatch):
    # device="cuda": the choices a GPU engine takes (no stage 0 with the optimizer off the GPU,
    # no parameters off it with the optimizer on it), each the CPU engine's bytes plus the GPU's
    # staging: with the optimizer on the host, the gradient shards' two slots on the GPU and one
    # pinned upload buffer per unit's shard on the host. With typed rates, the host-GPU copies
    # show as pcie_s: on one rank with no compute, all the downloads, and the uploads beyond the
    # update (each unit's as its update ends: all but the first unit's update is hidden).
    # The synchronous CPU engine's plan (the asynchronous device takes the GPU's staging too).
    monkeypatch.delenv("ZEROSHARD_ASYNC_DEVICE", raising=False)
    units = [(f"l{i}", [zs.Param("w", shape=[256, 256])]) for i in range(4)]
    cpu = {(r["stage"], r["optimizer"], r["params"]): r for r in zs.estimate(units, world=2).rows}
    gpu = {(r["stage"], r["optimizer"], r["params"]): r
           for r in zs.estimate(units, world=2, device="cuda").rows}
    assert set(gpu) == {k for k in cpu if not (k[0] == 0 and k[1] != "device")
                        and not (k[2] != "device" and k[1] == "device")}
    shard = 256 * 256 // 2 * 2  # bytes of a unit's bf16 shard on 2 ranks
    r, c = gpu[(2, "host", "device")], cpu[(2, "host", "device")]
    assert r["device"] - c["device"] == 2 * shard and r["host"] - c["host"] == 4 * shard
    assert gpu[(1, "device", "device")]["device"] == cpu[(1, "device", "device")]["device"]

    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({
        "schema": "zeroshard-calibration/1",
        "optimizer": {"adamw": {"f32": {"params_per_s": 1e9}, "bf16": {"params_per_s": 1e9}}},
        "collectives": {}}))
    one = {(r["stage"], r["optimizer"], r["params"]): r for r in zs.estimate(
        units, world=1, device="cuda", calibration=cal, pcie_gbs=0.1, gpu_update_gps=10).rows}
    whole = 4 * 256 * 256 * 2
    st = one[(2, "host", "device")]["step"]
    assert st["pcie_s"] == pytest.approx(2 * whole / 1e8 - 3 * 256 * 256 / 1e9)
    assert st["total_s"] == pytest.approx(st["optimizer_s"] + st["pcie_s"])
    assert one[(2, "device", "device")]["step"]["optimizer_s"] == pytest.approx(whole / 2 / 1e10)
    assert one[(2, "device", "device")]["step"]["pcie_s"] == 0
    with pytest.raises(zs.InvalidArgumentError, match="bus_gbs"):
        zs.estimate(units, world=2, device="cuda", calibration=cal)
    two = zs.estimate(units, world=2, device="cuda", calibration=cal, pcie_gbs=1,
                      gpu_update_gps=10, bus_gbs=100)
    timed = [r for r in two.rows if "nvme" not in (r["optimizer"], r["params"])]
    assert len(timed) == 8 and all(r["step"]["comm_s"] > 0 for r in timed)
    with pytest.raises(zs.InvalidArgumentError, match="device=\"cuda\""):
        zs.estimate(units, world=1, pcie_gbs=1)
    # Typed rates alone time the step: the CPU update at 28 B per parameter of memory traffic,
    # the nvme step at 2 x 12 B of records.
    typed = {(r["stage"], r["optimizer"], r["params"]): r["step"] for r in zs.estimate(
        units, world=2, memory_gbs=28, disk_gbs=24, bus_gbs=10).rows}
    shard_params = 4 * 256 * 256 / 2
    assert typed[(2, "host", "device")]["optimizer_s"] == pytest.approx(shard_params / 1e9)
    assert typed[(2, "nvme", "device")]["nvme_s"] == pytest.approx(shard_params / 1e9)
    assert all(s is not None for s in typed.values())


def test_step_releases_the_gil():
    # One engine with 16 M parameters, so that each step() takes tens of ms (4 M took under
    # 10 ms on a fast 2-core machine). While a worker thread runs step(), the main thread must
    # keep running Python code; with the GIL held through step() it could not run at all inside
    # the call.
    n = 1 << 24
    e = zs.Engine(zs.Config(stage=0), zs.make_self_communicator())
    u = e.add_unit("big", [zs.Param("w", shape=[n])])
    e.finalize()
    grad = torch.full((n,), 0.01)
    spans, done = [], threading.Event()

    def worker():
        try:
            for _ in range(6):
                e.grads_ready(u, [grad])
                t0 = time.perf_counter()
                e.step()
                spans.append((t0, time.perf_counter()))
        finally:
            done.set()

    samples, last = [], 0.0
    t = threading.Thread(target=worker)
    t.start()
    while not done.is_set():
        now = time.perf_counter()
        if now - last > 2e-4:
            samples.append(now)
            last = now
    t.join()
    assert len(spans) == 6
    long = [(a, b) for a, b in spans if b - a > 0.01]
    assert long, f"steps too short to judge: {[b - a for a, b in spans]}"
    for a, b in long:
        lo, hi = a + 0.25 * (b - a), b - 0.25 * (b - a)
        inside = sum(lo < s < hi for s in samples)
        assert inside >= 3, (f"the main thread ran {inside} times in the middle half of a "
                             f"{(b - a) * 1e3:.1f} ms step(): the GIL was held")
