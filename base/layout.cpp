#include "base/layout.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>

namespace zeroshard {

int64_t round_up(int64_t n, int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

int64_t padding_grain(const Config& cfg) {
  if (cfg.optimizer_state != StateFormat::q8) return cfg.shard_alignment;
  return std::lcm(cfg.shard_alignment, cfg.state_block);
}

UnitLayout plan_unit(std::string name, const std::vector<Param>& params, int world_size,
                     int64_t alignment) {
  UnitLayout u;
  u.name = std::move(name);
  for (const Param& p : params) {
    ParamSlot s{p.name, p.shape, p.group, u.numel, shape_numel(p.shape)};
    u.numel += s.numel;
    u.params.push_back(std::move(s));
  }
  // An empty unit still gets one aligned block per rank so every rank has a shard to own.
  u.padded_numel =
      std::max<int64_t>(round_up(u.numel, world_size * alignment), world_size * alignment);
  u.shard_numel = u.padded_numel / world_size;
  return u;
}

std::vector<GroupRun> UnitLayout::runs(int64_t begin, int64_t end) const {
  std::vector<GroupRun> out;
  for (const ParamSlot& p : params) {
    int64_t b = std::max(begin, p.offset), e = std::min(end, p.offset + p.numel);
    if (b >= e) continue;
    if (!out.empty() && out.back().group == p.group && out.back().end == b - begin)
      out.back().end = e - begin;
    else
      out.push_back({b - begin, e - begin, p.group});
  }
  return out;
}

void zero_padding(const UnitShape& unit, char* shard, size_t esize) {
  int64_t at = 0;
  for (const GroupRun& r : unit.shard_runs) {
    if (r.begin > at) std::memset(shard + size_t(at) * esize, 0, size_t(r.begin - at) * esize);
    at = std::max(at, r.end);
  }
  if (unit.layout.shard_numel > at)
    std::memset(shard + size_t(at) * esize, 0, size_t(unit.layout.shard_numel - at) * esize);
}

}  // namespace zeroshard
