#pragma once
// Whole positioned transfers for checkpoint and safetensors files, with errors that name the
// file: ENOSPC/EDQUOT become Error(no_space), other errno values Error(io_error), and a file
// that ends early Error(corrupted).
#include <cstddef>
#include <cstdint>
#include <filesystem>

namespace zeroshard::ckpt {

/// Throws for `err` (an errno) while `what`ing `path` ("writing", "fsync of", ...).
[[noreturn]] void io_failure(const std::filesystem::path& path, const char* what, int err);

/// pwrite() until every byte is written (EINTR and short writes retried).
void pwrite_all(int fd, const void* data, size_t bytes, int64_t offset,
                const std::filesystem::path& path);

/// pread() until every byte is read; a file ending before `what` (e.g. "header") is
/// Error(corrupted).
void pread_all(int fd, void* data, size_t bytes, int64_t offset, const std::filesystem::path& path,
               const char* what);

/// open(path, flags) of a file to read, refused unless it is a regular file: a FIFO or a device
/// (a damaged or hostile checkpoint: `latest` pointing at /dev/zero) would block the open or
/// read without end. Error(corrupted) naming the file if it is not one, io_failure() if the
/// open fails; ENOENT and ENOTDIR are returned as an invalid descriptor, for the caller to name.
int open_regular(const std::filesystem::path& path, int flags);

/// create_directories()/create_directory() with the errors above (a full disk: no_space).
void make_directories(const std::filesystem::path& path);
void make_directory(const std::filesystem::path& path);
/// rename() with the errors above.
void rename_path(const std::filesystem::path& from, const std::filesystem::path& to);

/// fsync() of an open file or of a path (a directory, opened read-only for it).
void fsync_fd(int fd, const std::filesystem::path& path);
void fsync_path(const std::filesystem::path& path);

}  // namespace zeroshard::ckpt
