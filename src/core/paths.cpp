// Shipped-data lookup (see paths.h).
#include "core/paths.h"

namespace nopad {

namespace fs = std::filesystem;

fs::path executable_path() {
  std::error_code ec;
  fs::path p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path() : p;
}

std::vector<fs::path> data_search_dirs() {
  std::vector<fs::path> dirs = {fs::path("data")};
  const fs::path exe = executable_path();
  if (!exe.empty()) {
    const fs::path up = exe.parent_path().parent_path();
    dirs.push_back(up / "data");
    dirs.push_back(up / "share" / "nopad" / "data");
  }
  return dirs;
}

std::optional<fs::path> find_data_file(std::string_view relative) {
  std::error_code ec;
  for (const fs::path& d : data_search_dirs())
    if (fs::is_regular_file(d / relative, ec)) return d / relative;
  return std::nullopt;
}

}  // namespace nopad
