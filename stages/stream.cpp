#include <cmath>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include "core/comm.hpp"
#include "stages/grid.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/rope.hpp"
#include "io/shard.hpp"
#include "stages/checkpoint.hpp"
#include "stages/stages.hpp"

namespace crosskv {
namespace {

struct Block {
  int64_t rows = 0;
  std::vector<float> xk, xk_raw, xv, yk, yk_raw, yv;
};

struct Readers {
  const ShardPair* pair;
  ShardReader source, target;
  std::vector<uint16_t> scratch;
  std::vector<int32_t> pos;
};

void check_finite(const std::vector<float>& v, int64_t rows, int layers, int64_t per_layer, const std::string& path,
                  const char* dataset, int64_t t0, int64_t stride) {
  const int64_t row = layers * per_layer;
  for (int64_t i = 0; i < rows * row; ++i)
    if (!std::isfinite(v[i])) {
      const int64_t t = i / row, layer = (i % row) / per_layer;
      throw InputError(path + ": dataset '" + dataset + "' has " + (std::isnan(v[i]) ? "NaN" : "Inf") + " at layer " +
                       std::to_string(layer) + ", token " + std::to_string(t0 + t * stride));
    }
}

// Reads rows j0 .. j0+rows-1 of the strided token sequence of one shard pair; keys RoPE-stripped.
void read_block(Readers& r, const Rope& rs, const Rope& rt, const Calibration& cal, int64_t j0, int64_t rows,
                bool want_raw, Block& b) {
  const int64_t stride = cal.cfg.token_stride, t0 = j0 * stride;
  const PairDims d = cal.dims();
  b.rows = rows;
  auto side = [&](ShardReader& sr, const Rope& rope, int layers, int heads, int64_t per_layer, std::vector<float>& k,
                  std::vector<float>& raw, std::vector<float>& v) {
    const std::string& path = sr.header().path;
    k.resize(rows * layers * per_layer);
    v.resize(rows * layers * per_layer);
    sr.read_rows("keys", t0, rows, stride, k.data(), r.scratch);
    check_finite(k, rows, layers, per_layer, path, "keys", t0, stride);
    sr.read_rows("values", t0, rows, stride, v.data(), r.scratch);
    check_finite(v, rows, layers, per_layer, path, "values", t0, stride);
    if (want_raw) raw = k;
    r.pos.resize(rows);
    sr.read_positions(t0, rows, stride, r.pos.data());
    rope.strip_block(k.data(), rows, int64_t{layers} * heads, r.pos.data());
  };
  side(r.source, rs, d.Ls, d.Hs, d.F(), b.xk, b.xk_raw, b.xv);
  side(r.target, rt, d.Lt, d.Ht, d.G(), b.yk, b.yk_raw, b.yv);
}

// One producer thread reads blocks ahead; the consumer folds them in. HDF5 is only ever called from the producer.
class BlockQueue {
 public:
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
  // Blocks are recycled so that their buffers are not allocated (and page-faulted) again for every block.
  void recycle(Block&& b) {
    std::lock_guard<std::mutex> l(m_);
    free_.push_back(std::move(b));
  }
  Block take_free() {
    std::lock_guard<std::mutex> l(m_);
    if (free_.empty()) return Block{};
    Block b = std::move(free_.back());
    free_.pop_back();
    return b;
  }
  void abandon() {
    std::lock_guard<std::mutex> l(m_);
    abandoned_ = true;
    q_.clear();
    cv_.notify_all();
  }
  bool abandoned() {
    std::lock_guard<std::mutex> l(m_);
    return abandoned_;
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::optional<Block>> q_;
  std::vector<Block> free_;
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
  Readers r{&p, ShardReader(p.source_path), ShardReader(p.target_path), {}, {}};
  Rope rs(cal.source, p.source_path), rt(cal.target, p.target_path);
  const int64_t rows = std::min<int64_t>(cal.cfg.block_tokens, p.used);
  Block b;
  read_block(r, rs, rt, cal, 0, rows, true, b);
  const PairDims d = cal.dims();
  return {column_means(b.xk, rows, d.X()),     column_means(b.yk, rows, d.Y()), column_means(b.xk_raw, rows, d.X()),
          column_means(b.yk_raw, rows, d.Y()), column_means(b.xv, rows, d.X()), column_means(b.yv, rows, d.Y())};
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
  const bool want_raw = k_rope != nullptr;
  const int64_t B = cal.cfg.block_tokens;
  PassStats st;
  for (int64_t round = start_round; round < rounds; ++round) {
    std::vector<const ShardPair*> mine;
    for (int64_t i = round * per_round; i < std::min<int64_t>((round + 1) * per_round, cal.shards.size()); ++i)
      if (static_cast<int>(i % size) == rank && cal.shards[i].used > 0) mine.push_back(&cal.shards[i]);
    bool abandoned = false;
    BlockQueue queue;
    std::thread producer([&] {
      try {
        for (const ShardPair* p : mine) {
          Readers r{p, ShardReader(p->source_path), ShardReader(p->target_path), {}, {}};
          for (int64_t j = 0; j < p->used; j += B) {
            if (queue.abandoned()) return;
            Block b = queue.take_free();
            read_block(r, rs, rt, cal, j, std::min(B, p->used - j), want_raw, b);
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
        k.accumulate(ctx.backend, b->xk.data(), b->yk.data(), b->rows);
        if (k_rope) k_rope->accumulate(ctx.backend, b->xk_raw.data(), b->yk_raw.data(), b->rows);
        v.accumulate(ctx.backend, b->xv.data(), b->yv.data(), b->rows);
        // Job-wide progress, estimated from this rank's share.
        progress.add(todo > 0 ? b->rows * job_todo / todo : b->rows);
        st.tokens += b->rows;
        queue.recycle(std::move(*b));
        if (stop_requested()) {
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
