#include "eval/held_out.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <numeric>
#include <optional>

#include "eval/layer_diagnostics.hpp"
#include "eval/report.hpp"
#include "serve/serving_mapper.hpp"
#include "core/backend.hpp"
#include "core/bytes.hpp"
#include "core/comm.hpp"
#include "runtime/log.hpp"
#include "core/rope.hpp"
#include "core/threads.hpp"
#include "core/atomic_file.hpp"
#include "artifact/mapper.hpp"
#include "io/shard.hpp"

namespace fs = std::filesystem;

namespace crosskv {

nlohmann::json MapperEvaluation::json() const {
  nlohmann::json j = evaluation.json();
  j["mapper"] = dir;
  return j;
}

namespace {

// One model's held-out shards, opened and checked against each other; read a layer at a time.
struct HeldOutSide {
  std::vector<std::unique_ptr<ShardReader>> shards;
  std::vector<int64_t> first_token;  // of each shard in the concatenation
  std::string name;                  // the shard paths, for messages
  KvSpec spec;
  bool queries = false;
  int64_t tokens = 0;
  std::vector<int32_t> positions;
  std::vector<int64_t> seq_offsets;  // [S+1] over the concatenation

  // Layer `l` of `dataset` of every token, [tokens x heads*head_dim].
  std::vector<float> layer(const std::string& dataset, int l, int64_t width) const {
    std::vector<float> out(tokens * width);
    std::vector<uint16_t> raw;
    for (size_t i = 0; i < shards.size(); ++i) shards[i]->read_layer(dataset, l, out.data() + first_token[i] * width, raw);
    return out;
  }
};

HeldOutSide open_side(const std::vector<std::string>& paths, bool want_queries) {
  CROSSKV_ASSERT(!paths.empty(), "no held-out shards");
  HeldOutSide s;
  s.seq_offsets = {0};
  for (size_t i = 0; i < paths.size(); ++i) {
    auto r = std::make_unique<ShardReader>(paths[i]);
    const ShardHeader& h = r->header();
    const bool q = want_queries && h.has_queries;
    if (i == 0) {
      s.spec = h.spec, s.queries = q, s.name = paths[0];
    } else {
      if (h.spec != s.spec) throw InputError(paths[i] + ": kv_spec differs from " + paths[0]);
      if (q != s.queries)
        throw InputError(paths[i] + ": has " + (q ? "" : "no ") + "queries, unlike " + paths[0]);
      s.name += ", " + paths[i];
    }
    const auto pos = r->positions();
    const auto offs = r->seq_offsets();
    s.positions.insert(s.positions.end(), pos.begin(), pos.end());
    for (size_t j = 1; j < offs.size(); ++j) s.seq_offsets.push_back(s.tokens + offs[j]);
    s.first_token.push_back(s.tokens);
    s.tokens += h.tokens;
    s.shards.push_back(std::move(r));
  }
  return s;
}

// A source layer in content space (keys RoPE-stripped) with its mean over the held-out tokens (the mean-only
// baseline's input), resident while some target layer still selects it.
struct SourceLayer {
  std::vector<float> keys, values;
  std::vector<float> mean_keys, mean_values;
  int uses = 0;
};

// Per-layer figures as bytes (exact doubles, NaN kept) for gathering over ranks (core/bytes.hpp).
template <class D, class IO>
void diagnostics_fields(D& d, IO& io) {
  io.template as<int32_t>(d.layer);
  io(d.r2_k, d.r2_v, d.cosine, d.k_concentration, d.v_concentration);
  io(d.r2_k_mean, d.r2_v_mean, d.cosine_mean, d.k_concentration_mean, d.v_concentration_mean);
}

// What one target layer's evaluation of one mapper reduces, by name: the mapper's figures and its baselines'. Its
// bytes carry whether ridge alone is there, so no reader decodes records by their position.
struct LayerFigures {
  LayerDiagnostics mapper, no_target_rope, mean_only;
  std::optional<LayerDiagnostics> ridge_only;  // a mapper with residual MLPs: the same without them

  template <class F, class IO>
  static void fields(F& f, IO& io) {
    for (auto* d : {&f.mapper, &f.no_target_rope, &f.mean_only}) diagnostics_fields(*d, io);
    io.optional(f.ridge_only, [&](auto& d) { diagnostics_fields(d, io); });
  }
  void put(ByteWriter& out) const { fields(*this, out); }
  static LayerFigures get(ByteReader& in) {
    LayerFigures f;
    fields(f, in);
    return f;
  }
};

// A mapper's layer l input: its selected source layers side by side, [T x k*F] per kind, and their means [k*F].
void gather_sources(const std::vector<int>& selected, const std::map<int, SourceLayer>& src, int64_t T, int64_t F,
                    std::vector<float>& xk, std::vector<float>& xv, std::vector<float>& mk, std::vector<float>& mv) {
  const int64_t K = static_cast<int64_t>(selected.size()) * F;
  xk.resize(T * K), xv.resize(T * K), mk.resize(K), mv.resize(K);
  for (size_t j = 0; j < selected.size(); ++j) {
    const SourceLayer& s = src.at(selected[j]);
    for (int64_t t = 0; t < T; ++t) {
      std::copy_n(s.keys.data() + t * F, F, xk.data() + t * K + static_cast<int64_t>(j) * F);
      std::copy_n(s.values.data() + t * F, F, xv.data() + t * K + static_cast<int64_t>(j) * F);
    }
    std::copy(s.mean_keys.begin(), s.mean_keys.end(), mk.begin() + static_cast<int64_t>(j) * F);
    std::copy(s.mean_values.begin(), s.mean_values.end(), mv.begin() + static_cast<int64_t>(j) * F);
  }
}

}  // namespace

EvalCost eval_cost(const KvSpec& source, const KvSpec& target, int64_t tokens, const std::vector<int64_t>& seq_offsets,
                   bool queries, int mappers, int ranks) {
  EvalCost c;
  c.tokens = tokens;
  c.layers_per_rank = (target.n_layers + ranks - 1) / ranks;
  const LayerDiagnosticsCost lc = layer_diagnostics_cost(target, tokens, seq_offsets, queries);
  const int64_t F = source.features_per_layer(), G = target.features_per_layer();
  const int64_t layer_bytes = int64_t{4} * tokens * (2 * G + (queries ? int64_t{target.n_q_heads} * target.head_dim : 0));
  const int64_t source_bytes = int64_t{4} * 2 * tokens * F * source.n_layers;  // every source layer selected
  const int64_t prediction_bytes = int64_t{4} * tokens * (4 * G + 4 * F * source.n_layers);  // ck, cv, pk, gathered X
  c.peak_bytes = layer_bytes + lc.scratch_bytes + source_bytes + prediction_bytes;
  const double map_flops = 2.0 * 2.0 * static_cast<double>(tokens) * F * source.n_layers * G;  // at most, k = all
  c.flops = static_cast<double>(c.layers_per_rank) * (lc.truth_flops + mappers * (3 * lc.prediction_flops + map_flops));
  return c;
}

EvalCost held_out_cost(const HeldOut& data, const KvSpec& source, const KvSpec& target, int mappers, int ranks) {
  const HeldOutSide t = open_side(data.target_shards, true);
  return eval_cost(source, target, t.tokens, t.seq_offsets, t.queries, mappers, ranks);
}

std::string EvalCost::text() const {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%lld held-out tokens, %lld target layer(s) per rank, at most %s in memory, %.3g GFLOP",
                static_cast<long long>(tokens), static_cast<long long>(layers_per_rank), human_bytes(peak_bytes).c_str(),
                flops / 1e9);
  return buf;
}

namespace {

// The held-out shards of both sides and the mappers, opened and checked against each other.
struct EvalInputs {
  HeldOutSide src, tgt;
  std::vector<MapperManifest> mappers;
};

std::shared_ptr<EvalInputs> open_eval_inputs(const std::vector<std::string>& dirs, const HeldOut& data) {
  auto inputs = std::make_shared<EvalInputs>();
  inputs->src = open_side(data.source_shards, false);
  inputs->tgt = open_side(data.target_shards, true);
  for (const auto& dir : dirs) {
    MapperManifest m = read_mapper_manifest(dir);
    Rope(m.source, m.path + " (source.kv_spec)");
    Rope(m.target, m.path + " (target.kv_spec)");
    check_kv_spec(m, true, inputs->src.spec, inputs->src.name);
    check_kv_spec(m, false, inputs->tgt.spec, inputs->tgt.name);
    inputs->mappers.push_back(std::move(m));
  }
  const HeldOutSide &s = inputs->src, &t = inputs->tgt;
  if (s.tokens != t.tokens || s.seq_offsets != t.seq_offsets)
    throw InputError(t.name + ": holds other tokens than " + s.name + " (" + std::to_string(t.tokens) + " vs " +
                     std::to_string(s.tokens) + ", or other sequences)");
  return inputs;
}

// The diagnostics of this rank's target layers, for every mapper, as bytes in layer order: per layer and mapper, its
// LayerFigures.
class LayerEvaluator {
 public:
  LayerEvaluator(const EvalInputs& in, ComputeBackend& be, bool verify)
      : in_(in), be_(be), verify_(verify), S_(in.src.spec), Tg_(in.tgt.spec), T_(in.tgt.tokens),
        F_(S_.features_per_layer()), G_(Tg_.features_per_layer()), src_rope_(S_), tgt_rope_(Tg_), yk_(G_), yv_(G_) {}

  std::string run(const std::vector<int>& mine, int ranks) {
    for (int l : mine)
      for (const auto& m : in_.mappers)
        for (int a : m.layers.at(l).source_layers) ++resident_[a].uses;
    // On a host backend BLAS runs on one thread and the diagnostics spread their units over OpenMP's threads.
    std::optional<SingleThreadedBlas> one_thread;
    if (be_.concurrent_calls()) one_thread.emplace();
    Progress progress(ranks > 1 ? "eval (this rank's layers)" : "eval", static_cast<int64_t>(mine.size()) * T_, 0);
    for (int l : mine) {
      const HeldOutSide& tgt = in_.tgt;
      LayerTruth truth;
      truth.layer = l, truth.spec = Tg_, truth.tokens = T_;
      truth.positions = tgt.positions.data(), truth.seq_offsets = tgt.seq_offsets.data();
      truth.sequences = static_cast<int64_t>(tgt.seq_offsets.size()) - 1;
      truth.keys = tgt.layer("keys", l, G_);
      truth.values = tgt.layer("values", l, G_);
      if (tgt.queries) truth.queries = tgt.layer("queries", l, int64_t{Tg_.n_q_heads} * Tg_.head_dim);
      LayerDiagnoser dg(be_, truth);
      for (const auto& m : in_.mappers) diagnose(m, l, dg);
      progress.add(T_);
    }
    progress.finish();
    return std::move(out_.bytes());
  }

 private:
  // The source layers a mapper's layer reads, in content space with their means (kept while some layer needs them).
  void load_sources(const std::vector<int>& selected) {
    for (int a : selected) {
      SourceLayer& s = resident_[a];
      if (!s.keys.empty()) continue;
      s.keys = in_.src.layer("keys", a, F_);
      s.values = in_.src.layer("values", a, F_);
      src_rope_.strip_block(s.keys.data(), T_, src_rope_.one(a), in_.src.positions.data());
      s.mean_keys.assign(F_, 0.0f), s.mean_values.assign(F_, 0.0f);
      for (int64_t t = 0; t < T_; ++t)
        for (int64_t c = 0; c < F_; ++c) {
          s.mean_keys[c] += s.keys[t * F_ + c] / static_cast<float>(T_);
          s.mean_values[c] += s.values[t * F_ + c] / static_cast<float>(T_);
        }
    }
  }

  // One mapper's target layer l: the mapper, without the target RoPE, mean-only, and ridge alone (with MLPs). The
  // layer is applied by the one apply (serve/serving_mapper), on its gathered source layers.
  void diagnose(const MapperManifest& m, int l, LayerDiagnoser& dg) {
    std::vector<MapperLayer> one;
    one.push_back(load_mapper_layer(m, l, verify_));
    const std::vector<int> selected = one[0].source_layers;
    ServingMapper mapper(m, std::move(one), be_, {}, {l, 1});
    load_sources(selected);
    gather_sources(selected, resident_, T_, F_, xk_, xv_, mk_, mv_);
    ck_.resize(T_ * G_), cv_.resize(T_ * G_);
    auto map = [&](const std::vector<float>& xk, const std::vector<float>& xv, int64_t rows, float* yk, float* yv,
                   bool mlp) {
      ContentBatch c;
      c.keys = xk.data(), c.values = xv.data(), c.rows = rows, c.out_keys = yk, c.out_values = yv;
      c.layers = {l, 1}, c.gathered = true, c.residual_mlp = mlp;
      mapper.map_content_host(c);
    };
    const int32_t* pos = in_.tgt.positions.data();
    LayerFigures figures;
    if (m.residual_mlps()) {  // ridge alone first
      map(xk_, xv_, T_, ck_.data(), cv_.data(), false);
      pk_ = ck_;
      tgt_rope_.apply_block(pk_.data(), T_, tgt_rope_.one(l), pos);
      figures.ridge_only = dg.diagnose(pk_.data(), cv_.data());
    }
    map(xk_, xv_, T_, ck_.data(), cv_.data(), true);
    pk_ = ck_;
    tgt_rope_.apply_block(pk_.data(), T_, tgt_rope_.one(l), pos);
    figures.mapper = dg.diagnose(pk_.data(), cv_.data());
    figures.no_target_rope = dg.diagnose(ck_.data(), cv_.data());
    // Mean-only: layer l's mapping of the mean source content, for every token.
    map(mk_, mv_, 1, yk_.data(), yv_.data(), true);
    bk_.resize(T_ * G_), bv_.resize(T_ * G_);
    for (int64_t t = 0; t < T_; ++t) {
      std::copy(yk_.begin(), yk_.end(), bk_.begin() + t * G_);
      std::copy(yv_.begin(), yv_.end(), bv_.begin() + t * G_);
    }
    tgt_rope_.apply_block(bk_.data(), T_, tgt_rope_.one(l), pos);
    figures.mean_only = dg.diagnose(bk_.data(), bv_.data());
    figures.put(out_);
    for (int a : selected)
      if (--resident_[a].uses == 0) resident_.erase(a);
  }

  const EvalInputs& in_;
  ComputeBackend& be_;
  const bool verify_;
  const KvSpec &S_, &Tg_;
  const int64_t T_, F_, G_;
  const Rope src_rope_, tgt_rope_;
  std::map<int, SourceLayer> resident_;
  std::vector<float> xk_, xv_, ck_, cv_, mk_, mv_, pk_, yk_, yv_, bk_, bv_;
  ByteWriter out_;
};

// Every rank's layers (gathered), per mapper: the mapper's and the baselines' figures, summarized and judged.
std::vector<MapperEvaluation> summarize_evaluations(const std::vector<std::string>& dirs, const EvalInputs& in,
                                                    const std::vector<std::string>& all, int ranks,
                                                    const VerdictThresholds& th) {
  const int nm = static_cast<int>(dirs.size());
  const int64_t T = in.tgt.tokens;
  std::vector<std::vector<LayerFigures>> layers(nm);  // per mapper, its target layers' figures
  for (int r = 0; r < ranks; ++r) {
    ByteReader rd(all[r], "a rank's diagnostics");
    for (int l = r; l < in.tgt.spec.n_layers; l += ranks)
      for (int i = 0; i < nm; ++i) layers[i].push_back(LayerFigures::get(rd));
  }
  std::vector<MapperEvaluation> out;
  for (int i = 0; i < nm; ++i) {
    std::sort(layers[i].begin(), layers[i].end(),
              [](const LayerFigures& a, const LayerFigures& b) { return a.mapper.layer < b.mapper.layer; });
    auto column = [&](auto pick) {  // one figure of every layer, in layer order
      std::vector<LayerDiagnostics> c;
      for (const LayerFigures& f : layers[i]) c.push_back(pick(f));
      return summarize_layers(std::move(c), T, in.tgt.queries);
    };
    Evaluation ev;
    ev.mapper = column([](const LayerFigures& f) { return f.mapper; });
    ev.no_target_rope = column([](const LayerFigures& f) { return f.no_target_rope; });
    ev.mean_only = column([](const LayerFigures& f) { return f.mean_only; });
    if (in.mappers[i].residual_mlps()) ev.ridge_only = column([](const LayerFigures& f) { return f.ridge_only.value(); });
    judge(ev, th);
    const MapperManifest& m = in.mappers[i];
    out.push_back({dirs[i], m, m.source_model + " -> " + m.target_model, std::move(ev)});
  }
  return out;
}

}  // namespace

std::vector<MapperEvaluation> evaluate_mappers(const std::vector<std::string>& dirs, const HeldOut& data,
                                               ComputeBackend& be, Comm& comm, bool verify,
                                               const VerdictThresholds& th) {
  // Inputs opened and checked on every rank (the same files: the same errors, reported once).
  const auto in = agreed(comm, [&] { return open_eval_inputs(dirs, data); });
  const KvSpec &S = in->src.spec, &Tg = in->tgt.spec;
  const int P = comm.size(), rank = comm.rank(), nm = static_cast<int>(dirs.size());
  std::vector<int> mine;
  for (int l = rank; l < Tg.n_layers; l += P) mine.push_back(l);
  const EvalCost cost = eval_cost(S, Tg, in->tgt.tokens, in->tgt.seq_offsets, in->tgt.queries, nm, P);
  spdlog::info("eval: {} mapper(s) on {}; {}", nm, data.names, cost.text());
  // This rank's target layers, every mapper and baseline (no collectives inside: errors are agreed on after).
  const std::string mine_bytes = agreed(comm, [&] { return LayerEvaluator(*in, be, verify).run(mine, P); });
  return summarize_evaluations(dirs, *in, gather_strings(comm, mine_bytes), P, th);
}

std::string render_evaluation_report(const std::vector<MapperEvaluation>& evals, const std::string& held_out,
                                     const std::string& heatmap_path) {
  ReportInput in;
  in.eval_source = held_out;
  for (const auto& e : evals) {
    if (in.title.empty()) in.title = e.title;
    in.manifests.push_back(e.manifest);
    in.evaluations.push_back(e.evaluation);
  }
  std::ifstream svg(heatmap_path);
  if (svg) in.heatmap_svg.assign(std::istreambuf_iterator<char>(svg), std::istreambuf_iterator<char>());
  return render_report(in);
}

std::string evaluate_held_out(const HeldOut& data, const std::vector<std::string>& artifacts,
                              const std::string& output_dir, const std::string& heatmap_path, ComputeBackend& be,
                              Comm& comm, const VerdictThresholds& th) {
  const auto evals = evaluate_mappers(artifacts, data, be, comm, /*verify=*/false, th);
  if (comm.rank() != 0) return {};
  for (const auto& e : evals) {
    const std::string k = fs::path(e.dir).filename().string();
    nlohmann::json j = e.json();
    j["held_out_shards"] = data.names;
    write_file_atomic((fs::path(output_dir) / ("eval-" + k + ".json")).string(), j.dump(2) + "\n");
    spdlog::info("held-out {} ({} tokens): {}", k, e.evaluation.mapper.tokens, e.evaluation.verdict());
  }
  const std::string report = (fs::path(output_dir) / "report.html").string();
  write_file_atomic(report, render_evaluation_report(evals, data.names, heatmap_path));
  return report;
}

}  // namespace crosskv
