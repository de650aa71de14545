#include "core/sha256.hpp"

#include <openssl/evp.h>

#include <fstream>
#include <vector>

#include "core/error.hpp"

namespace crosskv {

struct Sha256::Impl {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  ~Impl() { EVP_MD_CTX_free(ctx); }
};

Sha256::Sha256() : impl_(std::make_unique<Impl>()) {
  if (!impl_->ctx || EVP_DigestInit_ex(impl_->ctx, EVP_sha256(), nullptr) != 1)
    throw SystemError("OpenSSL EVP_DigestInit_ex(sha256) failed");
}
Sha256::~Sha256() = default;

void Sha256::update(const void* data, size_t n) {
  if (EVP_DigestUpdate(impl_->ctx, data, n) != 1) throw SystemError("OpenSSL EVP_DigestUpdate failed");
}

std::string Sha256::hex() {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_DigestFinal_ex(impl_->ctx, md, &len) != 1) throw SystemError("OpenSSL EVP_DigestFinal_ex failed");
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < len; ++i) {
    out += digits[md[i] >> 4];
    out += digits[md[i] & 15];
  }
  return out;
}

std::string sha256_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw SystemError("cannot open " + path + " for hashing");
  Sha256 h;
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), buf.size());
    h.update(buf.data(), static_cast<size_t>(in.gcount()));
  }
  return h.hex();
}

}  // namespace crosskv
