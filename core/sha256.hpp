#pragma once
// SHA-256 (OpenSSL EVP) of buffers and files, as lowercase hex.
#include <cstddef>
#include <memory>
#include <string>

namespace crosskv {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, size_t n);
  std::string hex();  // finalises

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

std::string sha256_file(const std::string& path);

}  // namespace crosskv
