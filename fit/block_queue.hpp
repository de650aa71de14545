#pragma once
// The streaming pass's hand-over between its reader thread and the thread that folds blocks in.
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <vector>

#include "fit/block_reader.hpp"

namespace crosskv {

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

}  // namespace crosskv
