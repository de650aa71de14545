// libFuzzer target: the safetensors reader must reject any byte string with an InputError, never crash.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.hpp"
#include "artifact/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto t = crosskv::parse_safetensors(std::string(reinterpret_cast<const char*>(data), size), "fuzz.safetensors");
    size_t n = 0;
    for (const auto& [name, tensor] : t) n += tensor.values.size();
    (void)n;
  } catch (const crosskv::InputError&) {
  }
  return 0;
}
