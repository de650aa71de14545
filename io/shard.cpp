#include "io/shard.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "core/half.hpp"

namespace crosskv {


namespace {

// IEEE half as h5py defines it.
h5::Handle float16_type() {
  hid_t t = H5Tcopy(H5T_IEEE_F32LE);
  H5Tset_fields(t, 15, 10, 5, 0, 10);
  H5Tset_size(t, 2);
  H5Tset_ebias(t, 15);
  return h5::Handle(t, H5Tclose);
}

}  // namespace

ShardReader::ShardReader(const std::string& path) {
  h_.path = path;
  file_ = h5::open_file_ro(path);
  const std::string fmt = h5::read_string_attr(file_, "crosskv_format", path);
  if (fmt != "kv-shard") throw InputError(path + ": attribute crosskv_format is \"" + fmt + "\", expected \"kv-shard\"");
  const int64_t ver = h5::read_int_attr(file_, "crosskv_format_version", path);
  if (ver != 1) throw InputError(path + ": crosskv_format_version " + std::to_string(ver) + " is not supported (expected 1)");
  h_.model = h5::read_string_attr(file_, "model", path);
  h_.domain = h5::read_string_attr(file_, "domain", path);
  if (h5::has_attr(file_, "model_weights")) h_.model_weights = h5::read_string_attr(file_, "model_weights", path);
  h_.spec = parse_kv_spec(h5::read_string_attr(file_, "kv_spec", path), path);
  for (const char* name : {"token_ids", "positions"}) {
    h5::Handle d = h5::open_dataset(file_, name, path);
    auto s = h5::dataset_shape(d, path);
    if (s.size() != 1) throw InputError(path + ": dataset '" + name + "' must be 1-D [T]");
    if (std::string(name) == "token_ids") h_.tokens = s[0];
    else if (s[0] != h_.tokens)
      throw InputError(path + ": dataset 'positions' has " + std::to_string(s[0]) + " rows, token_ids has " +
                       std::to_string(h_.tokens));
  }
  {
    h5::Handle d = h5::open_dataset(file_, "seq_offsets", path);
    auto s = h5::dataset_shape(d, path);
    if (s.size() != 1 || s[0] < 2) throw InputError(path + ": dataset 'seq_offsets' must be 1-D [S+1] with S >= 1");
  }
  h_.key_dtype = check_kv_dataset("keys", h_.spec.n_kv_heads);
  h_.value_dtype = check_kv_dataset("values", h_.spec.n_kv_heads);
  h_.checksummed = h5::has_fletcher32(h5::open_dataset(file_, "keys", path)) &&
                   h5::has_fletcher32(h5::open_dataset(file_, "values", path));
  h_.has_queries = h5::has_object(file_, "queries");
  if (h_.has_queries) h_.query_dtype = check_kv_dataset("queries", h_.spec.n_q_heads);
  h_.has_weights = h5::has_object(file_, "weights");
  if (h_.has_weights) {
    h5::Handle d = h5::open_dataset(file_, "weights", path);
    const auto s = h5::dataset_shape(d, path + ":weights");
    if (s.size() != 1 || s[0] != h_.tokens)
      throw InputError(path + ": dataset 'weights' has " + (s.size() == 1 ? std::to_string(s[0]) + " rows" :
                       std::to_string(s.size()) + " dimensions") + ", expected 1-D [T] with T = " +
                       std::to_string(h_.tokens) + " (one weight per token)");
    h5::Handle t(h5::check(H5Dget_type(d), "H5Dget_type", path + ":weights"), H5Tclose);
    if (H5Tget_class(t) != H5T_FLOAT || H5Tget_size(t) != 4)
      throw InputError(path + ": dataset 'weights' must be float32");
  }
}

Dtype ShardReader::check_kv_dataset(const std::string& name, int heads) {
  h5::Handle d = h5::open_dataset(file_, name, h_.path);
  auto s = h5::dataset_shape(d, h_.path + ":" + name);
  const std::vector<int64_t> want = {h_.tokens, h_.spec.n_layers, heads, h_.spec.head_dim};
  if (s != want) {
    auto fmt = [](const std::vector<int64_t>& v) {
      std::string o = "[";
      for (size_t i = 0; i < v.size(); ++i) o += (i ? ", " : "") + std::to_string(v[i]);
      return o + "]";
    };
    throw InputError(h_.path + ": dataset '" + name + "' has shape " + fmt(s) + ", expected " + fmt(want) +
                     " [T, n_layers, heads, head_dim] from kv_spec");
  }
  h5::Handle t(h5::check(H5Dget_type(d), "H5Dget_type", h_.path + ":" + name), H5Tclose);
  std::string attr;
  if (h5::has_attr(d, "dtype")) attr = h5::read_string_attr(d, "dtype", h_.path + ":" + name);
  const H5T_class_t cls = H5Tget_class(t);
  const size_t size = H5Tget_size(t);
  if (attr == "bfloat16" && cls == H5T_INTEGER && size == 2) return Dtype::bf16;
  if (attr.empty() || attr == "float32" || attr == "float16") {
    if (cls == H5T_FLOAT && size == 4) return Dtype::f32;
    if (cls == H5T_FLOAT && size == 2) return Dtype::f16;
  }
  throw InputError(h_.path + ": dataset '" + name + "' has an unknown dtype (class " + std::to_string(cls) +
                   ", " + std::to_string(size) + " bytes" + (attr.empty() ? "" : ", dtype attribute \"" + attr + "\"") +
                   "); expected float32, float16, or uint16 with dtype = \"bfloat16\"");
}

namespace {

// Rows t0, t0+stride, ... (count of them) of a [T, L, H, D] dataset; of one layer when layer >= 0.
h5::Handle row_selection(hid_t dset, int64_t t0, int64_t count, int64_t stride, const std::vector<int64_t>& shape,
                         const std::string& where, int layer = -1) {
  h5::Handle space(h5::check(H5Dget_space(dset), "H5Dget_space", where), H5Sclose);
  std::vector<hsize_t> start(shape.size(), 0), str(shape.size(), 1), cnt(shape.begin(), shape.end()),
      blk(shape.size(), 1);
  start[0] = t0;
  str[0] = stride;
  cnt[0] = count;
  if (layer >= 0) start[1] = layer, cnt[1] = 1;
  h5::check(H5Sselect_hyperslab(space, H5S_SELECT_SET, start.data(), str.data(), cnt.data(), blk.data()),
            "H5Sselect_hyperslab", where);
  return space;
}

}  // namespace

Dtype ShardReader::read_stored(const std::string& name, int64_t t0, int64_t count, int64_t stride,
                                     std::vector<float>& f32, std::vector<uint16_t>& u16) const {
  return read_into(name, t0, count, stride, [&](size_t n) {
    f32.resize(n);
    return f32.data();
  }, u16);
}

Dtype ShardReader::read_into(const std::string& name, int64_t t0, int64_t count, int64_t stride,
                             const std::function<float*(size_t)>& f32_dest, std::vector<uint16_t>& u16,
                             int layer) const {
  const std::string where = h_.path + ":" + name;
  CROSSKV_ASSERT(count > 0 && t0 >= 0 && t0 + (count - 1) * stride < h_.tokens, "row range out of bounds: " + where);
  h5::Handle d = h5::open_dataset(file_, name, h_.path);
  auto shape = h5::dataset_shape(d, where);
  int64_t row = 1;
  CROSSKV_ASSERT(layer < 0 || (shape.size() == 4 && layer < shape[1]), "layer out of range: " + where);
  if (layer >= 0) shape[1] = 1;
  for (size_t i = 1; i < shape.size(); ++i) row *= shape[i];
  h5::Handle fspace = row_selection(d, t0, count, stride, shape, where, layer);
  std::vector<hsize_t> mdims(shape.begin(), shape.end());
  mdims[0] = count;
  h5::Handle mspace(H5Screate_simple(static_cast<int>(mdims.size()), mdims.data(), nullptr), H5Sclose);
  const Dtype dt = name == "keys" ? h_.key_dtype : name == "values" ? h_.value_dtype : h_.query_dtype;
  const size_t n = static_cast<size_t>(count * row);
  herr_t rc;
  if (dt == Dtype::f32) {
    rc = H5Dread(d, H5T_NATIVE_FLOAT, mspace, fspace, H5P_DEFAULT, f32_dest(n));
  } else {
    u16.resize(n);
    if (dt == Dtype::bf16) {
      rc = H5Dread(d, H5T_NATIVE_UINT16, mspace, fspace, H5P_DEFAULT, u16.data());
    } else {
      h5::Handle ft(H5Dget_type(d), H5Tclose);
      rc = H5Dread(d, ft, mspace, fspace, H5P_DEFAULT, u16.data());
    }
  }
  if (rc < 0)
    throw InputError(h_.path + ": cannot read tokens " + std::to_string(t0) + ".." +
                     std::to_string(t0 + (count - 1) * stride) + (layer >= 0 ? " of layer " + std::to_string(layer) : "") +
                     " of dataset '" + name + "' (" +
                     (h_.checksummed ? "damaged: a chunk fails its Fletcher-32 checksum, or the file is truncated"
                                     : "truncated or corrupt file?") +
                     ")");
  return dt;
}

void ShardReader::read_layer(const std::string& name, int layer, float* out, std::vector<uint16_t>& raw) const {
  convert_rows(read_into(name, 0, h_.tokens, 1, [&](size_t) { return out; }, raw, layer), raw, out);
}

void ShardReader::read_rows(const std::string& name, int64_t t0, int64_t count, int64_t stride, float* out,
                            std::vector<uint16_t>& raw) const {
  convert_rows(read_into(name, t0, count, stride, [&](size_t) { return out; }, raw), raw, out);
}

void ShardReader::convert_rows(Dtype dt, const std::vector<uint16_t>& raw, float* out) {
  if (dt == Dtype::f32) return;
  const size_t n = raw.size();
  if (dt == Dtype::bf16)
    for (size_t i = 0; i < n; ++i) out[i] = bf16_to_float(raw[i]);
  else
    for (size_t i = 0; i < n; ++i) out[i] = fp16_to_float(raw[i]);
}

void ShardReader::read_positions(int64_t t0, int64_t count, int64_t stride, int32_t* out) const {
  h5::Handle d = h5::open_dataset(file_, "positions", h_.path);
  auto shape = h5::dataset_shape(d, h_.path);
  h5::Handle fspace = row_selection(d, t0, count, stride, shape, h_.path + ":positions");
  hsize_t m = count;
  h5::Handle mspace(H5Screate_simple(1, &m, nullptr), H5Sclose);
  if (H5Dread(d, H5T_NATIVE_INT32, mspace, fspace, H5P_DEFAULT, out) < 0)
    throw InputError(h_.path + ": cannot read dataset 'positions' (truncated or corrupt file?)");
}

void ShardReader::read_weights(int64_t t0, int64_t count, int64_t stride, float* out) const {
  if (!h_.has_weights) throw InputError(h_.path + ": no dataset 'weights'");
  h5::Handle d = h5::open_dataset(file_, "weights", h_.path);
  h5::Handle fspace = row_selection(d, t0, count, stride, {h_.tokens}, h_.path + ":weights");
  hsize_t m = count;
  h5::Handle mspace(H5Screate_simple(1, &m, nullptr), H5Sclose);
  if (H5Dread(d, H5T_NATIVE_FLOAT, mspace, fspace, H5P_DEFAULT, out) < 0)
    throw InputError(h_.path + ": cannot read dataset 'weights' (truncated or corrupt file?)");
  for (int64_t i = 0; i < count; ++i)
    if (!(out[i] >= 0.0f) || !std::isfinite(out[i]))
      throw InputError(h_.path + ": dataset 'weights' has " + std::to_string(out[i]) + " at token " +
                       std::to_string(t0 + i * stride) + " (expected finite weights >= 0)");
}

ShardWriter::ShardWriter(const std::string& path, const std::string& model, const std::string& domain,
                         const KvSpec& spec, int64_t tokens, Dtype dtype, bool with_queries,
                         int64_t chunk_tokens, bool checksum)
    : path_(path), spec_(spec), tokens_(tokens), dtype_(dtype), checksum_(checksum) {
  file_ = h5::create_file(path);
  h5::write_string_attr(file_, "crosskv_format", "kv-shard");
  h5::write_int_attr(file_, "crosskv_format_version", 1);
  h5::write_string_attr(file_, "model", model);
  h5::write_string_attr(file_, "domain", domain);
  h5::write_string_attr(file_, "kv_spec", kv_spec_to_string(spec));
  create_kv("keys", spec.n_kv_heads, chunk_tokens);
  create_kv("values", spec.n_kv_heads, chunk_tokens);
  if (with_queries) create_kv("queries", spec.n_q_heads, chunk_tokens);
}

void ShardWriter::create_kv(const std::string& name, int heads, int64_t chunk_tokens) {
  hsize_t dims[4] = {static_cast<hsize_t>(tokens_), static_cast<hsize_t>(spec_.n_layers), static_cast<hsize_t>(heads),
                     static_cast<hsize_t>(spec_.head_dim)};
  hsize_t chunk[4] = {static_cast<hsize_t>(std::max<int64_t>(1, std::min(chunk_tokens, tokens_))), dims[1], dims[2],
                      dims[3]};
  h5::Handle space(H5Screate_simple(4, dims, nullptr), H5Sclose);
  h5::Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  if (tokens_ > 0) {  // checksummed chunks: a flipped bit in the data fails its read (docs/FORMATS.md, Calibration shards)
    h5::check(H5Pset_chunk(dcpl, 4, chunk), "H5Pset_chunk", path_);
    if (checksum_) h5::check(H5Pset_fletcher32(dcpl), "H5Pset_fletcher32", path_ + ":" + name);
  }
  h5::Handle type = dtype_ == Dtype::f32    ? h5::Handle(H5Tcopy(H5T_IEEE_F32LE), H5Tclose)
                    : dtype_ == Dtype::bf16 ? h5::Handle(H5Tcopy(H5T_STD_U16LE), H5Tclose)
                                                  : float16_type();
  h5::Handle d(h5::check(H5Dcreate2(file_, name.c_str(), type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT), "H5Dcreate2",
                         path_ + ":" + name),
               H5Dclose);
  if (dtype_ == Dtype::bf16) h5::write_string_attr(d, "dtype", "bfloat16");
}

namespace {

void write_1d(hid_t file, const std::string& path, const char* name, hid_t file_type, hid_t mem_type,
              const void* data, size_t n, bool checksum) {
  hsize_t dims = n;
  h5::Handle s(H5Screate_simple(1, &dims, nullptr), H5Sclose);
  h5::Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  if (n > 0 && checksum) {
    h5::check(H5Pset_chunk(dcpl, 1, &dims), "H5Pset_chunk", path);
    h5::check(H5Pset_fletcher32(dcpl), "H5Pset_fletcher32", path + ":" + name);
  }
  h5::Handle d(h5::check(H5Dcreate2(file, name, file_type, s, H5P_DEFAULT, dcpl, H5P_DEFAULT), "H5Dcreate2",
                         path + ":" + name),
               H5Dclose);
  h5::check(H5Dwrite(d, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), "H5Dwrite", path + ":" + name);
}

}  // namespace

void ShardWriter::write_token_ids(const std::vector<int32_t>& v) {
  write_1d(file_, path_, "token_ids", H5T_STD_I32LE, H5T_NATIVE_INT32, v.data(), v.size(), checksum_);
}
void ShardWriter::write_positions(const std::vector<int32_t>& v) {
  write_1d(file_, path_, "positions", H5T_STD_I32LE, H5T_NATIVE_INT32, v.data(), v.size(), checksum_);
}
void ShardWriter::write_seq_offsets(const std::vector<int64_t>& v) {
  write_1d(file_, path_, "seq_offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, v.data(), v.size(), checksum_);
}
void ShardWriter::write_weights(const std::vector<float>& v) {
  write_1d(file_, path_, "weights", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, v.data(), v.size(), checksum_);
}

void ShardWriter::write_rows(const std::string& name, int64_t t0, int64_t count, const float* data) {
  h5::Handle d = h5::open_dataset(file_, name, path_);
  auto shape = h5::dataset_shape(d, path_);
  h5::Handle fspace = row_selection(d, t0, count, 1, shape, path_ + ":" + name);
  std::vector<hsize_t> mdims(shape.begin(), shape.end());
  mdims[0] = count;
  h5::Handle mspace(H5Screate_simple(4, mdims.data(), nullptr), H5Sclose);
  const size_t n = static_cast<size_t>(count * shape[1] * shape[2] * shape[3]);
  if (dtype_ == Dtype::f32) {
    h5::check(H5Dwrite(d, H5T_NATIVE_FLOAT, mspace, fspace, H5P_DEFAULT, data), "H5Dwrite", path_ + ":" + name);
    return;
  }
  std::vector<uint16_t> raw(n);
  if (dtype_ == Dtype::bf16) {
    for (size_t i = 0; i < n; ++i) raw[i] = float_to_bf16(data[i]);
    h5::check(H5Dwrite(d, H5T_NATIVE_UINT16, mspace, fspace, H5P_DEFAULT, raw.data()), "H5Dwrite", path_ + ":" + name);
  } else {
    for (size_t i = 0; i < n; ++i) raw[i] = float_to_fp16(data[i]);
    h5::Handle t = float16_type();
    h5::check(H5Dwrite(d, t, mspace, fspace, H5P_DEFAULT, raw.data()), "H5Dwrite", path_ + ":" + name);
  }
}

void ShardWriter::close() {
  if (file_.valid()) h5::check(H5Fflush(file_, H5F_SCOPE_GLOBAL), "H5Fflush", path_);
  file_.reset();
}

}  // namespace crosskv
