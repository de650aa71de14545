#pragma once
// Flat byte messages, for exchanges between ranks and checkpoint payloads: values appended in order, read back in the
// same order. A vector goes as its uint64 length, then its elements.
#include <cstdint>
#include <cstring>
#include <string>

#include "core/error.hpp"

namespace crosskv {

class ByteWriter {
 public:
  void put(const void* p, size_t n) { s_.append(static_cast<const char*>(p), n); }
  template <class V>  // std::vector, BigVector: data(), size()
  void put_vec(const V& v) {
    const uint64_t n = v.size();
    put(&n, sizeof n);
    put(v.data(), n * sizeof(v[0]));
  }
  std::string& bytes() { return s_; }

 private:
  std::string s_;
};

class ByteReader {
 public:
  // `what` names the message in the assertion a short one raises.
  ByteReader(const std::string& s, const char* what) : s_(s), what_(what) {}
  void get(void* p, size_t n) {
    CROSSKV_ASSERT(at_ + n <= s_.size(), std::string(what_) + " ends early");
    std::memcpy(p, s_.data() + at_, n);
    at_ += n;
  }
  template <class V>  // std::vector, BigVector: data(), resize()
  void get_vec(V& v) {
    uint64_t n = 0;
    get(&n, sizeof n);
    v.resize(n);
    get(v.data(), n * sizeof(v[0]));
  }
  bool done() const { return at_ == s_.size(); }

 private:
  const std::string& s_;
  const char* what_;
  size_t at_ = 0;
};

}  // namespace crosskv
