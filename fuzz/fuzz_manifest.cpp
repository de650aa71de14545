// libFuzzer target: the mapper manifest parser must reject any text with an InputError, never crash.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.hpp"
#include "artifact/mapper.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto m = crosskv::parse_mapper_manifest(std::string(reinterpret_cast<const char*>(data), size), "manifest.json",
                                            "/nonexistent");
    (void)m;
  } catch (const crosskv::InputError&) {
  }
  return 0;
}
