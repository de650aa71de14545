#include "fit/validate.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>

#include "core/error.hpp"
#include "core/rope.hpp"
#include "core/sha256.hpp"
#include "io/shard.hpp"
#include "io/store.hpp"
#include "fit/calibration.hpp"
#include "fit/stream.hpp"

namespace fs = std::filesystem;

namespace crosskv {

PairDims Calibration::dims() const {
  return {source.n_layers, source.n_kv_heads, source.head_dim, target.n_layers, target.n_kv_heads, target.head_dim};
}

namespace {

void check_output_writable(const std::string& dir) {
  std::error_code ec;
  fs::path p(dir);
  if (fs::exists(p, ec)) {
    if (!fs::is_directory(p, ec)) throw InputError("output.dir: " + dir + " exists and is not a folder");
  } else {
    fs::path parent = p;
    while (!parent.empty() && !fs::exists(parent, ec)) parent = parent.parent_path();
    if (parent.empty()) parent = ".";
    if (!fs::is_directory(parent, ec))
      throw InputError("output.dir: " + dir + " cannot be created (" + parent.string() + " is not a folder)");
    p = parent;
  }
  if (::access(p.c_str(), W_OK | X_OK) != 0)
    throw InputError("output.dir: " + dir + " is not writable (" + p.string() + ")");
}

// The export replaces "<out>/k<K>" and "<out>/k<K>.partial" folders; anything else under those names is the user's.
void check_artifact_names(const FitConfig& cfg) {
  for (const auto& k : cfg.fit.ks)
    for (const Structure s : cfg.fit.structures)
      for (const std::string suffix : {"", ".partial"}) {
        const fs::path p = fs::path(cfg.output.dir) / (mapper_folder_name(k.label(), s) + suffix);
        std::error_code ec;
        const auto st = fs::symlink_status(p, ec);
        if (!fs::exists(st) || fs::is_directory(st)) continue;
        throw InputError("output.dir: " + p.string() + " exists and is not a folder (the k = " + k.label() + " " +
                         to_string(s) + " mapper goes there); move it away");
      }
}

// Both stores' shards (relative paths).
// Whether two paths name one place (after symlinks and ".."), or `inner` lies inside `outer` with inside = true.
bool same_place(const std::string& a, const std::string& b, bool inside = false) {
  std::error_code ec;
  const fs::path pa = fs::weakly_canonical(fs::absolute(a, ec), ec), pb = fs::weakly_canonical(fs::absolute(b, ec), ec);
  if (!inside) return pa == pb;
  auto ia = pa.begin();
  for (auto ib = pb.begin(); ib != pb.end(); ++ib, ++ia)
    if (ib->empty()) continue;
    else if (ia == pa.end() || *ia != *ib) return false;
  return true;
}

// The fit's outputs never land in a store it reads: a second fit would take r2.h5 and the rest for shards.
void check_output_outside_stores(const FitConfig& cfg) {
  for (const auto& [key, store] : {std::pair{"source", cfg.source.store}, std::pair{"target", cfg.target.store}})
    if (same_place(cfg.output.dir, store, true))
      throw InputError("output.dir: " + cfg.output.dir + " is inside the " + key + " store " + store +
                       "; the fit's outputs must live outside the stores it reads");
}

void check_checkpoint_dir(const FitConfig& cfg) {
  if (cfg.runtime.checkpoint.dir.empty()) return;
  std::error_code ec;
  if (fs::exists(cfg.runtime.checkpoint.dir, ec) && !fs::is_directory(cfg.runtime.checkpoint.dir, ec))
    throw InputError("runtime.checkpoint.dir: " + cfg.runtime.checkpoint.dir + " exists and is not a folder");
}

struct Listed {
  std::vector<std::string> source;
  std::set<std::string> target;
};

// The fit's domains: calibration.domains, or every domain with shards left for the fit (held-out shards,
// eval.shards, are not read by it); each must have such shards, and calibration.weights may name only these.
std::vector<std::string> fit_domains(const FitConfig& cfg, const std::vector<std::string>& src,
                                     const std::vector<std::string>& tgt) {
  const std::set<std::string> eval_set(cfg.eval.shards.begin(), cfg.eval.shards.end());
  std::set<std::string> found_domains;
  for (const auto* side : {&src, &tgt})
    for (const auto& r : *side)
      if (!eval_set.count(r)) found_domains.insert(shard_domain(r));
  std::vector<std::string> domains = cfg.calibration.domains;
  if (domains.empty()) domains.assign(found_domains.begin(), found_domains.end());
  auto held_out_domain = [&](const std::string& d) {
    return std::any_of(src.begin(), src.end(), [&](const std::string& r) { return shard_domain(r) == d; });
  };
  for (const auto& d : domains)
    if (!found_domains.count(d) && !eval_set.empty() && held_out_domain(d))
      throw InputError("eval.shards: holds out every shard of domain \"" + d + "\"; it left nothing of it to fit on");
  if (found_domains.empty() && !eval_set.empty() && !src.empty())
    throw InputError("eval.shards: holds out every shard of " + cfg.source.store + " (" +
                     std::to_string(eval_set.size()) + "); it left nothing to fit on");
  for (const auto& d : domains)
    if (!found_domains.count(d))
      throw InputError("calibration.domains: domain \"" + d + "\" has no shards in " + cfg.source.store + " or " +
                       cfg.target.store);
  for (const auto& [dom, w] : cfg.calibration.weights)
    if (std::find(domains.begin(), domains.end(), dom) == domains.end())
      throw ConfigError(cfg.config_path + ": calibration.weights: domain \"" + dom + "\" is not among the fit's domains");
  return domains;
}

// The stores listed, the domains chosen, every shard paired by relative path (held-out shards apart).
Listed pair_shards(const FitConfig& cfg, Calibration& cal) {
  if (same_place(cfg.source.store, cfg.target.store))
    throw InputError("source.store and target.store: the two stores are one (" + cfg.source.store + " and " +
                     cfg.target.store + "); the source and target models' shards need a store each");
  StoreListing src_list = list_store(cfg.source.store, "source.store");
  StoreListing tgt_list = list_store(cfg.target.store, "target.store");
  const std::vector<std::string>& src = src_list.shards;
  const std::vector<std::string>& tgt = tgt_list.shards;
  cal.skipped = src_list.skipped;
  cal.skipped.insert(cal.skipped.end(), tgt_list.skipped.begin(), tgt_list.skipped.end());
  const std::set<std::string> src_set(src.begin(), src.end()), tgt_set(tgt.begin(), tgt.end());
  const std::vector<std::string> domains = fit_domains(cfg, src, tgt);
  cal.domains = domains;
  const std::set<std::string> want(domains.begin(), domains.end());
  std::map<std::string, std::string> canonical;  // resolved path -> the path it was first seen under
  for (const auto& side : {std::make_pair(&src, &tgt_set), std::make_pair(&tgt, &src_set)}) {
    for (const auto& r : *side.first) {
      if (!want.count(shard_domain(r))) continue;
      if (!side.second->count(r)) {
        const bool in_source = side.first == &src;
        throw InputError((in_source ? cfg.source.store : cfg.target.store) + "/" + r + ": unpaired shard (no " + r +
                         " in the " + (in_source ? "target" : "source") + " store " +
                         (in_source ? cfg.target.store : cfg.source.store) + ")");
      }
    }
  }
  const std::set<std::string> held(cfg.eval.shards.begin(), cfg.eval.shards.end());
  for (const auto& r : cfg.eval.shards) {
    if (!src_set.count(r) || !tgt_set.count(r))
      throw InputError("eval.shards: \"" + r + "\" is not a shard of both " + cfg.source.store + " and " +
                       cfg.target.store);
    ShardPair p;
    p.rel = r;
    p.domain = shard_domain(r);
    p.source_path = (fs::path(cfg.source.store) / r).string();
    p.target_path = (fs::path(cfg.target.store) / r).string();
    cal.eval_shards.push_back(std::move(p));
  }
  for (const auto& r : src) {
    if (!want.count(shard_domain(r)) || held.count(r)) continue;
    ShardPair p;
    p.rel = r;
    p.domain = shard_domain(r);
    if (p.domain.empty())
      throw InputError(cfg.source.store + "/" + r + ": shard is not inside a domain folder (expected <domain>/<name>.h5)");
    p.source_path = (fs::path(cfg.source.store) / r).string();
    p.target_path = (fs::path(cfg.target.store) / r).string();
    for (const auto& path : {p.source_path, p.target_path}) {
      std::error_code ec;
      auto c = fs::weakly_canonical(path, ec).string();
      auto [it, fresh] = canonical.emplace(c, path);
      if (!fresh) throw InputError(path + ": shard listed twice (it is the same file as " + it->second + ")");
    }
    cal.shards.push_back(std::move(p));
  }
  for (const auto& d : domains) {
    bool any = std::any_of(cal.shards.begin(), cal.shards.end(), [&](const ShardPair& s) { return s.domain == d; });
    if (!any) throw InputError("calibration.domains: domain \"" + d + "\" has no paired shards");
  }
  if (cal.shards.empty()) throw InputError("source.store: no shards (*.h5) found in " + cfg.source.store);

  return {src, tgt_set};
}

// fit.weighting: dataset reads the target shard's `weights` (docs/FORMATS.md, Calibration shards): present (in the target's shard, not only the
// source's), finite, >= 0, and not all zero over the tokens the fit uses.
void check_weights(const FitConfig& cfg, const ShardPair& p, const ShardReader& s, const ShardReader& t) {
  if (cfg.fit.weighting != Weighting::dataset) return;
  if (!t.header().has_weights)
    throw InputError(p.target_path + ": no dataset 'weights' (fit.weighting: dataset reads per-token weights from the "
                     "target's shards" + (s.header().has_weights ? "; " + p.source_path + " has one, but the source's "
                     "are not read: write them into the target's shard" : "") + ")");
  const int64_t used = (t.header().tokens + cfg.calibration.token_stride - 1) / cfg.calibration.token_stride;
  std::vector<float> w(static_cast<size_t>(used));
  t.read_weights(0, used, cfg.calibration.token_stride, w.data());
  double sum = 0;
  for (float x : w) sum += x;  // read_weights refused negative and non-finite ones
  if (!(sum > 0))
    throw InputError(p.target_path + ": dataset 'weights' is all zero over the " + std::to_string(used) +
                     " tokens the fit reads (the shard would add nothing; leave it out of the store)");
}

// Each pair's headers, token ids and positions checked against each other and the first pair; tokens counted.
void read_pairs(const FitConfig& cfg, Calibration& cal) {
  int64_t budget = cfg.calibration.max_tokens.value_or(INT64_MAX);
  std::map<std::string, std::string> fingerprints;  // a shard pair's fingerprint -> its source path
  bool first = true;
  for (auto& p : cal.shards) {
    ShardReader s(p.source_path), t(p.target_path);
    const auto& hs = s.header();
    const auto& ht = t.header();
    cal.shard_files += 2;
    cal.unchecked_files += !hs.checksummed + !ht.checksummed;
    if (first) {
      cal.source = hs.spec;
      cal.target = ht.spec;
      cal.source_model = hs.model;
      cal.target_model = ht.model;
      cal.source_weights = hs.model_weights;
      cal.target_weights = ht.model_weights;
      Rope(cal.source, p.source_path);
      Rope(cal.target, p.target_path);
      first = false;
    } else {
      if (hs.spec != cal.source)
        throw InputError(p.source_path + ": kv_spec differs from the store's first shard (" + cal.shards[0].source_path + ")");
      if (ht.spec != cal.target)
        throw InputError(p.target_path + ": kv_spec differs from the store's first shard (" + cal.shards[0].target_path + ")");
      for (const auto& [h, weights, path, first_path] :
           {std::tuple{&hs, &cal.source_weights, &p.source_path, &cal.shards[0].source_path},
            std::tuple{&ht, &cal.target_weights, &p.target_path, &cal.shards[0].target_path}})
        if (h->model_weights != *weights)
          throw InputError(*path + ": attribute model_weights is '" + h->model_weights + "', the store's first shard (" +
                           *first_path + ") has '" + *weights + "': one store must hold one model's KV");
    }
    const double xs = static_cast<double>(hs.spec.n_layers) * hs.spec.features_per_layer(),
                 ys = static_cast<double>(ht.spec.n_layers) * ht.spec.features_per_layer();
    cal.stored_bytes_per_token = std::max(
        cal.stored_bytes_per_token,
        xs * static_cast<double>(dtype_bytes(hs.key_dtype) + dtype_bytes(hs.value_dtype)) +
            ys * static_cast<double>(dtype_bytes(ht.key_dtype) + dtype_bytes(ht.value_dtype)));
    if (hs.tokens != ht.tokens)
      throw InputError(p.target_path + ": " + std::to_string(ht.tokens) + " tokens, but the source shard has " +
                       std::to_string(hs.tokens));
    check_weights(cfg, p, s, t);
    const auto ids_s = s.token_ids(), ids_t = t.token_ids();
    if (ids_s != ids_t) {
      size_t i = std::mismatch(ids_s.begin(), ids_s.end(), ids_t.begin()).first - ids_s.begin();
      throw InputError(p.target_path + ": token_ids differ from " + p.source_path + " at token " + std::to_string(i) +
                       " (the shards must hold the same text)");
    }
    for (auto* r : {&s, &t}) {
      const auto offs = r->seq_offsets();
      bool ok = offs.front() == 0 && offs.back() == r->header().tokens && std::is_sorted(offs.begin(), offs.end());
      if (!ok) throw InputError(r->header().path + ": seq_offsets must rise from 0 to T = " + std::to_string(r->header().tokens));
    }
    const auto pos_s = s.positions(), pos_t = t.positions();
    if (pos_s != pos_t) {
      size_t i = std::mismatch(pos_s.begin(), pos_s.end(), pos_t.begin()).first - pos_s.begin();
      throw InputError(p.target_path + ": positions differ from " + p.source_path + " at token " + std::to_string(i) +
                       " (" + std::to_string(pos_t[i]) + " vs " + std::to_string(pos_s[i]) +
                       "; both models must see each token at the same position)");
    }
    Sha256 h;
    h.update(ids_s.data(), ids_s.size() * sizeof(int32_t));
    h.update(pos_s.data(), pos_s.size() * sizeof(int32_t));
    h.update(pos_t.data(), pos_t.size() * sizeof(int32_t));
    p.fingerprint = h.hex();
    if (auto [it, fresh] = fingerprints.emplace(p.fingerprint, p.source_path); !fresh)
      throw InputError(p.source_path + ": the same token_ids and positions as " + it->second +
                       " (the same data under two names: its tokens would be counted twice); remove one");
    p.rows = hs.tokens;
    const int64_t available = (p.rows + cfg.calibration.token_stride - 1) / cfg.calibration.token_stride;
    p.used = std::min(available, budget);
    budget -= p.used;
    cal.tokens_used += p.used;
  }
}

// The pair whose first block gives the provisional shift: the one the checkpoint's stored moments were taken about
// while it is still in both stores (so that shards added later, in a domain that sorts first, do not change the
// shift and force every stored domain to be read again), else the store's first pair over every domain, when usable.
void choose_shift_shard(const FitConfig& cfg, const Listed& listed, Calibration& cal, bool fresh) {
  cal.shift_shard = cal.shards.front();
  // Takes pair r for the shift when both sides are there and fit the calibration's shapes.
  auto take = [&](const std::string& r) {
    if (!listed.target.count(r) || shard_domain(r).empty()) return false;
    if (r == cal.shift_shard.rel) return true;
    try {
      ShardReader s((fs::path(cfg.source.store) / r).string()), t((fs::path(cfg.target.store) / r).string());
      if (!(s.header().spec == cal.source && t.header().spec == cal.target && s.header().tokens > 0 &&
            s.header().tokens == t.header().tokens))
        return false;
      cal.shift_shard.rel = r;
      cal.shift_shard.domain = shard_domain(r);
      cal.shift_shard.source_path = s.header().path;
      cal.shift_shard.target_path = t.header().path;
      cal.shift_shard.rows = s.header().tokens;
      cal.shift_shard.used = (s.header().tokens + cfg.calibration.token_stride - 1) / cfg.calibration.token_stride;
      return true;
    } catch (const UserError&) {
      return false;  // not usable for the shift
    }
  };
  const std::string kept = fresh ? "" : kept_shift_shard(checkpoint_path(cfg));
  if (!kept.empty() && std::find(listed.source.begin(), listed.source.end(), kept) != listed.source.end() &&
      take(kept))
    return;
  for (const auto& r : listed.source)  // the store's first pair, else the first selected shard (set above)
    if (listed.target.count(r) && !shard_domain(r).empty()) {
      take(r);
      return;
    }
}

// What the config asks of the shapes the shards have.
void check_fit_against_shapes(const FitConfig& cfg, const Calibration& cal) {
  if (cal.tokens_used < 2) throw InputError("calibration: fewer than 2 tokens selected (check max_tokens and the shards)");
  const bool per_head = has_structure(cfg.fit.structures, Structure::per_head);
  if (per_head && cal.source.n_kv_heads != cal.target.n_kv_heads)
    throw ConfigError(cfg.config_path + ": fit.structure: per_head needs equal KV head counts (source " +
                      std::to_string(cal.source.n_kv_heads) + ", target " + std::to_string(cal.target.n_kv_heads) +
                      "): head matching is undefined between them; use structure: cross_head with probe: all_heads");
  if (cfg.fit.probe == ProbeMode::same_head && cal.source.n_kv_heads != cal.target.n_kv_heads)
    throw ConfigError(cfg.config_path + ": fit.probe: same_head needs equal KV head counts (source " +
                      std::to_string(cal.source.n_kv_heads) + ", target " + std::to_string(cal.target.n_kv_heads) +
                      "); use probe: all_heads");
  const bool has_all = std::any_of(cfg.fit.ks.begin(), cfg.fit.ks.end(), [](const KChoice& k) { return k.is_all(); });
  if (!cfg.calibration.weights.empty() && cfg.calibration.max_tokens)
    throw ConfigError(cfg.config_path + ": calibration.weights cannot be combined with max_tokens");
  for (const auto& k : cfg.fit.ks)
    if (has_all && k.value == cal.source.n_layers)
      throw ConfigError(cfg.config_path + ": fit.k: k = " + k.label() + " and k = all are the same fit for a " +
                        std::to_string(cal.source.n_layers) + "-layer source; list one of them");
  for (const auto& k : cfg.fit.ks)
    if (!k.is_all() && k.value > cal.source.n_layers)
      throw ConfigError(cfg.config_path + ": fit.k: k = " + k.label() + " exceeds the source's " +
                        std::to_string(cal.source.n_layers) + " layers");
}

}  // namespace

Calibration validate(const FitConfig& cfg, bool fresh) {
  Calibration cal;
  cal.cfg = cfg;
  check_output_writable(cfg.output.dir);
  check_artifact_names(cfg);
  check_checkpoint_dir(cfg);
  check_output_outside_stores(cfg);
  const Listed listed = pair_shards(cfg, cal);
  read_pairs(cfg, cal);
  choose_shift_shard(cfg, listed, cal, fresh);
  check_fit_against_shapes(cfg, cal);
  return cal;
}

}  // namespace crosskv
