#pragma once
// Flat byte messages, for exchanges between ranks and checkpoint payloads: values appended in order, read back in the
// same order. A vector goes as its uint64 length, then its elements.
//
// A record's fields are listed once, in a function template over the record and the direction:
//   template <class R, class IO> void fields(R& r, IO& io) { io(r.a, r.b); io.as<int32_t>(r.small); ... }
// called with a ByteWriter (R const) to write and a ByteReader to read, so the two cannot drift apart. io(x...)
// takes trivially copyable values and vectors; as<W>(x) keeps x as a W; map(x, to, from) through two functions;
// fixed(v, n) n elements without a length; optional(o, fn) a flag byte, then fn(*o) where it holds a value.
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>

#include "core/error.hpp"

namespace crosskv {

template <class T>
concept ByteSequence = requires(T& v) {
  v.data();
  v.size();
  v.resize(0);
};

class ByteWriter {
 public:
  void put(const void* p, size_t n) { s_.append(static_cast<const char*>(p), n); }
  template <class V>  // std::vector, BigVector: data(), size()
  void put_vec(const V& v) {
    const uint64_t n = v.size();
    put(&n, sizeof n);
    put(v.data(), n * sizeof(v[0]));
  }
  template <class... T>
  void operator()(const T&... x) {
    (field(x), ...);
  }
  template <class W, class T>
  void as(const T& x) {
    const W w = static_cast<W>(x);
    put(&w, sizeof w);
  }
  template <class T, class To, class From>
  void map(const T& x, To to, From) {
    const auto w = to(x);
    put(&w, sizeof w);
  }
  template <class V>
  void fixed(const V& v, size_t n) {
    CROSSKV_ASSERT(v.size() == n, "a fixed-length field of another length");
    put(v.data(), n * sizeof(v[0]));
  }
  template <class T, class Fn>
  void optional(const std::optional<T>& o, Fn&& fn) {
    as<uint8_t>(o.has_value());
    if (o) fn(*o);
  }
  std::string& bytes() { return s_; }

 private:
  template <class T>
  void field(const T& x) {
    if constexpr (ByteSequence<T>) {
      put_vec(x);
    } else {
      static_assert(std::is_trivially_copyable_v<T>, "a field is a trivially copyable value or a vector of them");
      put(&x, sizeof x);
    }
  }
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
  template <class... T>
  void operator()(T&... x) {
    (field(x), ...);
  }
  template <class W, class T>
  void as(T& x) {
    W w{};
    get(&w, sizeof w);
    x = static_cast<T>(w);
  }
  template <class T, class To, class From>
  void map(T& x, To to, From from) {
    decltype(to(x)) w{};
    get(&w, sizeof w);
    x = from(w);
  }
  template <class V>
  void fixed(V& v, size_t n) {
    v.resize(n);
    get(v.data(), n * sizeof(v[0]));
  }
  template <class T, class Fn>
  void optional(std::optional<T>& o, Fn&& fn) {
    bool present = false;
    as<uint8_t>(present);
    o.reset();
    if (present) fn(o.emplace());
  }
  bool done() const { return at_ == s_.size(); }

 private:
  template <class T>
  void field(T& x) {
    if constexpr (ByteSequence<T>) {
      get_vec(x);
    } else {
      static_assert(std::is_trivially_copyable_v<T>, "a field is a trivially copyable value or a vector of them");
      get(&x, sizeof x);
    }
  }
  const std::string& s_;
  const char* what_;
  size_t at_ = 0;
};

}  // namespace crosskv
