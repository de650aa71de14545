// libFuzzer target: a mapper's layer file (ridge tensors and optional residual MLPs), beside a fixed manifest, must
// load or be refused with an InputError, never crash. CROSSKV_FUZZ_MANIFEST names the manifest (run_fuzz.sh's seed
// artifact) and CROSSKV_FUZZ_MANIFEST_PER_HEAD, when set, a per_head one; each input replaces layer 0's file of each.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "core/error.hpp"
#include "artifact/mapper.hpp"

namespace {

struct Fixture {
  std::string dir, layer;
  crosskv::MapperManifest manifest;
};

Fixture make_fixture(const char* manifest, const std::string& name) {
  Fixture x;
  x.dir = (std::filesystem::temp_directory_path() / ("crosskv-fuzz-" + name + "-" + std::to_string(getpid()))).string();
  std::filesystem::create_directories(x.dir);
  std::filesystem::copy_file(manifest, x.dir + "/manifest.json", std::filesystem::copy_options::overwrite_existing);
  x.manifest = crosskv::read_mapper_manifest(x.dir);
  x.layer = x.dir + "/" + x.manifest.layers.at(0).file;
  return x;
}

const std::vector<Fixture>& fixtures() {
  static const std::vector<Fixture> f = [] {
    const char* src = std::getenv("CROSSKV_FUZZ_MANIFEST");
    if (!src) std::abort();  // run_fuzz.sh sets it
    std::vector<Fixture> x = {make_fixture(src, "layer")};
    if (const char* ph = std::getenv("CROSSKV_FUZZ_MANIFEST_PER_HEAD")) x.push_back(make_fixture(ph, "layer-per-head"));
    return x;
  }();
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  for (const Fixture& f : fixtures()) {
    std::ofstream(f.layer, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data), size);
    try {
      auto l = crosskv::load_mapper_layer(f.manifest, 0, /*verify=*/false);
      (void)l;
    } catch (const crosskv::InputError&) {
    }
  }
  return 0;
}
