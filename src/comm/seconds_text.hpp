#pragma once
// Seconds as the communicators' timeout messages print them: "6", "0.5", "300".

#include <sstream>
#include <string>

namespace zeroshard {

inline std::string seconds_text(double s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

}  // namespace zeroshard
