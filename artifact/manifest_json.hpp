#pragma once
// Inside artifact/ only: the manifest's JSON, field by field. Every problem is an InputError naming the file and the
// field ("layers[3].lambda.rho.keys").
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "artifact/manifest.hpp"
#include "artifact/mapper.hpp"

namespace crosskv::manifest_json {

const nlohmann::json& field(const nlohmann::json& j, const std::string& key, const std::string& path,
                            const std::string& prefix = "");
std::string str_field(const nlohmann::json& j, const std::string& key, const std::string& path,
                      const std::string& prefix = "");
int64_t int_field(const nlohmann::json& j, const std::string& key, const std::string& path,
                  const std::string& prefix = "");

nlohmann::json layer_to_json(const ManifestLayer& layer);
// Types only: the caller checks the entry against the manifest (ranges, k, file names).
ManifestLayer layer_from_json(const nlohmann::json& l, const std::string& path, const std::string& prefix);
// The fit's optional fields (λ, its choice, sizes, probe, MLP settings) and the calibration, into `m`.
void read_fit_details(const nlohmann::json& fit, const std::string& path, MapperManifest& m);
ManifestCalibration calibration_from_json(const nlohmann::json& c, const std::string& path);

}  // namespace crosskv::manifest_json
