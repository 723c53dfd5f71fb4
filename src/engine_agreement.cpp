// Engine: what every rank must agree on. At finalize(), the model, its initial values and the
// settings that shape the collectives; at every step(), the collectives themselves. Disagreement
// fails every rank with the same error, naming what differs, instead of a hang, an MPI abort or a
// silent mix.
#include <sstream>

#include "base/check.hpp"
#include "base/checksum.hpp"
#include "src/engine_impl.hpp"

namespace zeroshard {

// Every rank renders its model and configuration as lines; rank 0's lines are broadcast and
// each rank compares. The lowest rank that differs then broadcasts its finding, so all ranks
// throw the same message. Every rank runs the same collectives whatever it registered: no hang.
void Engine::Impl::check_same_model() {
  std::ostringstream os;
  os << cfg.fingerprint();  // one "config <setting>=<value>" line per setting ranks must share
  for (size_t g = 0; g < groups.size(); ++g)
    os << "group " << g << " lr=" << groups[g].lr << " wd=" << groups[g].weight_decay << "\n";
  for (size_t u = 0; u < shapes.size(); ++u) {
    const UnitShape& s = shapes[u];
    os << "unit '" << s.layout.name << "'\n";
    for (size_t i = 0; i < s.layout.params.size(); ++i) {
      const ParamSlot& p = s.layout.params[i];
      os << "  param '" << p.name << "' shape " << shape_string(p.shape) << " dtype "
         << dtype_name(pdt) << " group " << p.group << "\n";
      // Ranks that start from different values would train different models in lockstep.
      const TensorView& v = units[u].init_params[i].init;
      os << "  param '" << p.name << "' initial values ";
      if (v.data)
        os << dtype_name(v.dtype) << " xxh64 " << std::hex << offload::xxh64(v.data, v.bytes(), 0)
           << std::dec << "\n";
      else
        os << "zero\n";
    }
  }
  os << "end\n";
  std::string mine = os.str();
  if (world == 1 || res.ledger.counting_only()) return;  // a plan has one rank's model

  double len = double(mine.size());
  comm->all_reduce(&len, 1, ReduceOp::max, "model check (length)")->wait();
  std::string theirs(size_t(len), '\0');
  if (rank == 0) std::copy(mine.begin(), mine.end(), theirs.begin());
  comm->broadcast(theirs.data(), int64_t(theirs.size()), 0, "model check (rank 0's model)")->wait();
  theirs.resize(theirs.find("end\n") == std::string::npos ? theirs.size()
                                                          : theirs.find("end\n") + 4);

  std::string diff;
  if (mine != theirs) {
    std::istringstream a(theirs), b(mine);
    std::string la, lb, context = "the configuration";
    int line = 1;
    while (true) {
      bool ga = bool(std::getline(a, la)), gb = bool(std::getline(b, lb));
      if (!ga && !gb) break;
      if (!ga) la = "(nothing)";
      if (!gb) lb = "(nothing)";
      if (la != lb) break;
      if (la.rfind("unit ", 0) == 0) context = la;
      ++line;
    }
    diff = "rank " + std::to_string(rank) +
           " registered a different model than rank 0: first difference in " + context +
           ": rank 0 has \"" + la + "\", rank " + std::to_string(rank) + " has \"" + lb + "\"";
  }
  double first = diff.empty() ? double(world) : double(rank);
  comm->all_reduce(&first, 1, ReduceOp::min, "model check (first differing rank)")->wait();
  if (first >= world) return;
  double dlen = double(diff.size());
  comm->all_reduce(&dlen, 1, ReduceOp::max, "model check (message length)")->wait();
  std::string msg(size_t(dlen), ' ');
  if (rank == int(first)) std::copy(diff.begin(), diff.end(), msg.begin());
  comm->broadcast(msg.data(), int64_t(msg.size()), int(first), "model check (message)")->wait();
  while (!msg.empty() && msg.back() == ' ') msg.pop_back();
  ZS_THROW(model_mismatch, "finalize() on rank " << rank << ": " << msg);
}

namespace {

const char* kind_name(int kind) {
  switch (kind) {
    case 'r':
      return "reduce-scatter of the gradients";
    case 'g':
      return "all-gather of the gradients (stage 0)";
    case 'a':
      return "all-gather for gather()";
  }
  return "collective";
}

}  // namespace

void Engine::Impl::record(char kind, int unit) {
  const int32_t code = int32_t(kind) << 24 | unit;
  collectives.issued.push_back(code);
  // FNV-1a over the codes: order and content both count.
  for (int b = 0; b < 4; ++b)
    collectives.hash = (collectives.hash ^ ((uint32_t(code) >> (8 * b)) & 0xff)) * 0x100000001b3ull;
}

// `sums` holds Σh and Σh² over the ranks of the hash of each rank's collectives since the last
// step (20 bits, so both sums are exact in double). They are equal on every rank exactly when
// world · Σh² = (Σh)². Then every rank compares the sequences themselves and all throw the same
// message naming the first collective that differs.
void Engine::Impl::check_same_collectives(const double* sums) {
  if (double(world) * sums[1] == sums[0] * sums[0]) return;
  double len = double(collectives.issued.size());
  comm->all_reduce(&len, 1, ReduceOp::max, "collective check (length)")->wait();
  std::vector<std::vector<int32_t>> seq(size_t(world), std::vector<int32_t>(size_t(len), -1));
  std::copy(collectives.issued.begin(), collectives.issued.end(), seq[size_t(rank)].begin());
  for (int r = 0; r < world; ++r)
    comm->broadcast(seq[size_t(r)].data(), int64_t(len) * 4, r, "collective check (sequence)")
        ->wait();
  auto describe = [&](int32_t code) -> std::string {
    if (code < 0) return "nothing";
    const int unit = code & 0xffffff;
    return std::string(kind_name(code >> 24)) + " of unit '" +
           (unit < int(units.size()) ? layout(unit).name : std::to_string(unit)) + "'";
  };
  std::ostringstream msg;
  msg << "step() on rank " << rank << ": the ranks issued different collectives since the last "
      << "step, so their gradients or parameters were mixed up; nothing is applied";
  for (size_t i = 0; i < size_t(len); ++i)
    for (int r = 1; r < world; ++r)
      if (seq[size_t(r)][i] != seq[0][i]) {
        msg << ": collective " << i + 1 << " is the " << describe(seq[0][i])
            << " on rank 0 but the " << describe(seq[size_t(r)][i]) << " on rank " << r
            << " (gather() calls must come in the same order on every rank)";
        i = size_t(len);
        break;
      }
  state->forget_grads();
  collectives.issued.clear();
  collectives.hash = 0;
  // The gather order recorded for prefetching differs between ranks too: record it anew.
  schedule.order.clear();
  schedule.recorded = false;
  ZS_THROW(model_mismatch, msg.str());
}

}  // namespace zeroshard
