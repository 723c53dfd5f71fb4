#pragma once
/// \file export.hpp
/// ZS_API marks zeroshard's public API. libzeroshard.so is built with hidden visibility, so only
/// what carries ZS_API (and the typeinfo and vtables of ZS_API classes, which exceptions and
/// dynamic_cast across the library's edge need) is exported. Hand-written rather than generated,
/// so that every public header compiles alone from the source tree as from an installation.

#if defined(_WIN32)
#define ZS_API
#define ZS_HIDDEN
#else
#define ZS_API __attribute__((visibility("default")))
/// For the implementation types that ZS_API classes hold (pimpl): a nested class would
/// otherwise inherit its enclosing class's visibility and export every internal method.
#define ZS_HIDDEN __attribute__((visibility("hidden")))
#endif
