#pragma once
// Failures that one rank sees and the others must share: every rank learns whether any rank
// failed, and all of them throw the same error, so none waits in a collective the others left.

#include <cstdint>
#include <optional>
#include <string>

#include "zeroshard/communicator.hpp"
#include "zeroshard/error.hpp"

namespace zeroshard {

/// Every rank learns whether any rank failed (`mine`); returns the first failing rank's error as
/// this rank should throw it (naming the failing rank), or nothing. Collective: one small
/// all-reduce when nothing failed. `what` names the operation in the collectives' labels.
std::optional<Error> agree(Communicator& comm, const std::optional<Error>& mine,
                           const std::string& what);

/// Appended to a failed step's error: what the trainer may rely on.
std::string not_applied(int64_t step);

}  // namespace zeroshard
