// The low-precision parameters in memory (see memory_param_tier.hpp).
#include "src/tiers/memory_param_tier.hpp"

#include <utility>

namespace zeroshard {

MemoryParamTier::MemoryParamTier(const TierContext& ctx, Tier tier, Compute& dev, Compute& host)
    : ctx_(ctx), dev_(dev), host_(host), shared_(ctx.units->size(), false) {
  const bool stage3 = ctx.cfg->stage == 3;
  for (size_t i = 0; i < ctx.units->size(); ++i) {
    const UnitLayout& L = ctx.unit(int(i)).layout;
    params_.push_back(ctx.buffer(stage3 ? tier : Tier::device, MemKind::param, "param",
                                 size_t(stage3 ? L.shard_numel : L.padded_numel) * ctx.pbytes,
                                 ctx.cfg->offload_param.pin_memory));
  }
}

void* MemoryParamTier::whole(int u) {
  return ctx_.cfg->stage == 3 ? nullptr : params_[size_t(u)].data();
}

void* MemoryParamTier::own(int u) {
  const int st = ctx_.cfg->stage;
  const int64_t block = st == 1 || st == 2 ? ctx_.shard_rank * ctx_.shard(u) : 0;
  return params_[size_t(u)].as<char>() + size_t(block) * ctx_.pbytes;
}

std::optional<float*> MemoryParamTier::share_as_master(int u) {
  if (ctx_.pdt != DType::f32) return std::nullopt;
  shared_[size_t(u)] = true;
  return static_cast<float*>(own(u));
}

void MemoryParamTier::write(void* dst, const float* values, int64_t n) {
  if (!dev_.streams()) {
    host_.convert(values, DType::f32, dst, ctx_.pdt, n);
    return;
  }
  std::vector<char> low(size_t(n) * ctx_.pbytes);
  host_.convert(values, DType::f32, low.data(), ctx_.pdt, n);
  dev_.copy(dst, low.data(), low.size());
  dev_.synchronize();
}

// The low-precision copy is rounded from the f32 values, as the master weights are loaded, so
// every stage starts from bitwise the same state.
void MemoryParamTier::load_initial(int u, const float* whole) {
  if (!whole) return;  // zeros: the buffer starts zero-filled
  if (ctx_.cfg->stage == 3)
    write(params_[size_t(u)].data(), whole + ctx_.shard_rank * ctx_.shard(u), ctx_.shard(u));
  else
    write(params_[size_t(u)].data(), whole, ctx_.unit(u).layout.padded_numel);
}

std::vector<float> MemoryParamTier::read(int u) const {
  const int64_t n = ctx_.shard(u);
  const int64_t off = ctx_.cfg->stage == 3 ? 0 : ctx_.shard_rank * n;
  std::vector<char> low(size_t(n) * ctx_.pbytes);
  dev_.copy(low.data(), params_[size_t(u)].as<char>() + size_t(off) * ctx_.pbytes, low.size());
  dev_.synchronize();
  std::vector<float> out(static_cast<size_t>(n));
  host_.convert(low.data(), ctx_.pdt, out.data(), DType::f32, n);
  return out;
}

// Stage 3's shard is a buffer of its own, read only by the gathers (none in flight during an
// update); on a GPU it may be registered for DMA, so only a CPU engine's is swapped.
bool MemoryParamTier::adopt(int u, Buffer& values) {
  Buffer& mine = params_[size_t(u)];
  if (ctx_.cfg->stage != 3 || dev_.streams() || shared_[size_t(u)] ||
      values.bytes() != mine.bytes())
    return false;
  std::swap(mine, values);
  return true;
}

void MemoryParamTier::restore(int u, const float* master) {
  write(own(u), master, ctx_.extent(u));
}

}  // namespace zeroshard
