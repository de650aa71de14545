#include "fit/stream.hpp"

#include <array>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/sealed_file.hpp"
#include "core/backend.hpp"
#include "core/host_kernels.hpp"
#include "core/comm.hpp"
#include "core/error.hpp"
#include "runtime/log.hpp"
#include "core/rope.hpp"
#include "core/sha256.hpp"
#include "io/shard.hpp"
#include "fit/checkpoint.hpp"
#include "fit/grid.hpp"
#include "fit/calibration.hpp"

namespace crosskv {
namespace {

// One dataset of one block as stored: fp32 in f32, bf16/fp16 bits in u16.
struct Stored {
  Dtype dtype = Dtype::f32;
  std::vector<float> f32;
  std::vector<uint16_t> u16;
  int64_t cols = 0;
  ComputeBackend::StoredBlock block(int64_t rows) const {
    using S = Dtype;
    const S t = dtype == Dtype::f32 ? S::f32 : dtype == Dtype::f16 ? S::f16 : S::bf16;
    return {dtype == Dtype::f32 ? static_cast<const void*>(f32.data()) : u16.data(), t, rows, cols};
  }
  ComputeBackend::HostSpan span() const {
    return dtype == Dtype::f32 ? ComputeBackend::floats(f32.data(), static_cast<int64_t>(f32.size()))
                                     : ComputeBackend::HostSpan{u16.data(), static_cast<int64_t>(u16.size() * 2)};
  }
};

// A block of rows: stored keys and values of both sides and their positions; on a host backend also the moments'
// inputs of each kind (fp32, keys RoPE-stripped, shifted), prepared by the reader thread.
struct Block {
  int64_t rows = 0;
  Stored sk, sv, tk, tv;
  std::vector<int32_t> spos, tpos;
  std::array<std::vector<float>, kAllKinds.size()> x, y;  // by kind_index
  std::vector<float> sqrt_w;  // fit.weighting: dataset: sqrt of the target's per-token weights
  double weight_sum = 0;
  RowWeights weights() const { return sqrt_w.empty() ? RowWeights{} : RowWeights{sqrt_w.data(), weight_sum}; }
  const Stored& source(Kind k) const { return k == Kind::v ? sv : sk; }
  const Stored& target(Kind k) const { return k == Kind::v ? tv : tk; }
};

struct ShardPairReader {
  const ShardPair* pair;
  ShardReader source, target;
};

// Non-finite values are found on the stored bits (an all-ones exponent), before any conversion.
template <class U>
int64_t first_nonfinite(const U* v, int64_t n, U exponent) {
  U any = 0;
  for (int64_t i = 0; i < n; ++i) any |= static_cast<U>(((v[i] & exponent) == exponent) ? 1 : 0);
  if (!any) return -1;
  for (int64_t i = 0; i < n; ++i)
    if ((v[i] & exponent) == exponent) return i;
  return -1;
}

void check_finite(const Stored& s, int64_t rows, int64_t per_layer, const std::string& path, const char* dataset,
                  int64_t t0, int64_t stride) {
  int64_t i;
  bool nan;
  if (s.dtype == Dtype::f32) {
    const auto* u = reinterpret_cast<const uint32_t*>(s.f32.data());
    i = first_nonfinite<uint32_t>(u, static_cast<int64_t>(s.f32.size()), 0x7f800000u);
    nan = i >= 0 && (u[i] & 0x007fffffu) != 0;
  } else {
    const uint16_t exponent = s.dtype == Dtype::bf16 ? 0x7f80 : 0x7c00;
    i = first_nonfinite<uint16_t>(s.u16.data(), static_cast<int64_t>(s.u16.size()), exponent);
    nan = i >= 0 && (s.u16[i] & static_cast<uint16_t>(~exponent & 0x7fff)) != 0;
  }
  if (i < 0) return;
  const int64_t t = i / s.cols, layer = (i % s.cols) / per_layer;
  throw InputError(path + ": dataset '" + dataset + "' has " + (nan ? "NaN" : "Inf") + " at layer " +
                   std::to_string(layer) + ", token " + std::to_string(t0 + t * stride));
}

// The shifts each kind's inputs are prepared about (by kind_index); null: unshifted (the shifts' own read).
struct InputShifts {
  std::array<const float*, kAllKinds.size()> x{}, y{};
};

// Reads rows j0 .. j0+rows-1 of the strided token sequence of one shard pair as stored, and with `weighted` the
// target's token weights; with `host`, also prepares the inputs of `kinds` on the host.
void read_block(ShardPairReader& r, const Rope& rs, const Rope& rt, const Calibration& cal, int64_t j0, int64_t rows,
                const std::vector<Kind>& kinds, bool weighted, const InputShifts* host, Block& b) {
  const int64_t stride = cal.cfg.calibration.token_stride, t0 = j0 * stride;
  const PairDims d = cal.dims();
  b.rows = rows;
  auto side = [&](ShardReader& sr, int64_t per_layer, int layers, Stored& k, Stored& v, std::vector<int32_t>& pos) {
    const std::string& path = sr.header().path;
    k.cols = v.cols = layers * per_layer;
    k.dtype = sr.read_stored("keys", t0, rows, stride, k.f32, k.u16);
    check_finite(k, rows, per_layer, path, "keys", t0, stride);
    v.dtype = sr.read_stored("values", t0, rows, stride, v.f32, v.u16);
    check_finite(v, rows, per_layer, path, "values", t0, stride);
    pos.resize(rows);
    sr.read_positions(t0, rows, stride, pos.data());
  };
  side(r.source, d.F(), d.Ls, b.sk, b.sv, b.spos);
  side(r.target, d.G(), d.Lt, b.tk, b.tv, b.tpos);
  b.sqrt_w.clear();
  b.weight_sum = 0;
  if (weighted) {
    b.sqrt_w.resize(static_cast<size_t>(rows));
    r.target.read_weights(t0, rows, stride, b.sqrt_w.data());
    for (float& w : b.sqrt_w) {  // read_weights refused negative and non-finite ones
      b.weight_sum += w;
      w = std::sqrt(w);
    }
  }
  if (!host) return;
  const float* scale = b.sqrt_w.empty() ? nullptr : b.sqrt_w.data();
  const ComputeBackend::Strip ss{&rs, b.spos.data()}, st{&rt, b.tpos.data()};
  for (Kind kind : kinds) {
    const size_t i = kind_index(kind);
    const bool strip = strips_rope(kind);
    prepare_on_host(b.source(kind).block(rows), strip ? &ss : nullptr, host->x[i], scale, b.x[i]);
    prepare_on_host(b.target(kind).block(rows), strip ? &st : nullptr, host->y[i], scale, b.y[i]);
  }
}

// One producer thread reads blocks ahead; the consumer folds them in. HDF5 is only ever called from the producer.
// Two blocks exist (double buffering: one folded in while the next is read), recycled from round to round so that
// their buffers are not allocated (and page-faulted) again.
class BlockQueue {
 public:
  static constexpr int kBlocks = 2;
  void push(std::optional<Block> b) {
    std::unique_lock<std::mutex> l(m_);
    cv_.wait(l, [&] { return q_.size() < 2; });
    q_.push_back(std::move(b));
    cv_.notify_all();
  }
  std::optional<Block> pop() {
    std::unique_lock<std::mutex> l(m_);
    cv_.wait(l, [&] { return !q_.empty(); });
    auto b = std::move(q_.front());
    q_.pop_front();
    cv_.notify_all();
    return b;
  }
  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> l(m_);
    error_ = e;
    q_.push_back(std::nullopt);
    cv_.notify_all();
  }
  std::exception_ptr error() {
    std::lock_guard<std::mutex> l(m_);
    return error_;
  }
  void recycle(Block&& b) {
    std::lock_guard<std::mutex> l(m_);
    free_.push_back(std::move(b));
    cv_.notify_all();
  }
  // A block to read into: a recycled one, or a new one while fewer than kBlocks exist; else waits for the consumer
  // to recycle one. Empty once the round is abandoned.
  std::optional<Block> take_free() {
    std::unique_lock<std::mutex> l(m_);
    cv_.wait(l, [&] { return abandoned_ || !free_.empty() || made_ < kBlocks; });
    if (abandoned_) return std::nullopt;
    if (free_.empty()) {
      ++made_;
      return Block{};
    }
    Block b = std::move(free_.back());
    free_.pop_back();
    return b;
  }
  // For the next round: the recycled blocks are kept (blocks dropped by an abandoned round are made anew).
  void next_round() {
    std::lock_guard<std::mutex> l(m_);
    q_.clear();
    error_ = nullptr;
    abandoned_ = false;
    made_ = static_cast<int>(free_.size());
  }
  void abandon() {
    std::lock_guard<std::mutex> l(m_);
    abandoned_ = true;
    q_.clear();
    cv_.notify_all();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::optional<Block>> q_;
  std::vector<Block> free_;
  int made_ = 0;
  std::exception_ptr error_;
  bool abandoned_ = false;
};

std::vector<float> column_means(const std::vector<float>& v, int64_t rows, int64_t cols) {
  std::vector<double> s(cols, 0.0);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < cols; ++c) s[c] += v[t * cols + c];
  std::vector<float> m(cols);
  for (int64_t c = 0; c < cols; ++c) m[c] = static_cast<float>(s[c] / rows);
  return m;
}

}  // namespace

Shifts compute_shifts(const Calibration& cal) {
  const ShardPair& p = cal.shift_shard;
  ShardPairReader r{&p, ShardReader(p.source_path), ShardReader(p.target_path)};
  Rope rs(cal.source, p.source_path), rt(cal.target, p.target_path);
  const int64_t rows = std::min<int64_t>(cal.cfg.runtime.block_tokens, p.used);
  Block b;
  const InputShifts none{};
  // Any shift serves; this one does not depend on the weighting (or need the shift shard to carry weights).
  const std::vector<Kind> kinds(kAllKinds.begin(), kAllKinds.end());
  read_block(r, rs, rt, cal, 0, rows, kinds, /*weighted=*/false, &none, b);
  const PairDims d = cal.dims();
  Shifts s;
  for (Kind kind : kAllKinds) {
    const size_t i = kind_index(kind);
    s[kind] = {column_means(b.x[i], rows, d.X()), column_means(b.y[i], rows, d.Y())};
  }
  return s;
}

namespace {

namespace fs = std::filesystem;

// shifts.bin: a sealed file (core/sealed_file.hpp) of the shift shard's identity; its payload is each kind's source
// and target shifts (fp32), in kAllKinds order.
SealId shift_seal(const Calibration& cal) {
  const ShardPair& p = cal.shift_shard;
  return {"crosskv-shifts", 2,
          {{"shard", p.rel}, {"source", p.source_path}, {"target", p.target_path}, {"used", p.used},
           {"stamps", {file_stamp(p.source_path), file_stamp(p.target_path)}}, {"block_tokens", cal.cfg.runtime.block_tokens},
           {"token_stride", cal.cfg.calibration.token_stride}}};
}

std::string shifts_file(const std::string& ckpt_dir) { return (fs::path(ckpt_dir) / "shifts.bin").string(); }

// The shifts in `path` when it holds those of this shard, whole; nullopt otherwise (missing, another shard, damaged).
std::optional<Shifts> read_kept_shifts(const std::string& path, const SealId& id, const PairDims& d) {
  SealedReader in(path, id);
  if (!in.ok()) return std::nullopt;
  Shifts s;
  for (Shift& k : s.by_kind)
    for (auto [v, size] : {std::pair{&k.x, d.X()}, std::pair{&k.y, d.Y()}}) {
      v->resize(static_cast<size_t>(size));
      if (!in.read(v->data(), v->size() * sizeof(float))) return std::nullopt;
    }
  if (const std::string why = in.finish(); !why.empty()) {
    spdlog::warn("{}: {}; the shifts are computed again", path, why);
    return std::nullopt;
  }
  return s;
}

void keep_shifts(const std::string& path, const SealId& id, const Shifts& s) {
  SealedWriter f(path, id);
  for (const Shift& k : s.by_kind)
    for (const auto* v : {&k.x, &k.y}) f.write(v->data(), v->size() * sizeof(float));
  f.commit();
}

}  // namespace

std::string kept_shift_shard(const std::string& ckpt_dir) {
  const nlohmann::json h = read_seal(shifts_file(ckpt_dir));
  const nlohmann::json id = h.is_object() ? h["identity"] : nlohmann::json();
  return id.is_object() && id.contains("shard") && id["shard"].is_string() ? id["shard"].get<std::string>() : "";
}

Shifts provisional_shifts(const Calibration& cal, const std::string& ckpt_dir, bool writer, bool fresh) {
  const std::string path = shifts_file(ckpt_dir);
  const SealId id = shift_seal(cal);
  if (auto kept = fresh ? std::nullopt : read_kept_shifts(path, id, cal.dims())) return *kept;
  Shifts s = compute_shifts(cal);
  if (writer) {
    std::error_code ec;
    fs::create_directories(ckpt_dir, ec);
    try {
      keep_shifts(path, id, s);
    } catch (const std::exception& e) {  // the fit goes on; a refit then reads the shift shard again
      spdlog::warn("could not keep the provisional shifts in {}: {}", path, e.what());
    }
  }
  return s;
}

Comm& Context::readers() const { return grid ? *grid->readers : comm; }

ShardSchedule::ShardSchedule(const Calibration& cal, int readers, int reader)
    : cal_(cal), readers_(readers), reader_(reader),
      per_round_(int64_t{readers} * cal.cfg.runtime.checkpoint.every_shards) {}

int64_t ShardSchedule::rounds() const {
  return (static_cast<int64_t>(cal_.shards.size()) + per_round_ - 1) / per_round_;
}

std::vector<const ShardPair*> ShardSchedule::shards(int64_t round) const {
  std::vector<const ShardPair*> out;
  const int64_t end = std::min<int64_t>((round + 1) * per_round_, static_cast<int64_t>(cal_.shards.size()));
  for (int64_t i = round * per_round_; i < end; ++i)
    if (mine(static_cast<size_t>(i)) && cal_.shards[i].used > 0) out.push_back(&cal_.shards[i]);
  return out;
}

int64_t ShardSchedule::tokens(int64_t start_round, bool mine_only) const {
  int64_t n = 0;
  for (size_t i = static_cast<size_t>(start_round * per_round_); i < cal_.shards.size(); ++i)
    if (!mine_only || mine(i)) n += cal_.shards[i].used;
  return n;
}

namespace {

// The kinds a pass accumulates, each into its moments, about their shifts.
struct KindTable {
  std::vector<Kind> kinds;
  std::array<Moments*, kAllKinds.size()> into{};
  InputShifts shifts;
  explicit KindTable(const PassMoments& m) {
    for (Kind kind : kAllKinds)
      if (Moments* mk = m.of(kind)) {
        kinds.push_back(kind);
        into[kind_index(kind)] = mk;
        shifts.x[kind_index(kind)] = mk->shift_x().data();
        shifts.y[kind_index(kind)] = mk->shift_y().data();
      }
  }
};

// Folds a block of every kind into its moments. A device backend converts, strips RoPE and shifts on the device
// (half the bytes to copy, no host arithmetic); otherwise the reader thread prepared the inputs.
void fold_block(ComputeBackend& be, const KindTable& t, const Rope& rs, const Rope& rt, const PairDims& d, Block& b) {
  const bool on_device = be.prepares_on_device();
  be.begin_inputs();
  const int64_t n = b.rows;
  const RowWeights w = b.weights();
  if (w.sqrt_w) be.stage_inputs({ComputeBackend::floats(w.sqrt_w, n)});
  if (on_device)
    be.stage_inputs({b.sk.span(), b.sv.span(), b.tk.span(), b.tv.span(), {b.spos.data(), n * 4},
                     {b.tpos.data(), n * 4}});
  const ComputeBackend::Strip ss{&rs, b.spos.data()}, tt{&rt, b.tpos.data()};
  for (Kind kind : t.kinds) {
    const size_t i = kind_index(kind);
    const float *x = b.x[i].data(), *y = b.y[i].data();
    if (on_device) {
      const bool strip = strips_rope(kind);
      x = be.prepare(b.source(kind).block(n), strip ? &ss : nullptr, t.shifts.x[i], w.sqrt_w, b.x[i]);
      y = be.prepare(b.target(kind).block(n), strip ? &tt : nullptr, t.shifts.y[i], w.sqrt_w, b.y[i]);
    } else {
      be.stage_inputs({ComputeBackend::floats(x, n * d.X()), ComputeBackend::floats(y, n * d.Y())});
    }
    t.into[i]->accumulate_staged(be, x, y, n, w);
  }
}

// One round: a producer thread reads the blocks of `shards` ahead (HDF5 is only ever called there), and `consume`
// folds each in on this thread. Returns false when a stop signal abandoned the round.
bool read_round(const Calibration& cal, const std::vector<const ShardPair*>& shards, const Rope& rs, const Rope& rt,
                const KindTable& t, const InputShifts* host_shifts, const StopFlag& stop, BlockQueue& queue,
                const std::function<void(Block&)>& consume) {
  const bool weighted = cal.cfg.fit.weighting == Weighting::dataset;
  const int64_t B = cal.cfg.runtime.block_tokens;
  queue.next_round();
  std::thread producer([&] {
    try {
      for (const ShardPair* p : shards) {
        ShardPairReader r{p, ShardReader(p->source_path), ShardReader(p->target_path)};
        for (int64_t j = 0; j < p->used; j += B) {
          std::optional<Block> b = queue.take_free();
          if (!b) return;
          read_block(r, rs, rt, cal, j, std::min(B, p->used - j), t.kinds, weighted, host_shifts, *b);
          queue.push(std::move(b));
        }
      }
      queue.push(std::nullopt);
    } catch (...) {
      queue.fail(std::current_exception());
    }
  });
  bool abandoned = false;
  try {
    while (auto b = queue.pop()) {
      consume(*b);
      queue.recycle(std::move(*b));
      if (stop.requested()) {
        abandoned = true;
        break;
      }
    }
  } catch (...) {
    queue.abandon();
    producer.join();
    throw;
  }
  if (abandoned) queue.abandon();
  producer.join();
  if (!abandoned)
    if (auto e = queue.error()) std::rethrow_exception(e);
  return !abandoned;
}

}  // namespace

PassStats stream_pass(const Calibration& cal, Context& ctx, const PassMoments& m, const std::string& label,
                      int64_t start_round, const RoundHook& on_round) {
  const ShardSchedule schedule(cal, ctx.readers().size(), ctx.readers().rank());
  const int64_t rounds = schedule.rounds(), todo = schedule.my_tokens(start_round),
                job_todo = schedule.job_tokens(start_round);
  const PairDims d = cal.dims();
  const double bytes_per_token = 2.0 * (d.X() * 4 + d.Y() * 4);  // fp32 equivalent of K and V, both sides
  Progress progress(label, job_todo, bytes_per_token);
  const Rope rs(cal.source, "source kv_spec"), rt(cal.target, "target kv_spec");
  const KindTable table(m);
  const InputShifts* host_shifts = ctx.backend.prepares_on_device() ? nullptr : &table.shifts;
  PassStats st;
  BlockQueue queue;
  for (int64_t round = start_round; round < rounds; ++round) {
    const bool whole = read_round(cal, schedule.shards(round), rs, rt, table, host_shifts, ctx.stop, queue,
                                  [&](Block& b) {
                                    fold_block(ctx.backend, table, rs, rt, d, b);
                                    // Job-wide progress, estimated from this rank's share.
                                    progress.add(todo > 0 ? b.rows * job_todo / todo : b.rows);
                                    st.tokens += b.rows;
                                  });
    if (on_round) on_round(round, rounds, !whole);
  }
  progress.finish();
  st.seconds = progress.seconds();
  st.bytes = st.tokens * bytes_per_token;
  return st;
}

}  // namespace crosskv
