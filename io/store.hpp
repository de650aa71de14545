#pragma once
// A store: a folder per model holding <domain>/<name>.h5 shards.
#include <string>
#include <vector>

namespace crosskv {

struct StoreListing {
  std::vector<std::string> shards;  // relative paths of every *.h5 file below the store, sorted
  std::vector<std::string> skipped;  // "<path>: skipped (why)" for entries that look like shards and are not
};

// Walks `store` (following folder symlinks). InputError naming `key` if the store is missing, cannot be listed, or
// a folder symlink leads back to a folder above it (the loop is named once).
StoreListing list_store(const std::string& store, const std::string& key);
// The domain of a relative shard path (its first component).
std::string shard_domain(const std::string& rel);

}  // namespace crosskv
