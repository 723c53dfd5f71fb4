// `zeroshard capacity`: finds a Python that imports zeroshard.capacity and hands over to it.
#include "apps/cli/capacity.hpp"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace zscli {
namespace {

// Whether `python -c "import zeroshard.capacity"` succeeds (its output discarded).
bool imports_capacity(const std::string& python) {
  const pid_t pid = fork();
  if (pid < 0) return false;
  if (pid == 0) {
    const int null = open("/dev/null", O_WRONLY);
    if (null >= 0) {
      dup2(null, STDOUT_FILENO);
      dup2(null, STDERR_FILENO);
    }
    execlp(python.c_str(), python.c_str(), "-c", "import zeroshard.capacity", nullptr);
    _exit(127);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

}  // namespace

std::vector<std::string> python_candidates(const std::string& exe_path) {
  if (const char* env = std::getenv("ZEROSHARD_PYTHON"); env && *env) return {env};
  std::vector<std::string> out;
  if (const char* venv = std::getenv("VIRTUAL_ENV"); venv && *venv)
    out.push_back(std::string(venv) + "/bin/python");
  // BUILD/apps/zeroshard in a checkout whose .venv holds the package (scripts/test.sh).
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path exe = fs::weakly_canonical(exe_path, ec);
  if (!ec && exe.has_parent_path()) {
    for (fs::path dir = exe.parent_path(); dir.has_parent_path() && dir != dir.root_path();
         dir = dir.parent_path()) {
      if (fs::exists(dir / ".venv" / "bin" / "python", ec)) {
        out.push_back((dir / ".venv" / "bin" / "python").string());
        break;
      }
    }
  }
  out.push_back("python3");
  out.push_back("/usr/bin/python3");
  return out;
}

int run_capacity(const std::vector<std::string>& args) {
  char self[PATH_MAX] = {};
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  const std::vector<std::string> tried =
      python_candidates(n > 0 ? std::string(self, size_t(n)) : "");
  for (const std::string& py : tried) {
    if (!imports_capacity(py)) continue;
    std::vector<std::string> all = {py, "-m", "zeroshard.capacity"};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::fflush(stdout);
    execvp(argv[0], argv.data());
    std::fprintf(stderr, "zeroshard capacity: cannot run %s: %s\n", py.c_str(),
                 std::strerror(errno));
    return 127;
  }
  std::fprintf(stderr,
               "zeroshard capacity is the Python module zeroshard.capacity, and none of "
               "these interpreters imports it:");
  for (const std::string& py : tried) std::fprintf(stderr, " %s", py.c_str());
  std::fprintf(stderr,
               "\nInstall the package (bash scripts/python_test.sh puts it in .venv; or pip "
               "install . into your environment), or set ZEROSHARD_PYTHON to a python that "
               "imports zeroshard.\n");
  return 127;
}

}  // namespace zscli
