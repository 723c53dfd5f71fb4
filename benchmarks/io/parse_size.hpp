#pragma once
// Shared by the benchmark programs: size arguments such as "256M", "1G", "64Mi" or "1e9".

#include <cstdint>
#include <cstdlib>
#include <string>

namespace zeroshard::bench {

/// "128M" → 128e6 (counts), or with binary = true "1M" → 2^20 (bytes); K, M, G either case.
/// "Ki", "Mi", "Gi" are binary whatever `binary` says, and exponents work ("1e9"). 0 when `s` is
/// not a size (callers treat it as invalid).
inline int64_t parse_size(const std::string& s, bool binary = false) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (!end || end == s.c_str()) return 0;
  const bool bin = binary || (*end && end[1] == 'i');
  const double k = bin ? 1024.0 : 1000.0;
  switch (*end) {
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
    case '\0':
      return v > 0 && v < 9e18 ? int64_t(v) : 0;
    default:
      return 0;
  }
  const char* rest = end + 1 + (end[1] == 'i' ? 1 : 0);
  return *rest == '\0' && v > 0 && v < 9e18 ? int64_t(v) : 0;
}

}  // namespace zeroshard::bench
