"""Config from keyword arguments, dicts (DeepSpeed's keys included) and JSON files, and the
errors a bad configuration raises."""

import json

import pytest

import zeroshard as zs


def test_keywords_set_every_kind_of_field():
    c = zs.Config(stage=3, dtype="bf16", gradient_clipping=1.5, gradient_accumulation_steps=4,
                  optimizer={"kind": "sgd", "lr": 0.5, "momentum": 0.9, "nesterov": True},
                  offload_optimizer="cpu", offload_param={"device": "cpu"},
                  loss_scale=zs.LossScaleOptions(window=10), max_live_units=5, prefetch=False)
    assert c.stage == 3 and c.dtype == zs.DType.bf16
    assert c.gradient_clipping == 1.5 and c.gradient_accumulation_steps == 4
    assert c.optimizer.kind == zs.OptimizerKind.sgd and c.optimizer.momentum == pytest.approx(0.9)
    assert c.optimizer.nesterov
    assert c.offload_optimizer.tier == zs.Tier.host and c.offload_param.tier == zs.Tier.host
    assert c.loss_scale.window == 10 and c.max_live_units == 5 and not c.prefetch


def test_nested_options_are_references():
    c = zs.Config()
    c.optimizer.lr = 0.25
    c.offload_optimizer.tier = "cpu"
    assert c.optimizer.lr == 0.25 and c.offload_optimizer.tier == zs.Tier.host


def test_torch_dtype_spellings():
    torch = pytest.importorskip("torch")
    assert zs.Config(dtype=torch.float16).dtype == zs.DType.f16
    assert zs.Config(dtype=torch.bfloat16).dtype == zs.DType.bf16


def test_deepspeed_dict_and_json_file(tmp_path):
    ds = {
        "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e8,
                              "offload_optimizer": {"device": "cpu"}},
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
    }
    for c in (zs.Config.from_dict(ds), zs.Config.from_json(json.dumps(ds))):
        assert c.stage == 2 and c.dtype == zs.DType.bf16
        assert c.offload_optimizer.tier == zs.Tier.host
        assert c.optimizer.kind == zs.OptimizerKind.adamw
        assert c.optimizer.lr == pytest.approx(3e-4) and c.gradient_accumulation_steps == 4
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    assert zs.Config.from_json_file(path).stage == 2
    assert zs.Config.from_json_file(str(path)).gradient_clipping == 1.0


def test_unknown_keyword_is_a_config_error_naming_it():
    with pytest.raises(zs.ConfigError) as e:
        zs.Config(stag=2)
    assert "'stag'" in str(e.value) and "did you mean 'stage'" in str(e.value)
    assert e.value.code == "invalid_config"
    assert isinstance(e.value, ValueError) and isinstance(e.value, zs.Error)


def test_wrong_type_and_bad_value():
    with pytest.raises(zs.ConfigError, match=r"Config\.stage must be an integer, got str"):
        zs.Config(stage="two")
    with pytest.raises(zs.ConfigError, match=r"OptimizerOptions\.lr must be a number"):
        zs.Config(optimizer={"lr": "fast"})
    with pytest.raises(zs.ConfigError, match=r"offload device = 'gpu' is not one of"):
        zs.Config(offload_optimizer="gpu")
    # Keyword construction validates at once, with the C++ rule's message.
    with pytest.raises(zs.ConfigError, match=r"zero_optimization\.stage = 7 is out of range"):
        zs.Config(stage=7)


def test_bad_deepspeed_key_carries_the_cpp_message():
    # The dict goes through the C++ reader, so the message is the C++ one, key path included.
    with pytest.raises(zs.ConfigError) as e:
        zs.Config.from_dict({"zero_optimization": {"stage": 2, "offload_optimizer": {"devic": "cpu"}}})
    msg = str(e.value)
    assert msg.startswith("config: unknown key")
    assert "zero_optimization.offload_optimizer.devic" in msg and "did you mean" in msg
    with pytest.raises(zs.ConfigError, match="invalid JSON"):
        zs.Config.from_json("{")
    with pytest.raises(zs.ConfigError, match="not JSON-serializable"):
        zs.Config.from_dict({"gradient_clipping": object()})


def test_copy_is_independent():
    a = zs.Config(stage=1)
    b = a.copy()
    b.stage = 2
    assert a.stage == 1 and b.stage == 2


def test_device_keywords_round_trip():
    # Parsing only: no engine is made, so this holds on a build without CUDA too.
    c = zs.Config(device="cuda")
    assert c.device == zs.Device.cuda and c.device_index == -1  # -1: the local rank's GPU
    assert "device='cuda', device_index=-1" in repr(c)
    c = zs.Config(device=zs.Device.cuda, device_index=1)
    assert c.device == zs.Device.cuda and c.device_index == 1
    assert zs.Config().device == zs.Device.cpu and "device_index" not in repr(zs.Config())
    # A torch.device's spelling names the index too.
    c = zs.Config(device="cuda:2")
    assert c.device == zs.Device.cuda and c.device_index == 2
    c.device = "cpu"
    assert c.device == zs.Device.cpu
    c.device_index = 0
    assert c.device_index == 0
    # The JSON/DeepSpeed reader's keys give the same Config.
    d = zs.Config.from_dict({"zeroshard": {"device": "cuda", "device_index": 1}})
    assert d.device == zs.Device.cuda and d.device_index == 1
    assert d.copy().device == zs.Device.cuda


def test_torch_device_spelling():
    torch = pytest.importorskip("torch")
    c = zs.Config(device=torch.device("cuda", 3))
    assert c.device == zs.Device.cuda and c.device_index == 3
    assert zs.Config(device=torch.device("cpu")).device == zs.Device.cpu


def test_bad_device_values():
    for bad in ("gpu", "cuda:x", "cuda:", "", 1):
        with pytest.raises(zs.ConfigError,
                           match=r"config: device = .* is not one of \"cpu\", \"cuda\""):
            zs.Config(device=bad)
    with pytest.raises(zs.ConfigError, match=r"Config\.device_index must be an integer, got str"):
        zs.Config(device_index="0")
    with pytest.raises(zs.ConfigError, match=r"Config\.device_index must be an integer, got bool"):
        zs.Config(device_index=True)
    # The C++ rule: -1 or a GPU index.
    with pytest.raises(zs.ConfigError, match=r"zeroshard\.device_index = -2"):
        zs.Config(device="cuda", device_index=-2)
    with pytest.raises(zs.ConfigError, match=r"\"zeroshard\.device\" = \"tpu\" is not one of"):
        zs.Config.from_dict({"zeroshard": {"device": "tpu"}})


def _other_value(v):
    """A value of the same type as v that differs from it."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int) and not hasattr(v, "name"):
        return v + 1
    if isinstance(v, float):
        return 0.5 if v == 0 else v / 2
    if isinstance(v, list):
        return ["/tmp/zs_a", "/tmp/zs_b"]
    members = list(type(v))  # an enum: another of its members
    return next(m for m in members if m != v)


_OPTION_CLASSES = (zs.OptimizerOptions, zs.OffloadOptions, zs.LossScaleOptions, zs.AioOptions)


@pytest.mark.parametrize("cls", (zs.Config,) + _OPTION_CLASSES, ids=lambda c: c.__name__)
def test_every_table_field_round_trips_through_attributes_and_keywords(cls):
    # The properties are made from the C++ field table, so this covers every field it lists.
    names = cls.fields()
    assert names and len(set(names)) == len(names)
    for name in names:
        obj = cls()
        value = getattr(obj, name)
        if isinstance(value, _OPTION_CLASSES):
            # Nested options: a reference into the Config; assigning a copy back keeps it.
            setattr(obj, name, type(value)())
            assert isinstance(getattr(obj, name), type(value))
            continue
        new = _other_value(value)
        setattr(obj, name, new)
        got = getattr(obj, name)
        assert (got == pytest.approx(new) if isinstance(new, float) else got == new), name
        if cls is not zs.Config:  # Config's keywords validate: covered by the tests above
            assert getattr(cls(**{name: new}), name) == getattr(obj, name), name


def test_config_fields_include_the_ones_the_model_check_needs():
    names = zs.Config.fields()
    for name in ("stage", "dtype", "prefetch", "max_live_units", "overlap_comm",
                 "swap_read_ahead", "optimizer", "offload_optimizer", "offload_param"):
        assert name in names
    # DeepSpeed's names for an offload tier's fields are accepted too.
    off = zs.OffloadOptions(device="cpu", nvme_path="/tmp/zs_a")
    assert off.tier == zs.Tier.host and off.nvme_paths == ["/tmp/zs_a"] and off.device == off.tier
    with pytest.raises(zs.ConfigError, match=r"did you mean 'buffer_count'"):
        zs.OffloadOptions(bufer_count=2)


def test_optimizer_state_format_keywords_and_json():
    c = zs.Config(optimizer_state="8bit", state_block=256)
    assert c.optimizer_state == zs.StateFormat.q8 and c.state_block == 256
    assert zs.Config(optimizer_state=zs.StateFormat.bf16).optimizer_state == zs.StateFormat.bf16
    j = zs.Config.from_json('{"zeroshard": {"optimizer_state": "bf16"}}')
    assert j.optimizer_state == zs.StateFormat.bf16
    with pytest.raises(zs.ConfigError) as e:
        zs.Config(optimizer_state="int8")
    assert "optimizer_state" in str(e.value) and "8bit" in str(e.value)
    with pytest.raises(zs.ConfigError) as e:
        zs.Config.from_json('{"zeroshard": {"state_block": 1000}}').validate()
    assert "zeroshard.state_block" in str(e.value) and "power of two" in str(e.value)


def test_bf16_master_keyword_json_and_its_requirements():
    c = zs.Config(dtype="bf16", bf16_master=True)
    assert c.bf16_master
    c.validate()
    assert zs.Config.from_json('{"bf16": {"enabled": true}, "zeroshard": {"bf16_master": true}}').bf16_master
    with pytest.raises(zs.ConfigError, match=r"bf16_master = true requires bf16"):
        zs.Config(bf16_master=True).validate()  # f32 parameters
    with pytest.raises(zs.ConfigError, match=r"bf16_master"):
        zs.Config(bf16_master=1)


def test_shard_group_size_keyword_and_deepspeeds_mics_key():
    assert zs.Config(shard_group_size=4).shard_group_size == 4
    assert zs.Config.from_json('{"zero_optimization": {"mics_shard_size": 2}}').shard_group_size == 2
    assert zs.Config.from_json('{"zero_optimization": {"mics_shard_size": -1}}').shard_group_size == 0


def test_speculative_step_takes_true_false_and_auto():
    # "auto" (the default) lets the engine decide; DeepSpeed's super_offload sets it on or off.
    assert zs.Config().speculative_step == zs.SpeculativeStep.automatic
    assert zs.Config(speculative_step=True).speculative_step == zs.SpeculativeStep.on
    assert zs.Config(speculative_step=False).speculative_step == zs.SpeculativeStep.off
    assert zs.Config(speculative_step="auto").speculative_step == zs.SpeculativeStep.automatic
    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme",
                                                                  "nvme_path": "/tmp",
                                                                  "super_offload": False}}}
    assert zs.Config.from_dict(ds).speculative_step == zs.SpeculativeStep.off
    with pytest.raises(zs.ConfigError, match='speculative_step.*"auto"'):
        zs.Config(speculative_step="yes")
