#pragma once
// Calibration shards (docs/FORMATS.md, Calibration shards): HDF5 files of [T, L, H, D] keys/values with token ids and positions.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/kv_spec.hpp"
#include "io/h5.hpp"

namespace crosskv {


struct ShardHeader {
  std::string path;
  std::string model, domain;
  std::string model_weights;  // the optional attribute model_weights: the weights' fingerprint (empty: absent)
  KvSpec spec;
  int64_t tokens = 0;
  Dtype key_dtype = Dtype::f32, value_dtype = Dtype::f32, query_dtype = Dtype::f32;
  bool has_queries = false;
  bool has_weights = false;  // the optional per-token `weights` [T] float32 (checked for shape and type)
  bool checksummed = false;  // keys and values carry HDF5's Fletcher-32 checksum (h5::has_fletcher32)
};

class ShardReader {
 public:
  // Opens and validates attributes, datasets and shapes; InputError naming the file on any problem.
  explicit ShardReader(const std::string& path);
  const ShardHeader& header() const { return h_; }

  std::vector<int32_t> token_ids() const { return h5::read_int32s(file_, "token_ids", h_.path); }
  std::vector<int32_t> positions() const { return h5::read_int32s(file_, "positions", h_.path); }
  std::vector<int64_t> seq_offsets() const { return h5::read_int64s(file_, "seq_offsets", h_.path); }

  // Rows t0, t0+stride, ... (count rows) of `dataset` ("keys", "values", "queries") as fp32 [count, L*H*D].
  // `raw` is scratch for the stored bytes.
  void read_rows(const std::string& dataset, int64_t t0, int64_t count, int64_t stride, float* out,
                 std::vector<uint16_t>& raw) const;
  // The same rows as stored, without conversion: fp32 into f32, bf16/fp16 bits into u16 (the other is left alone).
  Dtype read_stored(const std::string& dataset, int64_t t0, int64_t count, int64_t stride,
                          std::vector<float>& f32, std::vector<uint16_t>& u16) const;
  // One layer of every token of `dataset` as fp32 [tokens, heads*head_dim].
  void read_layer(const std::string& dataset, int layer, float* out, std::vector<uint16_t>& raw) const;
  // The same rows of `positions`.
  void read_positions(int64_t t0, int64_t count, int64_t stride, int32_t* out) const;
  // The same rows of `weights`: InputError naming the file when it has none, and the value and its token where one
  // is negative or not finite.
  void read_weights(int64_t t0, int64_t count, int64_t stride, float* out) const;

 private:
  Dtype check_kv_dataset(const std::string& name, int heads);
  // fp32 rows go to f32_dest(count of values), half rows into u16.
  Dtype read_into(const std::string& name, int64_t t0, int64_t count, int64_t stride,
                        const std::function<float*(size_t)>& f32_dest, std::vector<uint16_t>& u16,
                        int layer = -1) const;
  // Half rows read into raw, converted into out (fp32 rows were read there already).
  static void convert_rows(Dtype dt, const std::vector<uint16_t>& raw, float* out);
  ShardHeader h_;
  h5::Handle file_;
};

// Writes a shard (used by crosskv-synth, crosskv-apply and tests).
class ShardWriter {
 public:
  ShardWriter(const std::string& path, const std::string& model, const std::string& domain, const KvSpec& spec,
              int64_t tokens, Dtype dtype, bool with_queries = false, int64_t chunk_tokens = 256,
              bool checksum = true);
  void write_token_ids(const std::vector<int32_t>& ids);
  void write_positions(const std::vector<int32_t>& pos);
  void write_seq_offsets(const std::vector<int64_t>& offs);
  // The optional per-token weights [T] (float32).
  void write_weights(const std::vector<float>& w);
  // Rows [t0, t0+count) of keys/values/queries from fp32 [count, L*H*D] (converted to the stored dtype).
  void write_rows(const std::string& dataset, int64_t t0, int64_t count, const float* data);
  void close();

 private:
  void create_kv(const std::string& name, int heads, int64_t chunk_tokens);
  std::string path_;
  KvSpec spec_;
  int64_t tokens_;
  Dtype dtype_;
  bool checksum_;
  h5::Handle file_;
};

}  // namespace crosskv
