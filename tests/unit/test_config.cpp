// Config: defaults, the DeepSpeed JSON mapping, and every error naming what is wrong.
// Each failure case checks the message text, not just that something threw: a message that does
// not name the key is a bug for the user reading it.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "zeroshard/communicator.hpp"
#include "zeroshard/config.hpp"
#include "zeroshard/engine.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// Runs `f`, expects Error(invalid_config) and returns its message ("" and a failure otherwise).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_config) << e.what();
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than zeroshard::Error: " << e.what();
    return {};
  }
  ADD_FAILURE() << "no error was thrown";
  return {};
}

std::string parse_error(const std::string& text) {
  return error_of([&] { Config::from_json(text); });
}

std::string validate_error(const Config& c) {
  return error_of([&] { c.validate(); });
}

TEST(Config, DefaultsAreValidAndMatchTheEmptyObject) {
  const Config d;
  EXPECT_NO_THROW(d.validate());
  EXPECT_EQ(d.stage, 0);
  EXPECT_EQ(d.dtype, DType::f32);
  EXPECT_EQ(d.optimizer.kind, OptimizerKind::adamw);
  EXPECT_EQ(d.offload_optimizer.tier, Tier::device);
  EXPECT_EQ(d.offload_param.tier, Tier::device);
  EXPECT_EQ(d.aio.block_size, 1 << 20);
  EXPECT_EQ(d.gradient_accumulation_steps, 1);

  // "{}" changes nothing: compare the fields a reader could plausibly touch.
  const Config c = Config::from_json("{}");
  EXPECT_EQ(c.stage, d.stage);
  EXPECT_EQ(c.dtype, d.dtype);
  EXPECT_EQ(c.optimizer.kind, d.optimizer.kind);
  EXPECT_EQ(c.optimizer.weight_decay, d.optimizer.weight_decay);
  EXPECT_EQ(c.loss_scale.window, d.loss_scale.window);
  EXPECT_EQ(c.gradient_clipping, d.gradient_clipping);
  EXPECT_EQ(c.shard_alignment, d.shard_alignment);
  EXPECT_EQ(c.max_live_units, d.max_live_units);
  EXPECT_EQ(c.reduce_bucket_size, d.reduce_bucket_size);
}

TEST(Config, OptimizerNames) {
  EXPECT_STREQ(optimizer_name(OptimizerKind::adam), "adam");
  EXPECT_STREQ(optimizer_name(OptimizerKind::adamw), "adamw");
  EXPECT_STREQ(optimizer_name(OptimizerKind::sgd), "sgd");
  EXPECT_STREQ(optimizer_name(OptimizerKind::lion), "lion");
}

// The shape of a ZeRO-Infinity config as found in the wild (Hugging Face's ds_config_zero3 with
// nvme offload), with "auto" filled in. Every value differs from its default so that a reader
// that drops a key fails here.
constexpr const char* kZero3Nvme = R"({
  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "loss_scale_window": 500,
    "initial_scale_power": 12,
    "hysteresis": 3,
    "min_loss_scale": 0.5
  },
  "optimizer": {
    "params": {
      "lr": 3e-5,
      "betas": [0.8, 0.95],
      "eps": 1e-6,
      "weight_decay": 0.1
    },
    "type": "AdamW"
  },
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": false,
      "buffer_count": 6,
      "fast_init": false
    },
    "offload_param": {
      "device": "cpu",
      "pin_memory": true,
      "buffer_count": 7,
      "buffer_size": 1e8,
      "max_in_cpu": 1e9
    },
    "overlap_comm": false,
    "contiguous_gradients": true,
    "sub_group_size": 1e9,
    "reduce_bucket_size": 16777216,
    "allgather_bucket_size": 2e8,
    "stage3_prefetch_bucket_size": 15099494,
    "stage3_param_persistence_threshold": 40960,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true
  },
  "aio": {
    "block_size": 262144,
    "queue_depth": 32,
    "thread_count": 1,
    "single_submit": false,
    "overlap_events": true
  },
  "zeroshard": {
    "shard_alignment": 256,
    "grad_buffers": 3,
    "max_live_units": 4,
    "prefetch": false,
    "collective_timeout_s": 60
  },
  "gradient_accumulation_steps": 4,
  "gradient_clipping": 1.0,
  "steps_per_print": 2000,
  "train_batch_size": 128,
  "train_micro_batch_size_per_gpu": 8,
  "wall_clock_breakdown": false
})";

TEST(Config, FullDeepSpeedZero3NvmeConfigMapsToEveryField) {
  const Config c = Config::from_json(kZero3Nvme);
  EXPECT_EQ(c.stage, 3);
  EXPECT_EQ(c.dtype, DType::f16);
  EXPECT_EQ(c.loss_scale.static_scale, 0.0f);
  EXPECT_EQ(c.loss_scale.window, 500);
  EXPECT_EQ(c.loss_scale.initial_scale_power, 12);
  EXPECT_EQ(c.loss_scale.hysteresis, 3);
  EXPECT_EQ(c.loss_scale.min_scale, 0.5f);

  EXPECT_EQ(c.optimizer.kind, OptimizerKind::adamw);
  EXPECT_EQ(c.optimizer.lr, 3e-5f);
  EXPECT_EQ(c.optimizer.beta1, 0.8f);
  EXPECT_EQ(c.optimizer.beta2, 0.95f);
  EXPECT_EQ(c.optimizer.eps, 1e-6f);
  EXPECT_EQ(c.optimizer.weight_decay, 0.1f);

  EXPECT_EQ(c.offload_optimizer.tier, Tier::nvme);
  ASSERT_EQ(c.offload_optimizer.nvme_paths.size(), 1u);
  EXPECT_EQ(c.offload_optimizer.nvme_paths[0], "/local_nvme");
  EXPECT_FALSE(c.offload_optimizer.pin_memory);
  EXPECT_EQ(c.offload_optimizer.buffer_count, 6);
  EXPECT_EQ(c.offload_param.tier, Tier::host);
  EXPECT_TRUE(c.offload_param.nvme_paths.empty());
  EXPECT_EQ(c.offload_param.buffer_count, 7);

  EXPECT_FALSE(c.overlap_comm);
  EXPECT_EQ(c.reduce_bucket_size, 16777216);
  EXPECT_EQ(c.allgather_bucket_size, 200000000);  // written as 2e8
  EXPECT_EQ(c.aio.block_size, 262144);
  EXPECT_EQ(c.aio.queue_depth, 32);
  EXPECT_EQ(c.shard_alignment, 256);
  EXPECT_EQ(c.grad_buffers, 3);
  EXPECT_EQ(c.max_live_units, 4);
  EXPECT_FALSE(c.prefetch);
  EXPECT_EQ(c.collective_timeout_s, 60.0);
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  EXPECT_EQ(c.gradient_clipping, 1.0);
}

// Hugging Face's stock ZeRO-2 file (cpu offload, allgather_partitions, reduce_scatter true).
TEST(Config, HuggingFaceZero2ConfigLoads) {
  const Config c = Config::from_json(R"({
    "bf16": {"enabled": true},
    "zero_optimization": {
      "stage": 2,
      "offload_optimizer": {"device": "cpu", "pin_memory": true},
      "allgather_partitions": true,
      "allgather_bucket_size": 2e8,
      "overlap_comm": true,
      "reduce_scatter": true,
      "reduce_bucket_size": 2e8,
      "contiguous_gradients": true
    },
    "gradient_clipping": 0.5
  })");
  EXPECT_EQ(c.stage, 2);
  EXPECT_EQ(c.dtype, DType::bf16);
  EXPECT_EQ(c.offload_optimizer.tier, Tier::host);
  EXPECT_EQ(c.reduce_bucket_size, 200000000);
  EXPECT_EQ(c.gradient_clipping, 0.5);
}

TEST(Config, Bf16AndDisabledFp16) {
  EXPECT_EQ(Config::from_json(R"({"bf16": {"enabled": true}})").dtype, DType::bf16);
  EXPECT_EQ(Config::from_json(R"({"fp16": {"enabled": false}, "bf16": {"enabled": true}})").dtype,
            DType::bf16);
  EXPECT_EQ(Config::from_json(R"({"bf16": {"enabled": false}})").dtype, DType::f32);
}

TEST(Config, Fp16AndBf16TogetherIsAnError) {
  EXPECT_THAT(parse_error(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})"),
              AllOf(StartsWith("config: "), HasSubstr("fp16.enabled and bf16.enabled")));
}

TEST(Config, NvmePathArrayAndStaticLossScale) {
  const Config c = Config::from_json(R"({
    "zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": ["/nvme0", "/nvme1"]}},
    "fp16": {"enabled": true, "loss_scale": 128}
  })");
  EXPECT_EQ(c.offload_param.tier, Tier::nvme);
  EXPECT_EQ(c.offload_param.nvme_paths, (std::vector<std::string>{"/nvme0", "/nvme1"}));
  EXPECT_EQ(c.loss_scale.static_scale, 128.0f);
}

TEST(Config, OptimizerTypesAndAdamWMode) {
  // DeepSpeed's "Adam" means AdamW unless adam_w_mode is false; names are case-insensitive.
  EXPECT_EQ(Config::from_json(R"({"optimizer": {"type": "Adam"}})").optimizer.kind,
            OptimizerKind::adamw);
  EXPECT_EQ(
      Config::from_json(R"({"optimizer": {"type": "adam", "params": {"adam_w_mode": false}}})")
          .optimizer.kind,
      OptimizerKind::adam);
  EXPECT_EQ(Config::from_json(R"({"optimizer": {"type": "LION"}})").optimizer.kind,
            OptimizerKind::lion);

  // An optimizer block takes DeepSpeed's defaults for what it leaves out: weight_decay 0.
  EXPECT_EQ(Config::from_json(R"({"optimizer": {"type": "AdamW"}})").optimizer.weight_decay, 0.0f);

  const Config sgd = Config::from_json(
      R"({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": true}}})");
  EXPECT_EQ(sgd.optimizer.kind, OptimizerKind::sgd);
  EXPECT_EQ(sgd.optimizer.lr, 0.1f);
  EXPECT_EQ(sgd.optimizer.momentum, 0.9f);
  EXPECT_TRUE(sgd.optimizer.nesterov);
}

TEST(Config, OptimizerErrors) {
  EXPECT_THAT(
      parse_error(R"({"optimizer": {"type": "Lamb"}})"),
      AllOf(HasSubstr("\"optimizer.type\""), HasSubstr("Lamb"), HasSubstr("not supported")));
  EXPECT_THAT(parse_error(R"({"optimizer": {"params": {"lr": 1}}})"),
              HasSubstr("missing key \"optimizer.type\""));
  EXPECT_THAT(parse_error(R"({"optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}})"),
              AllOf(HasSubstr("\"optimizer.params.momentum\""), HasSubstr("applies only to sgd")));
  EXPECT_THAT(parse_error(R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})"),
              AllOf(HasSubstr("\"optimizer.params.adam_w_mode\""), HasSubstr("contradicts")));
  EXPECT_THAT(parse_error(R"({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}})"),
              AllOf(HasSubstr("\"optimizer.params.betas\""),
                    HasSubstr("must be an array of 2 numbers, got array")));
  EXPECT_THAT(parse_error(R"({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}})"),
              HasSubstr("optimizer.params.betas[1] = 1 must be in [0, 1)"));
  EXPECT_THAT(parse_error(R"({"optimizer": {"type": "SGD", "params": {"nesterov": true}}})"),
              HasSubstr("nesterov = true requires optimizer sgd with momentum > 0"));
}

TEST(Config, Muon) {
  // torch.optim.Muon's momentum, Nesterov and eps; DeepSpeed's weight decay 0.
  const Config m = Config::from_json(
      R"({"optimizer": {"type": "Muon", "params": {"lr": 0.02, "ns_steps": 3,
                                                    "match_rms_adamw": true}}})");
  EXPECT_EQ(m.optimizer.kind, OptimizerKind::muon);
  EXPECT_EQ(m.optimizer.momentum, 0.95f);
  EXPECT_TRUE(m.optimizer.nesterov);
  EXPECT_EQ(m.optimizer.eps, 1e-7f);
  EXPECT_EQ(m.optimizer.weight_decay, 0.0f);
  EXPECT_EQ(m.optimizer.ns_steps, 3);
  EXPECT_TRUE(m.optimizer.match_rms_adamw);
  EXPECT_THAT(parse_error(R"({"optimizer": {"type": "AdamW", "params": {"ns_steps": 5}}})"),
              AllOf(HasSubstr("\"optimizer.params.ns_steps\""), HasSubstr("muon")));
  EXPECT_THAT(parse_error(R"({"optimizer": {"type": "Muon", "params": {"momentum": 1.0}}})"),
              HasSubstr("must be in [0, 1) for muon"));
  EXPECT_THAT(parse_error(R"({"optimizer": {"type": "Muon", "params": {"ns_steps": 0}}})"),
              HasSubstr("must be in [1, 100]"));
  // A GPU engine runs Muon with the state on the GPU (its kernels and cuBLAS) or offloaded (the
  // CPU's update and iteration, the exchange staged through device buffers for NCCL).
  for (bool cuda : {true, false}) {
    Config gpu = m;
    if (cuda)
      gpu.device = Device::cuda;
    else
      gpu.async_device = true;
    EXPECT_NO_THROW(gpu.validate()) << cuda;
    gpu.offload_optimizer.tier = Tier::host;
    gpu.stage = 1;
    EXPECT_NO_THROW(gpu.validate()) << cuda;
  }
  Config nvme_params = m;
  nvme_params.stage = 3;
  nvme_params.offload_param.tier = Tier::nvme;
  nvme_params.offload_param.nvme_paths = {"/tmp"};
  nvme_params.offload_optimizer.tier = Tier::host;
  EXPECT_THAT(validate_error(nvme_params), HasSubstr("offload_optimizer.device = nvme"));
  nvme_params.offload_optimizer.tier = Tier::nvme;
  nvme_params.offload_optimizer.nvme_paths = {"/tmp"};
  EXPECT_NO_THROW(nvme_params.validate());
  EXPECT_TRUE(group_kind_allowed(OptimizerKind::muon, OptimizerKind::adamw));
  EXPECT_FALSE(group_kind_allowed(OptimizerKind::adamw, OptimizerKind::muon));
  EXPECT_FALSE(group_kind_allowed(OptimizerKind::muon, OptimizerKind::sgd));
}

TEST(Config, UnknownKeyAtTopLevelNamesItAndSuggests) {
  EXPECT_THAT(parse_error(R"({"gradient_cliping": 1.0})"),
              AllOf(StartsWith("config: "), HasSubstr("unknown key \"gradient_cliping\""),
                    HasSubstr("did you mean \"gradient_clipping\"")));
  // A known key in the wrong section points at where it belongs.
  EXPECT_THAT(parse_error(R"({"stage": 2})"),
              AllOf(HasSubstr("unknown key \"stage\""),
                    HasSubstr("did you mean \"zero_optimization.stage\"")));
  EXPECT_THAT(parse_error(R"({"scheduler": {"type": "WarmupLR"}})"),
              AllOf(HasSubstr("unknown key \"scheduler\""), HasSubstr("learning rate")));
}

TEST(Config, UnknownNestedKeyNamesTheFullPath) {
  EXPECT_THAT(
      parse_error(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"devic": "cpu"}}})"),
      AllOf(HasSubstr("unknown key \"zero_optimization.offload_optimizer.devic\""),
            HasSubstr("did you mean \"zero_optimization.offload_optimizer.device\"")));
  // (fp16.consecutive_hysteresis was this example until it became a key: issue 12.)
  EXPECT_THAT(parse_error(R"({"fp16": {"enabled": true, "fp16_master_weights": true}})"),
              HasSubstr("unknown key \"fp16.fp16_master_weights\""));
}

TEST(Config, WrongTypesNameTheKeyAndBothTypes) {
  EXPECT_THAT(parse_error(R"({"fp16": {"enabled": "true"}})"),
              HasSubstr("\"fp16.enabled\" must be a boolean, got string"));
  EXPECT_THAT(parse_error(R"({"zero_optimization": {"stage": "3"}})"),
              HasSubstr("\"zero_optimization.stage\" must be an integer, got string"));
  EXPECT_THAT(parse_error(R"({"zero_optimization": []})"),
              HasSubstr("\"zero_optimization\" must be an object, got array"));
  EXPECT_THAT(parse_error(R"({"gradient_clipping": true})"),
              HasSubstr("\"gradient_clipping\" must be a number, got boolean"));
  EXPECT_THAT(parse_error(R"({"zero_optimization": {"offload_param": {"nvme_path": 5}}})"),
              HasSubstr("\"zero_optimization.offload_param.nvme_path\" must be a string or an "
                        "array of strings, got number"));
  // Hugging Face's "auto" placeholder gets an explanation.
  EXPECT_THAT(parse_error(R"({"train_batch_size": "auto"})"),
              AllOf(HasSubstr("\"train_batch_size\" must be an integer, got string"),
                    HasSubstr("Hugging Face")));
  EXPECT_THAT(parse_error(R"({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})"),
              AllOf(HasSubstr("\"zero_optimization.offload_optimizer.device\""),
                    HasSubstr("\"gpu\" is not one of")));
}

TEST(Config, FloatsAreAcceptedForIntegersOnlyWhenIntegral) {
  const Config c = Config::from_json(R"({"zero_optimization": {"reduce_bucket_size": 5e8}})");
  EXPECT_EQ(c.reduce_bucket_size, 500000000);
  EXPECT_THAT(parse_error(R"({"zero_optimization": {"reduce_bucket_size": 5.5}})"),
              HasSubstr("\"zero_optimization.reduce_bucket_size\" must be an integer, got 5.5"));
  EXPECT_THAT(parse_error(R"({"zero_optimization": {"stage": 1e10}})"),
              HasSubstr("\"zero_optimization.stage\" = 1e+10 is out of range for a 32-bit"));
  EXPECT_THAT(parse_error(R"({"train_batch_size": -1})"),
              HasSubstr("\"train_batch_size\" = -1 must be >= 0"));
  // In a file a batch size is a size (C++'s 0 "not given" is leaving the key out, or null).
  EXPECT_THAT(parse_error(R"({"train_micro_batch_size_per_gpu": 0})"),
              HasSubstr("\"train_micro_batch_size_per_gpu\" = 0 must be >= 1"));
  EXPECT_EQ(Config::from_json(R"({"train_batch_size": null})").train_batch_size, 0);
}

TEST(Config, DeepSpeedValuesWithoutAnEquivalentAreErrorsThatSayWhy) {
  EXPECT_THAT(parse_error(R"({"zero_optimization": {"reduce_scatter": false}})"),
              AllOf(HasSubstr("\"zero_optimization.reduce_scatter\""),
                    HasSubstr("always reduce-scatters")));
  EXPECT_THAT(parse_error(R"({"zero_optimization": {"offload_optimizer": {"ratio": 0.3}}})"),
              AllOf(HasSubstr("\"zero_optimization.offload_optimizer.ratio\" = 0.3"),
                    HasSubstr("partial offload")));
  EXPECT_NO_THROW(
      Config::from_json(R"({"zero_optimization": {"offload_optimizer": {"ratio": 1}}})"));
}

// SuperOffload's speculation-then-validation is zeroshard's speculative_step, under either name;
// left out, the engine decides ("auto").
TEST(Config, SuperOffloadIsTheSpeculativeStep) {
  EXPECT_EQ(Config{}.speculative_step, SpeculativeStep::automatic);
  EXPECT_EQ(Config::from_json(R"({"zero_optimization": {"offload_optimizer":
      {"device": "cpu", "super_offload": true, "cpuadam_cores_perc": 0.9}}})")
                .speculative_step,
            SpeculativeStep::on);
  EXPECT_EQ(Config::from_json(R"({"zeroshard": {"speculative_step": true}})").speculative_step,
            SpeculativeStep::on);
  EXPECT_EQ(Config::from_json(R"({"zeroshard": {"speculative_step": false}})").speculative_step,
            SpeculativeStep::off);
  EXPECT_EQ(Config::from_json(R"({"zeroshard": {"speculative_step": "auto"}})").speculative_step,
            SpeculativeStep::automatic);
  EXPECT_THAT(parse_error(R"({"zeroshard": {"speculative_step": "yes"}})"),
              HasSubstr("speculative_step"));
  EXPECT_THAT(parse_error(R"({"zero_optimization": {"offload_optimizer":
      {"cpuadam_cores_perc": 0}}})"),
              AllOf(HasSubstr("cpuadam_cores_perc"), HasSubstr("(0, 1]")));
}

// DeepSpeed keys of the fp16/bf16 sections in common use: taken with DeepSpeed's meaning, or
// refused with the reason; and gradient clipping, absent, is off (DeepSpeed's default was 0.0
// until its recent versions made it 1.0; README says so).
TEST(Config, DeepSpeedPrecisionKeysAndClippingDefault) {
  EXPECT_FALSE(Config::from_json("{}").loss_scale.consecutive_hysteresis);
  EXPECT_TRUE(Config::from_json(R"({"fp16": {"enabled": true, "consecutive_hysteresis": true}})")
                  .loss_scale.consecutive_hysteresis);
  EXPECT_NO_THROW(Config::from_json(R"({"bf16": {"enabled": true, "check_grad_overflow": true}})"));
  EXPECT_THAT(parse_error(R"({"bf16": {"enabled": true, "check_grad_overflow": false}})"),
              AllOf(HasSubstr("\"bf16.check_grad_overflow\" = false"),
                    HasSubstr("always skips a step whose gradients hold inf or NaN")));
  for (const char* v : {"true", "false"})
    EXPECT_EQ(Config::from_json(std::string(R"({"bf16": {"enabled": true, )"
                                            R"("immediate_grad_update": )") +
                                v + "}}")
                  .dtype,
              DType::bf16);
  EXPECT_EQ(Config::from_json(R"({"zero_optimization": {"stage": 2}})").gradient_clipping, 0.0);
  // A NUL byte, in a string or after the document, is refused at its offset.
  EXPECT_THAT(parse_error(std::string("{\"zeroshard\": {\"device\": \"c\0pu\"}}", 33)),
              HasSubstr("a NUL byte at offset 27"));
  EXPECT_THAT(parse_error(std::string("{}\0{\"stage\": 9}", 15)),
              HasSubstr("a NUL byte at offset 2"));
  // DeepSpeed's default, in many configs: unused parameters are tolerated.
  EXPECT_NO_THROW(Config::from_json(
      R"({"zero_optimization": {"stage": 2, "ignore_unused_parameters": true}})"));
  EXPECT_THAT(parse_error(R"({"zero_optimization": {"ignore_unused_parameters": false}})"),
              AllOf(HasSubstr("\"zero_optimization.ignore_unused_parameters\" = false"),
                    HasSubstr("always tolerates a parameter that gets no gradient")));
}

// What real DeepSpeed files hold, taken as DeepSpeed takes it: each case comes from a published
// configuration that failed to load or trained differently before.
TEST(Config, DeepSpeedFilesFromTheWild) {
  // A disabled fp16 section's loss scale is ignored (it divided bf16 gradients by 1024), and a
  // static scale on anything but f16 is refused where it is set by hand.
  for (const char* doc :
       {R"({"fp16": {"enabled": false, "loss_scale": 1024}})",
        R"({"fp16": {"enabled": false, "loss_scale": 1024}, "bf16": {"enabled": true}})"}) {
    const Config c = Config::from_json(doc);
    EXPECT_EQ(c.loss_scale.static_scale, 0.0f) << doc;
    EXPECT_EQ(Engine(c, make_self_communicator()).loss_scale(), 1.0f) << doc;
  }
  Config bf;
  bf.dtype = DType::bf16;
  bf.loss_scale.static_scale = 128;
  EXPECT_THAT(validate_error(bf),
              HasSubstr("fp16.loss_scale = 128 applies to f16 parameters only"));
  // torch_adam: DeepSpeed builds torch.optim.AdamW, whose weight decay defaults to 0.01.
  EXPECT_FLOAT_EQ(
      Config::from_json(R"({"optimizer": {"type": "AdamW", "params": {"torch_adam": true}}})")
          .optimizer.weight_decay,
      0.01f);
  EXPECT_EQ(
      Config::from_json(
          R"({"optimizer": {"type": "AdamW", "params": {"torch_adam": true, "weight_decay": 0}}})")
          .optimizer.weight_decay,
      0.0f);
  EXPECT_EQ(
      Config::from_json(R"({"optimizer": {"type": "AdamW", "params": {}}})").optimizer.weight_decay,
      0.0f);  // DeepSpeed's fused AdamW
  // Keys for other parts of DeepSpeed, or with nothing to change here, load.
  const Config c = Config::from_json(R"({
    // a comment, as DeepSpeed's hjson reader allows
    "zero_allow_untested_optimizer": true, "prescale_gradients": false, "memory_breakdown": false,
    "tensorboard": {"enabled": true, "output_path": "logs/"}, "flops_profiler": {"enabled": false},
    "activation_checkpointing": {"partition_activations": false},
    "bfloat16": {"enabled": true}, /* the old name of bf16 */
    "zero_optimization": {"stage": 3, "round_robin_gradients": true, "reduce_bucket_size": "auto",
      "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
      "allgather_bucket_size": 0,
      "offload_optimizer": {"device": "cpu", "nvme_path": null}},
    "train_micro_batch_size_per_gpu": null
  })");
  EXPECT_EQ(c.dtype, DType::bf16);
  EXPECT_EQ(c.stage, 3);
  EXPECT_EQ(c.offload_optimizer.tier, Tier::host);
  // Refused with the way out, not as a bare unknown key.
  EXPECT_THAT(parse_error(R"({"zero_optimization": {"cpu_offload": true}})"),
              HasSubstr(R"(write "offload_optimizer": {"device": "cpu"} instead)"));
  EXPECT_THAT(parse_error(R"({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}})"),
              HasSubstr("gradient_clipping"));
  EXPECT_THAT(parse_error(R"({"communication_data_type": "fp32"})"),
              HasSubstr("reduces gradients in the parameters' dtype"));
  EXPECT_THAT(
      parse_error(R"({"optimizer": {"type": "Adam", "params": {"bias_correction": false}}})"),
      HasSubstr("always corrects the moments' bias"));
  EXPECT_NO_THROW(
      Config::from_json(R"({"optimizer": {"type": "Adam", "params": {"bias_correction": true}}})"));
  // Values that would not be what the file says.
  EXPECT_THAT(parse_error(R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e-50}}})"),
              HasSubstr("below the smallest 32-bit float"));
  EXPECT_THAT(parse_error(R"({"zero_optimization": {"stage": null}})"),
              HasSubstr("must be an integer, got null"));
  EXPECT_THAT(parse_error(R"({"tensorboard": true})"), HasSubstr("must be an object"));
  EXPECT_THAT(parse_error("{\"fp16\": {\"enabled\": true,}}"),
              HasSubstr("comments // and /* */ are allowed"));
  // A number no double holds is no syntax error: no note on comments there.
  EXPECT_THAT(parse_error(R"({"optimizer": {"type": "AdamW", "params": {"lr": 1e309}}})"),
              AllOf(HasSubstr("invalid JSON"), Not(HasSubstr("comments"))));
}

TEST(Config, SyntaxErrorsDuplicatesAndNonObjects) {
  EXPECT_THAT(parse_error(R"({"fp16": {"enabled": true,}})"),
              AllOf(StartsWith("config: invalid JSON: "), HasSubstr("line 1, column")));
  EXPECT_THAT(parse_error(""), HasSubstr("invalid JSON"));
  EXPECT_THAT(parse_error("[1, 2]"), HasSubstr("top level must be a JSON object, got array"));
  EXPECT_THAT(parse_error(R"({"zero_optimization": {"stage": 1, "stage": 2}})"),
              HasSubstr("duplicate key \"zero_optimization.stage\""));
}

TEST(Config, ValidateNamesFieldValueAndRule) {
  Config c;
  c.stage = 4;
  EXPECT_EQ(validate_error(c), "config: zero_optimization.stage = 4 is out of range (0..3)");
  // Through JSON too, since from_json validates.
  EXPECT_THAT(parse_error(R"({"zero_optimization": {"stage": -1}})"),
              HasSubstr("zero_optimization.stage = -1 is out of range (0..3)"));

  c = Config{};
  c.offload_optimizer.tier = Tier::nvme;
  EXPECT_THAT(validate_error(c),
              HasSubstr("zero_optimization.offload_optimizer.device = nvme requires "
                        "zero_optimization.offload_optimizer.nvme_path"));

  c = Config{};
  c.stage = 2;
  c.offload_param.tier = Tier::host;
  EXPECT_THAT(validate_error(c),
              AllOf(HasSubstr("zero_optimization.offload_param.device = cpu"),
                    HasSubstr("requires zero_optimization.stage = 3"), HasSubstr("(stage is 2)")));

  c = Config{};
  c.aio.block_size = 1000;
  EXPECT_THAT(validate_error(c),
              HasSubstr("aio.block_size = 1000 must be a positive multiple of 4096"));

  c = Config{};
  c.max_live_units = 0;
  EXPECT_THAT(validate_error(c), HasSubstr("zeroshard.max_live_units = 0 must be >= 1"));
  c.stage = 3;
  c.max_live_units = 1;  // with prefetch, which needs a second buffer
  EXPECT_THAT(validate_error(c),
              AllOf(HasSubstr("zeroshard.max_live_units = 1 leaves no buffer to prefetch into"),
                    HasSubstr("zeroshard.prefetch = false")));
  c.prefetch = false;
  EXPECT_NO_THROW(c.validate());

  c = Config{};
  c.loss_scale.window = 0;
  EXPECT_THAT(validate_error(c), HasSubstr("fp16.loss_scale_window = 0 must be >= 1 with dynamic"));
  c.dtype = DType::f16;
  c.loss_scale.static_scale = 128;  // a static scale counts no window: 0 is valid
  EXPECT_NO_THROW(c.validate());

  c = Config{};
  c.optimizer.eps = 0;
  EXPECT_THAT(validate_error(c), HasSubstr("optimizer.params.eps = 0 must be finite and > 0"));

  c = Config{};
  c.gradient_clipping = -1;
  EXPECT_THAT(validate_error(c), HasSubstr("gradient_clipping = -1 must be finite and >= 0"));

  c = Config{};
  c.collective_timeout_s = 0;
  EXPECT_THAT(validate_error(c), HasSubstr("zeroshard.collective_timeout_s = 0"));
}

// A file in a fresh temporary directory, removed by the destructor.
class TempFile {
 public:
  explicit TempFile(const std::string& text) {
    path_ = std::filesystem::temp_directory_path() /
            ("zeroshard_test_config_" + std::to_string(::getpid()) + ".json");
    std::ofstream(path_) << text;
  }
  ~TempFile() {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

TEST(Config, FromJsonFile) {
  const std::filesystem::path missing = "/nonexistent/zeroshard/ds_config.json";
  EXPECT_THAT(
      error_of([&] { Config::from_json_file(missing); }),
      AllOf(HasSubstr("cannot open"), HasSubstr(missing.string()), HasSubstr("No such file")));

  {
    TempFile f(kZero3Nvme);
    const Config c = Config::from_json_file(f.path());
    EXPECT_EQ(c.stage, 3);
    EXPECT_EQ(c.offload_optimizer.tier, Tier::nvme);
  }
  {
    // Errors from a file name the file first, then the key.
    TempFile f(R"({"zero_optimization": {"stage": 5}})");
    EXPECT_THAT(error_of([&] { Config::from_json_file(f.path()); }),
                StartsWith("config: " + f.path().string() +
                           ": zero_optimization.stage = 5 is out of range"));
  }
}

TEST(Config, OptimizerStateFormats) {
  const Config c =
      Config::from_json(R"({"zeroshard": {"optimizer_state": "8bit", "state_block": 256}})");
  EXPECT_EQ(c.optimizer_state, StateFormat::q8);
  EXPECT_EQ(c.state_block, 256);
  EXPECT_THAT(parse_error(R"({"zeroshard": {"optimizer_state": "int8"}})"),
              AllOf(HasSubstr("zeroshard.optimizer_state"), HasSubstr("\"8bit\"")));
  EXPECT_THAT(parse_error(R"({"zeroshard": {"state_block": 1000}})"),
              AllOf(HasSubstr("zeroshard.state_block"), HasSubstr("power of two")));
  // Every tier keeps every format, the GPU's own update included (kernels/cuda/update_q8.cu).
  Config nvme = c;
  nvme.stage = 2;
  nvme.offload_optimizer.tier = Tier::nvme;
  nvme.offload_optimizer.nvme_paths = {"/tmp"};
  EXPECT_NO_THROW(nvme.validate());
  Config gpu = c;
  gpu.stage = 1;
  gpu.device = Device::cuda;
  EXPECT_NO_THROW(gpu.validate());
  gpu.optimizer_state = StateFormat::bf16;
  EXPECT_NO_THROW(gpu.validate());
  gpu.offload_optimizer.tier = Tier::host;
  EXPECT_NO_THROW(gpu.validate());
  gpu.offload_optimizer.tier = Tier::nvme;
  gpu.offload_optimizer.nvme_paths = {"/tmp"};
  EXPECT_NO_THROW(gpu.validate());
}

// A bf16 master needs bf16 parameters and the CPU's update; the fingerprint carries it (ranks
// that disagree would round differently).
TEST(Config, BF16Master) {
  Config c =
      Config::from_json(R"({"bf16": {"enabled": true}, "zeroshard": {"bf16_master": true}})");
  EXPECT_TRUE(c.bf16_master);
  EXPECT_NO_THROW(c.validate());
  EXPECT_NE(c.fingerprint().find("config bf16_master=true"), std::string::npos);
  Config f16 = c;
  f16.dtype = DType::f16;
  EXPECT_THAT(validate_error(f16), AllOf(HasSubstr("zeroshard.bf16_master = true requires bf16"),
                                         HasSubstr("dtype is f16")));
  Config gpu = c;
  gpu.stage = 1;
  gpu.device = Device::cuda;
  EXPECT_THAT(validate_error(gpu), HasSubstr("the GPU update keeps an f32 master"));
  gpu.offload_optimizer.tier = Tier::host;
  EXPECT_NO_THROW(gpu.validate());
  EXPECT_THAT(parse_error(R"({"zeroshard": {"bf16_master": "yes"}})"),
              HasSubstr("zeroshard.bf16_master"));
}

// Hierarchical sharding: zeroshard's key and DeepSpeed's MiCS key set the same field; the group
// size is in the fingerprint (it decides which ranks each collective joins).
TEST(Config, ShardGroupSize) {
  EXPECT_EQ(Config::from_json(R"({"zeroshard": {"shard_group_size": 8}})").shard_group_size, 8);
  EXPECT_EQ(Config::from_json(R"({"zero_optimization": {"mics_shard_size": 4}})").shard_group_size,
            4);
  EXPECT_EQ(Config::from_json(R"({"zero_optimization": {"mics_shard_size": -1}})").shard_group_size,
            0);
  EXPECT_THAT(parse_error(R"({"zero_optimization": {"mics_shard_size": 0}})"),
              AllOf(HasSubstr("zero_optimization.mics_shard_size"), HasSubstr("-1 (off)")));
  EXPECT_THAT(parse_error(R"({"zero_optimization": {"mics_shard_size": 2.5}})"),
              HasSubstr("whole number of ranks"));
  Config c;
  c.shard_group_size = -2;
  EXPECT_THAT(validate_error(c), HasSubstr("zeroshard.shard_group_size"));
  c.shard_group_size = 2;
  EXPECT_NE(c.fingerprint().find("config shard_group_size=2"), std::string::npos);
}

}  // namespace
}  // namespace zeroshard

namespace zeroshard {
namespace {

// DeepSpeed's batch sizes: given both, the engine checks them against the accumulation steps
// and its world size (one rank here), as DeepSpeed asserts; one alone is the loader's business.
TEST(Config, BatchSizesMustAgreeWithAccumulationAndWorld) {
  Config c = Config::from_json(
      R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
          "gradient_accumulation_steps": 2})");
  EXPECT_EQ(c.train_batch_size, 16);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  try {
    Engine e(c, make_self_communicator());
    ADD_FAILURE() << "16 != 4 x 2 x 1 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_config);
    EXPECT_THAT(e.what(),
                AllOf(HasSubstr("train_batch_size = 16"), HasSubstr("world size (1)"),
                      HasSubstr("gradient_accumulation_steps = 4 would make them agree")));
  }
  c.gradient_accumulation_steps = 4;
  EXPECT_NO_THROW(Engine(c, make_self_communicator()));
  c.train_micro_batch_size_per_gpu = 0;  // not given: the micro-batch it implies must be whole
  EXPECT_NO_THROW(Engine(c, make_self_communicator()));
  c.gradient_accumulation_steps = 3;
  try {
    Engine e(c, make_self_communicator());
    ADD_FAILURE() << "16 / (3 x 1) micro-batches was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("train_batch_size = 16 is not a multiple of "
                                          "gradient_accumulation_steps (3) x world size (1)"),
                                HasSubstr("no whole micro-batch")));
  }
}

}  // namespace
}  // namespace zeroshard
