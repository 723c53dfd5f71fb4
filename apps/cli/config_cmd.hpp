#pragma once
// `zeroshard config`: reads and validates a JSON configuration (zeroshard's or DeepSpeed's) and
// prints what it understood; `--fields` prints the field table docs/configuration.md is made
// from (scripts/gen_config_doc.py).

#include <string>
#include <vector>

namespace zscli {

int run_config(const std::vector<std::string>& args);

}  // namespace zscli
