// libFuzzer target: a mapper's layer file (ridge tensors and optional residual MLPs), beside a fixed manifest, must
// load or be refused with an InputError, never crash. CROSSKV_FUZZ_MANIFEST names the manifest (run_fuzz.sh's seed
// artifact); its layer 0's file is replaced by each input.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

#include "core/error.hpp"
#include "artifact/mapper.hpp"

namespace {

struct Fixture {
  std::string dir, layer;
  crosskv::MapperManifest manifest;
};

const Fixture& fixture() {
  static const Fixture f = [] {
    const char* src = std::getenv("CROSSKV_FUZZ_MANIFEST");
    if (!src) std::abort();  // run_fuzz.sh sets it
    Fixture x;
    x.dir = (std::filesystem::temp_directory_path() / ("crosskv-fuzz-layer-" + std::to_string(getpid()))).string();
    std::filesystem::create_directories(x.dir);
    std::filesystem::copy_file(src, x.dir + "/manifest.json", std::filesystem::copy_options::overwrite_existing);
    x.manifest = crosskv::read_mapper_manifest(x.dir);
    x.layer = x.dir + "/" + x.manifest.layers.at(0).file;
    return x;
  }();
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Fixture& f = fixture();
  std::ofstream(f.layer, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data), size);
  try {
    auto l = crosskv::load_mapper_layer(f.manifest, 0, /*verify=*/false);
    (void)l;
  } catch (const crosskv::InputError&) {
  }
  return 0;
}
