#include "io/store.hpp"

#include <algorithm>
#include <filesystem>

#include "core/error.hpp"

namespace fs = std::filesystem;

namespace crosskv {
namespace {

struct Walk {
  const fs::path root;
  const std::string& key;
  StoreListing out;
  std::vector<fs::path> above;  // canonical folders from the root down to the one being listed

  void fail(const fs::path& p, const std::error_code& ec) const {
    throw InputError(key + ": cannot list store " + root.string() + " at " + p.string() + ": " + ec.message());
  }

  void folder(const fs::path& dir) {
    std::error_code ec;
    std::vector<fs::path> entries;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) entries.push_back(it->path());
    if (ec) fail(dir, ec);
    std::sort(entries.begin(), entries.end());
    for (const fs::path& p : entries) {
      const bool h5_name = p.extension() == ".h5";
      const fs::file_status st = fs::status(p, ec);  // follows symlinks
      if (ec || !fs::exists(st)) {
        if (fs::is_symlink(fs::symlink_status(p, ec)))
          out.skipped.push_back(p.string() + ": skipped (a dangling symlink)");
        else if (ec)
          fail(p, ec);
        ec.clear();
        continue;
      }
      if (fs::is_directory(st)) {
        const fs::path c = fs::canonical(p, ec);
        if (ec) fail(p, ec);
        if (std::find(above.begin(), above.end(), c) != above.end())
          throw InputError(key + ": symlink loop in store " + root.string() + ": " + p.string() + " leads back to " +
                           c.string());
        if (h5_name) out.skipped.push_back(p.string() + ": skipped (a folder, not a shard)");
        above.push_back(c);
        folder(p);
        above.pop_back();
      } else if (h5_name) {
        if (fs::is_regular_file(st))
          out.shards.push_back(p.lexically_relative(root).generic_string());
        else
          out.skipped.push_back(p.string() + ": skipped (not a regular file)");
      }
    }
  }
};

}  // namespace

StoreListing list_store(const std::string& store, const std::string& key) {
  std::error_code ec;
  if (!fs::exists(store, ec)) throw InputError(key + ": store folder " + store + " does not exist");
  if (!fs::is_directory(store, ec)) throw InputError(key + ": store " + store + " is not a folder");
  Walk w{fs::path(store), key, {}, {}};
  w.above.push_back(fs::canonical(store, ec));
  if (ec) w.fail(store, ec);
  w.folder(store);
  std::sort(w.out.shards.begin(), w.out.shards.end());
  return std::move(w.out);
}

std::string shard_domain(const std::string& rel) {
  auto p = rel.find('/');
  return p == std::string::npos ? std::string() : rel.substr(0, p);
}

}  // namespace crosskv
