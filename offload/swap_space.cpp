#include "offload/swap_space.hpp"

#include <filesystem>

#include "offload/io_backend.hpp"

namespace zeroshard::offload {

std::vector<const RunDir*> SwapSpace::dirs(const std::vector<std::string>& paths) {
  std::vector<const RunDir*> out;
  for (const std::string& p : paths) {
    std::string key = std::filesystem::path(p).lexically_normal().string();
    auto it = dir_of_.find(key);
    if (it == dir_of_.end()) {
      dirs_.emplace_back(p, rank_);
      it = dir_of_.emplace(key, dirs_.size() - 1).first;
    }
    out.push_back(&dirs_[it->second]);
  }
  return out;
}

std::vector<std::string> SwapSpace::files() const {
  std::vector<std::string> out;
  for (const SwapStore* st : stores_)
    for (const auto& p : st->paths()) out.push_back(p.string());
  return out;
}

void SwapSpace::start(const AioOptions& aio) {
  BackendSetup setup;
  std::vector<std::string> names;
  for (SwapStore* st : stores_) {
    std::vector<int> fds = st->fds();
    if (fds.empty()) continue;
    st->set_file_base(int(setup.fds.size()));
    setup.fds.insert(setup.fds.end(), fds.begin(), fds.end());
    for (std::string& s : st->file_names()) names.push_back(std::move(s));
  }
  for (PinnedPool* p : pools_) p->append_iovecs(setup.buffers);
  setup.queue_depth = aio.queue_depth;
  io_ = std::make_unique<IoQueue>(make_backend(setup), std::move(names));
}

}  // namespace zeroshard::offload
