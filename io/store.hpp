#pragma once
// A store: a folder per model holding <domain>/<name>.h5 shards.
#include <string>
#include <vector>

namespace crosskv {

// Relative paths of every *.h5 file below `store`, sorted. InputError naming `key` if the store is missing.
std::vector<std::string> list_store(const std::string& store, const std::string& key);
// The domain of a relative shard path (its first component).
std::string shard_domain(const std::string& rel);

}  // namespace crosskv
