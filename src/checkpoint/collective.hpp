#pragma once
// Checkpoint steps that every rank takes together: one rank's failure becomes every rank's error
// (the first failing rank's, naming it), so no rank waits in a collective the others left.
#include <exception>
#include <optional>
#include <string>

#include "base/agree.hpp"

namespace zeroshard::ckpt {

template <class F>
void all_or_none(Communicator& comm, const std::string& what, F&& step) {
  std::optional<Error> mine;
  try {
    step();
  } catch (const Error& e) {
    mine = e;
  } catch (const std::exception& e) {  // std::filesystem and allocation errors
    mine = Error(ErrorCode::io_error, e.what());
  }
  if (std::optional<Error> e = agree(comm, mine, what)) throw *e;
}

}  // namespace zeroshard::ckpt
