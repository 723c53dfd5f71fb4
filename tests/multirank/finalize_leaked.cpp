// finalize_mpi() with an engine still alive (a program that never destroys it): MPI is
// finalised, so mpirun sees every rank end normally (it fails the job otherwise), and the
// engine's communicator refuses what comes after with comm_failure. Run under mpirun -np 2;
// exits non-zero if anything differs.
#include <cstdio>
#include <memory>

#include "zeroshard/communicator.hpp"
#include "zeroshard/engine.hpp"
#include "zeroshard/error.hpp"

using namespace zeroshard;

int main() {
  Config cfg;
  cfg.stage = 2;
  auto* leaked = new Engine(cfg, make_mpi_communicator());  // never deleted, on purpose
  leaked->add_unit("u", {Param{"w", {64}}});
  leaked->finalize();
  for (TensorView& g : leaked->grads(0)) static_cast<float*>(g.data)[0] = 1.0f;
  leaked->grads_ready(0);
  leaked->step();
  finalize_mpi();
  finalize_mpi();  // a second call does nothing
  try {
    leaked->communicator()->barrier("after finalize_mpi()");
  } catch (const Error& e) {
    if (e.code() == ErrorCode::comm_failure) {
      std::printf("refused as expected: %s\n", e.what());
      return 0;
    }
  }
  std::fprintf(stderr, "a collective after finalize_mpi() was not refused with comm_failure\n");
  return 1;
}
