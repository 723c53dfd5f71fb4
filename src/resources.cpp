#include "src/resources.hpp"

#include "zeroshard/config.hpp"

namespace zeroshard {

Resources::Resources(const Config& cfg, std::unique_ptr<Compute> d)
    : dev(d ? std::move(d) : make_compute(cfg, arena)), host(make_cpu_compute(arena)) {}

Resources::~Resources() = default;

}  // namespace zeroshard
