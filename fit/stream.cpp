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

#include "core/atomic_file.hpp"
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
// inputs (fp32, keys RoPE-stripped, shifted), prepared by the reader thread.
struct Block {
  int64_t rows = 0;
  Stored sk, sv, tk, tv;
  std::vector<int32_t> spos, tpos;
  std::vector<float> xk, xk_raw, xv, yk, yk_raw, yv;
  std::vector<float> sqrt_w;  // fit.weighting: dataset: sqrt of the target's per-token weights
  double weight_sum = 0;
  RowWeights weights() const { return sqrt_w.empty() ? RowWeights{} : RowWeights{sqrt_w.data(), weight_sum}; }
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

// Shifts of the moments being accumulated (null: unshifted, for computing the shifts themselves).
struct BlockShifts {
  const float *xk, *yk, *xk_raw, *yk_raw, *xv, *yv;
};

// Reads rows j0 .. j0+rows-1 of the strided token sequence of one shard pair as stored, and with `weighted` the
// target's token weights; with `host`, also prepares the moments' inputs on the host (raw keys only when want_raw).
void read_block(ShardPairReader& r, const Rope& rs, const Rope& rt, const Calibration& cal, int64_t j0, int64_t rows,
                bool want_raw, bool weighted, const BlockShifts* host, Block& b) {
  const int64_t stride = cal.cfg.token_stride, t0 = j0 * stride;
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
  prepare_on_host(b.sk.block(rows), &ss, host->xk, scale, b.xk);
  prepare_on_host(b.tk.block(rows), &st, host->yk, scale, b.yk);
  if (want_raw) {
    prepare_on_host(b.sk.block(rows), nullptr, host->xk_raw, scale, b.xk_raw);
    prepare_on_host(b.tk.block(rows), nullptr, host->yk_raw, scale, b.yk_raw);
  }
  prepare_on_host(b.sv.block(rows), nullptr, host->xv, scale, b.xv);
  prepare_on_host(b.tv.block(rows), nullptr, host->yv, scale, b.yv);
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
  const int64_t rows = std::min<int64_t>(cal.cfg.block_tokens, p.used);
  Block b;
  const BlockShifts none{};
  // Any shift serves; this one does not depend on the weighting (or need the shift shard to carry weights).
  read_block(r, rs, rt, cal, 0, rows, true, /*weighted=*/false, &none, b);
  const PairDims d = cal.dims();
  return {column_means(b.xk, rows, d.X()),     column_means(b.yk, rows, d.Y()), column_means(b.xk_raw, rows, d.X()),
          column_means(b.yk_raw, rows, d.Y()), column_means(b.xv, rows, d.X()), column_means(b.yv, rows, d.Y())};
}

namespace {

namespace fs = std::filesystem;

nlohmann::json shift_identity(const Calibration& cal) {
  const ShardPair& p = cal.shift_shard;
  return {{"format", "crosskv-shifts"}, {"version", 1}, {"shard", p.rel}, {"source", p.source_path},
          {"target", p.target_path}, {"used", p.used},
          {"stamps", {file_stamp(p.source_path), file_stamp(p.target_path)}}, {"block_tokens", cal.cfg.block_tokens},
          {"token_stride", cal.cfg.token_stride}};
}

// The six arrays in their file order.
template <class S>
auto parts_of(S& s) {
  return std::array{&s.xk, &s.yk, &s.xk_raw, &s.yk_raw, &s.xv, &s.yv};
}

// The shifts in `path` when it holds those of `id`, whole; nullopt otherwise (missing, another shard, damaged).
std::string shifts_file(const std::string& ckpt_dir) { return (fs::path(ckpt_dir) / "shifts.bin").string(); }

// The file's first line (its identity and SHA-256) as JSON, or null; `in` is left after it.
nlohmann::json read_shifts_head(std::ifstream& in) {
  std::string head;
  if (!in || !std::getline(in, head)) return nullptr;
  const nlohmann::json h = nlohmann::json::parse(head, nullptr, false);
  return h.is_object() ? h : nullptr;
}

std::optional<Shifts> read_kept_shifts(const std::string& path, const nlohmann::json& id, const PairDims& d) {
  std::ifstream in(path, std::ios::binary);
  const nlohmann::json h = read_shifts_head(in);
  if (!h.is_object() || h.value("identity", nlohmann::json()) != id) return std::nullopt;
  Shifts s;
  const int64_t sizes[6] = {d.X(), d.Y(), d.X(), d.Y(), d.X(), d.Y()};
  Sha256 sha;
  int i = 0;
  for (auto* v : parts_of(s)) {
    v->resize(static_cast<size_t>(sizes[i++]));
    in.read(reinterpret_cast<char*>(v->data()), static_cast<std::streamsize>(v->size() * sizeof(float)));
    if (!in) return std::nullopt;
    sha.update(v->data(), v->size() * sizeof(float));
  }
  if (in.peek() != std::char_traits<char>::eof() || sha.hex() != h.value("sha256", "")) return std::nullopt;
  return s;
}

void keep_shifts(const std::string& path, const nlohmann::json& id, const Shifts& s) {
  Sha256 sha;
  for (auto* v : parts_of(s)) sha.update(v->data(), v->size() * sizeof(float));
  const std::string head = nlohmann::json{{"identity", id}, {"sha256", sha.hex()}}.dump() + "\n";
  AtomicFile f(path);
  f.write(head.data(), head.size());
  for (auto* v : parts_of(s)) f.write(v->data(), v->size() * sizeof(float));
  f.commit();
}

}  // namespace

std::string kept_shift_shard(const std::string& ckpt_dir) {
  std::ifstream in(shifts_file(ckpt_dir), std::ios::binary);
  const nlohmann::json h = read_shifts_head(in);
  const nlohmann::json id = h.is_object() ? h.value("identity", nlohmann::json()) : nlohmann::json();
  return id.is_object() && id.contains("shard") && id["shard"].is_string() ? id["shard"].get<std::string>() : "";
}

Shifts provisional_shifts(const Calibration& cal, const std::string& ckpt_dir, bool writer, bool fresh) {
  const std::string path = shifts_file(ckpt_dir);
  const nlohmann::json id = shift_identity(cal);
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

int64_t pass_rounds(const Calibration& cal, int ranks) {
  const int64_t per_round = int64_t{ranks} * cal.cfg.checkpoint_every_shards;
  return (static_cast<int64_t>(cal.shards.size()) + per_round - 1) / per_round;
}

PassStats stream_pass(const Calibration& cal, Context& ctx, Moments& k, Moments* k_rope, Moments& v,
                      const std::string& label, int64_t start_round, const RoundHook& on_round) {
  const int rank = ctx.readers().rank(), size = ctx.readers().size();
  const int64_t rounds = pass_rounds(cal, size), per_round = int64_t{size} * cal.cfg.checkpoint_every_shards;
  int64_t todo = 0, job_todo = 0;
  for (size_t i = static_cast<size_t>(start_round * per_round); i < cal.shards.size(); ++i) {
    job_todo += cal.shards[i].used;
    if (static_cast<int>(i % size) == rank) todo += cal.shards[i].used;
  }
  const PairDims d = cal.dims();
  const double bytes_per_token = 2.0 * (d.X() * 4 + d.Y() * 4);  // fp32 equivalent of K and V, both sides
  Progress progress(label, job_todo, bytes_per_token);
  Rope rs(cal.source, "source kv_spec"), rt(cal.target, "target kv_spec");
  const bool want_raw = k_rope != nullptr, weighted = cal.cfg.weighting == Weighting::dataset;
  const int64_t B = cal.cfg.block_tokens;
  // A device backend converts, strips RoPE and shifts on the device (half the bytes to copy, no host arithmetic);
  // otherwise the reader thread does it.
  ComputeBackend& be = ctx.backend;
  const bool on_device = be.prepares_on_device();
  const BlockShifts shifts{k.shift_x().data(),
                           k.shift_y().data(),
                           want_raw ? k_rope->shift_x().data() : nullptr,
                           want_raw ? k_rope->shift_y().data() : nullptr,
                           v.shift_x().data(),
                           v.shift_y().data()};
  auto fold = [&](Block& b) {
    be.begin_inputs();
    const int64_t n = b.rows;
    const RowWeights w = b.weights();
    if (w.sqrt_w) be.stage_inputs({ComputeBackend::floats(w.sqrt_w, n)});
    if (!on_device) {
      be.stage_inputs({ComputeBackend::floats(b.xk.data(), n * d.X()), ComputeBackend::floats(b.yk.data(), n * d.Y()),
                       ComputeBackend::floats(b.xv.data(), n * d.X()), ComputeBackend::floats(b.yv.data(), n * d.Y())});
      if (want_raw)
        be.stage_inputs({ComputeBackend::floats(b.xk_raw.data(), n * d.X()),
                         ComputeBackend::floats(b.yk_raw.data(), n * d.Y())});
      k.accumulate_staged(be, b.xk.data(), b.yk.data(), n, w);
      if (want_raw) k_rope->accumulate_staged(be, b.xk_raw.data(), b.yk_raw.data(), n, w);
      v.accumulate_staged(be, b.xv.data(), b.yv.data(), n, w);
      return;
    }
    be.stage_inputs({b.sk.span(), b.sv.span(), b.tk.span(), b.tv.span(),
                     {b.spos.data(), n * 4}, {b.tpos.data(), n * 4}});
    const ComputeBackend::Strip ss{&rs, b.spos.data()}, tt{&rt, b.tpos.data()};
    const float* xk = be.prepare(b.sk.block(n), &ss, shifts.xk, w.sqrt_w, b.xk);
    const float* yk = be.prepare(b.tk.block(n), &tt, shifts.yk, w.sqrt_w, b.yk);
    k.accumulate_staged(be, xk, yk, n, w);
    if (want_raw) {
      const float* xr = be.prepare(b.sk.block(n), nullptr, shifts.xk_raw, w.sqrt_w, b.xk_raw);
      const float* yr = be.prepare(b.tk.block(n), nullptr, shifts.yk_raw, w.sqrt_w, b.yk_raw);
      k_rope->accumulate_staged(be, xr, yr, n, w);
    }
    const float* xv = be.prepare(b.sv.block(n), nullptr, shifts.xv, w.sqrt_w, b.xv);
    const float* yv = be.prepare(b.tv.block(n), nullptr, shifts.yv, w.sqrt_w, b.yv);
    v.accumulate_staged(be, xv, yv, n, w);
  };
  PassStats st;
  BlockQueue queue;
  for (int64_t round = start_round; round < rounds; ++round) {
    std::vector<const ShardPair*> mine;
    for (int64_t i = round * per_round; i < std::min<int64_t>((round + 1) * per_round, cal.shards.size()); ++i)
      if (static_cast<int>(i % size) == rank && cal.shards[i].used > 0) mine.push_back(&cal.shards[i]);
    bool abandoned = false;
    queue.next_round();
    std::thread producer([&] {
      try {
        for (const ShardPair* p : mine) {
          ShardPairReader r{p, ShardReader(p->source_path), ShardReader(p->target_path)};
          for (int64_t j = 0; j < p->used; j += B) {
            std::optional<Block> b = queue.take_free();
            if (!b) return;
            read_block(r, rs, rt, cal, j, std::min(B, p->used - j), want_raw, weighted, on_device ? nullptr : &shifts,
                       *b);
            queue.push(std::move(b));
          }
        }
        queue.push(std::nullopt);
      } catch (...) {
        queue.fail(std::current_exception());
      }
    });
    try {
      while (auto b = queue.pop()) {
        fold(*b);
        // Job-wide progress, estimated from this rank's share.
        progress.add(todo > 0 ? b->rows * job_todo / todo : b->rows);
        st.tokens += b->rows;
        queue.recycle(std::move(*b));
        if (ctx.stop.requested()) {
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
    if (on_round) on_round(round, rounds, abandoned);
  }
  progress.finish();
  st.seconds = progress.seconds();
  st.bytes = st.tokens * bytes_per_token;
  return st;
}

}  // namespace crosskv
