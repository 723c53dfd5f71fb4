#pragma once
// Shared by the NVMe benchmark programs: size arguments such as "256M" or "1G".

#include <cstdint>
#include <cstdlib>
#include <string>

namespace zeroshard::bench {

/// "128M" → 128e6 (counts), or with binary = true "1M" → 2^20 (bytes); K, M, G either case.
inline int64_t parse_size(const std::string& s, bool binary = false) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  const double k = binary ? 1024.0 : 1000.0;
  switch (end && *end ? *end : ' ') {
    case 'K':
    case 'k':
      v *= k;
      break;
    case 'M':
    case 'm':
      v *= k * k;
      break;
    case 'G':
    case 'g':
      v *= k * k * k;
      break;
    default:
      break;
  }
  return int64_t(v);
}

}  // namespace zeroshard::bench
