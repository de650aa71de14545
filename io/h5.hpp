#pragma once
// Thin RAII + error checking over the HDF5 C API. Every failing call throws with the file and object named.
#include <hdf5.h>

#include <cstdint>
#include <string>
#include <vector>

namespace crosskv::h5 {

// Silences HDF5's own error-stack printing; our exceptions carry the context.
void quiet();

class Handle {
 public:
  Handle() = default;
  Handle(hid_t id, herr_t (*closer)(hid_t)) : id_(id), closer_(closer) {}
  Handle(Handle&& o) noexcept : id_(o.id_), closer_(o.closer_) { o.id_ = -1; }
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = o.id_;
      closer_ = o.closer_;
      o.id_ = -1;
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { reset(); }
  void reset() {
    if (id_ >= 0 && closer_) closer_(id_);
    id_ = -1;
  }
  hid_t get() const { return id_; }
  operator hid_t() const { return id_; }
  bool valid() const { return id_ >= 0; }

 private:
  hid_t id_ = -1;
  herr_t (*closer_)(hid_t) = nullptr;
};

// Throws SystemError "<what> failed for <where>" when rc < 0.
hid_t check(hid_t rc, const char* what, const std::string& where);

Handle open_file_ro(const std::string& path);  // throws InputError for missing/unreadable/truncated files
Handle create_file(const std::string& path);   // truncates
Handle open_dataset(hid_t file, const std::string& name, const std::string& file_path);  // InputError if missing
bool has_object(hid_t loc, const std::string& name);
// Whether the dataset's chunks carry HDF5's Fletcher-32 checksum (a damaged chunk then fails its read).
bool has_fletcher32(hid_t dataset);
bool has_attr(hid_t obj, const std::string& name);
std::vector<int64_t> dataset_shape(hid_t dset, const std::string& where);

// String attributes: fixed-length or variable-length (h5py writes the latter).
std::string read_string_attr(hid_t obj, const std::string& name, const std::string& where);
int64_t read_int_attr(hid_t obj, const std::string& name, const std::string& where);
void write_string_attr(hid_t obj, const std::string& name, const std::string& value);
void write_int_attr(hid_t obj, const std::string& name, int64_t value);

// Whole 1-D integer dataset.
std::vector<int64_t> read_int64s(hid_t file, const std::string& name, const std::string& path);
std::vector<int32_t> read_int32s(hid_t file, const std::string& name, const std::string& path);

// Writes a float64 dataset of the given shape (whole, uncompressed).
void write_f64(hid_t loc, const std::string& name, const std::vector<hsize_t>& shape, const double* data);

}  // namespace crosskv::h5
