#include "io/h5.hpp"

#include <filesystem>

#include "core/error.hpp"

namespace crosskv::h5 {

void quiet() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

hid_t check(hid_t rc, const char* what, const std::string& where) {
  if (rc < 0) throw SystemError(std::string("HDF5 ") + what + " failed for " + where);
  return rc;
}

Handle open_file_ro(const std::string& path) {
  quiet();
  if (!std::filesystem::exists(path)) throw InputError(path + ": file not found");
  htri_t is = H5Fis_hdf5(path.c_str());
  if (is <= 0) throw InputError(path + ": not a readable HDF5 file (truncated or corrupt?)");
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) throw InputError(path + ": cannot open HDF5 file (truncated or corrupt?)");
  return Handle(f, H5Fclose);
}

Handle create_file(const std::string& path) {
  quiet();
  hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (f < 0) throw InputError(path + ": cannot create HDF5 file (is the folder writable?)");
  return Handle(f, H5Fclose);
}

bool has_object(hid_t loc, const std::string& name) { return H5Lexists(loc, name.c_str(), H5P_DEFAULT) > 0; }
bool has_attr(hid_t obj, const std::string& name) { return H5Aexists(obj, name.c_str()) > 0; }

bool has_fletcher32(hid_t dataset) {
  Handle plist(check(H5Dget_create_plist(dataset), "H5Dget_create_plist", "a dataset"), H5Pclose);
  const int n = H5Pget_nfilters(plist);
  for (int i = 0; i < n; ++i) {
    unsigned flags = 0, config = 0;
    size_t nvalues = 0;
    if (H5Pget_filter2(plist, static_cast<unsigned>(i), &flags, &nvalues, nullptr, 0, nullptr, &config) ==
        H5Z_FILTER_FLETCHER32)
      return true;
  }
  return false;
}

Handle open_dataset(hid_t file, const std::string& name, const std::string& path) {
  if (!has_object(file, name)) throw InputError(path + ": dataset '" + name + "' is missing");
  hid_t d = H5Dopen2(file, name.c_str(), H5P_DEFAULT);
  if (d < 0) throw InputError(path + ": cannot open dataset '" + name + "' (corrupt file?)");
  return Handle(d, H5Dclose);
}

std::vector<int64_t> dataset_shape(hid_t dset, const std::string& where) {
  Handle space(check(H5Dget_space(dset), "H5Dget_space", where), H5Sclose);
  int nd = H5Sget_simple_extent_ndims(space);
  check(nd, "H5Sget_simple_extent_ndims", where);
  std::vector<hsize_t> dims(nd);
  H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  return std::vector<int64_t>(dims.begin(), dims.end());
}

std::string read_string_attr(hid_t obj, const std::string& name, const std::string& where) {
  if (!has_attr(obj, name)) throw InputError(where + ": attribute '" + name + "' is missing");
  Handle a(check(H5Aopen(obj, name.c_str(), H5P_DEFAULT), "H5Aopen", where + " attribute " + name), H5Aclose);
  Handle t(check(H5Aget_type(a), "H5Aget_type", where), H5Tclose);
  if (H5Tget_class(t) != H5T_STRING) throw InputError(where + ": attribute '" + name + "' must be a string");
  if (H5Tis_variable_str(t) > 0) {
    Handle mt(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(mt, H5T_VARIABLE);
    H5Tset_cset(mt, H5Tget_cset(t));
    char* s = nullptr;
    check(H5Aread(a, mt, &s), "H5Aread", where + " attribute " + name);
    std::string out = s ? s : "";
    Handle space(H5Aget_space(a), H5Sclose);
    H5Dvlen_reclaim(mt, space, H5P_DEFAULT, &s);
    return out;
  }
  size_t n = H5Tget_size(t);
  std::string out(n, '\0');
  Handle mt(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(mt, n);
  H5Tset_cset(mt, H5Tget_cset(t));
  H5Tset_strpad(mt, H5Tget_strpad(t));
  check(H5Aread(a, mt, out.data()), "H5Aread", where + " attribute " + name);
  out.resize(out.find('\0') == std::string::npos ? n : out.find('\0'));
  return out;
}

int64_t read_int_attr(hid_t obj, const std::string& name, const std::string& where) {
  if (!has_attr(obj, name)) throw InputError(where + ": attribute '" + name + "' is missing");
  Handle a(check(H5Aopen(obj, name.c_str(), H5P_DEFAULT), "H5Aopen", where + " attribute " + name), H5Aclose);
  Handle t(check(H5Aget_type(a), "H5Aget_type", where), H5Tclose);
  if (H5Tget_class(t) != H5T_INTEGER) throw InputError(where + ": attribute '" + name + "' must be an integer");
  int64_t v = 0;
  check(H5Aread(a, H5T_NATIVE_INT64, &v), "H5Aread", where + " attribute " + name);
  return v;
}

void write_string_attr(hid_t obj, const std::string& name, const std::string& value) {
  Handle t(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(t, value.empty() ? 1 : value.size());
  H5Tset_cset(t, H5T_CSET_UTF8);
  Handle s(H5Screate(H5S_SCALAR), H5Sclose);
  Handle a(check(H5Acreate2(obj, name.c_str(), t, s, H5P_DEFAULT, H5P_DEFAULT), "H5Acreate2", name), H5Aclose);
  std::string buf = value.empty() ? std::string(1, '\0') : value;
  check(H5Awrite(a, t, buf.data()), "H5Awrite", name);
}

void write_int_attr(hid_t obj, const std::string& name, int64_t value) {
  Handle s(H5Screate(H5S_SCALAR), H5Sclose);
  Handle a(check(H5Acreate2(obj, name.c_str(), H5T_STD_I64LE, s, H5P_DEFAULT, H5P_DEFAULT), "H5Acreate2", name),
           H5Aclose);
  check(H5Awrite(a, H5T_NATIVE_INT64, &value), "H5Awrite", name);
}

namespace {
template <class T>
std::vector<T> read_ints(hid_t file, const std::string& name, const std::string& path, hid_t mem_type) {
  Handle d = open_dataset(file, name, path);
  auto shape = dataset_shape(d, path + ":" + name);
  if (shape.size() != 1) throw InputError(path + ": dataset '" + name + "' must be 1-D");
  Handle t(check(H5Dget_type(d), "H5Dget_type", path + ":" + name), H5Tclose);
  if (H5Tget_class(t) != H5T_INTEGER) throw InputError(path + ": dataset '" + name + "' must be integer");
  std::vector<T> v(shape[0]);
  if (!v.empty() && H5Dread(d, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()) < 0)
    throw InputError(path + ": cannot read dataset '" + name + "' (truncated or corrupt file?)");
  return v;
}
}  // namespace

std::vector<int64_t> read_int64s(hid_t f, const std::string& n, const std::string& p) {
  return read_ints<int64_t>(f, n, p, H5T_NATIVE_INT64);
}
std::vector<int32_t> read_int32s(hid_t f, const std::string& n, const std::string& p) {
  return read_ints<int32_t>(f, n, p, H5T_NATIVE_INT32);
}

void write_f64(hid_t loc, const std::string& name, const std::vector<hsize_t>& shape, const double* data) {
  Handle s(check(H5Screate_simple(static_cast<int>(shape.size()), shape.data(), nullptr), "H5Screate_simple", name),
           H5Sclose);
  Handle d(check(H5Dcreate2(loc, name.c_str(), H5T_IEEE_F64LE, s, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                 "H5Dcreate2", name),
           H5Dclose);
  check(H5Dwrite(d, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), "H5Dwrite", name);
}

}  // namespace crosskv::h5
