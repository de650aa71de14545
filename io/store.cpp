#include "io/store.hpp"

#include <algorithm>
#include <filesystem>

#include "core/error.hpp"

namespace fs = std::filesystem;

namespace crosskv {

std::vector<std::string> list_store(const std::string& store, const std::string& key) {
  std::error_code ec;
  if (!fs::exists(store, ec)) throw InputError(key + ": store folder " + store + " does not exist");
  if (!fs::is_directory(store, ec)) throw InputError(key + ": store " + store + " is not a folder");
  std::vector<std::string> out;
  for (auto it = fs::recursive_directory_iterator(store, fs::directory_options::follow_directory_symlink, ec);
       it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) throw InputError(key + ": cannot list store " + store + ": " + ec.message());
    if (it->is_regular_file() && it->path().extension() == ".h5")
      out.push_back(it->path().lexically_relative(store).generic_string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string shard_domain(const std::string& rel) {
  auto p = rel.find('/');
  return p == std::string::npos ? std::string() : rel.substr(0, p);
}

}  // namespace crosskv
