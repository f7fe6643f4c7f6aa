// Reading the next weights while one thread works alone (the decode stack's serial parts).
//
// A one-row decode step reads every weight once, so it is bound by memory, but between its
// linears the step does work that one thread does alone; the longest such part is a single
// KV head's attention (one sequence of a model with one KV head, as Gemma 3 270M). There the
// other OpenMP thread spins in its barrier and the memory bus idles. WeightStream lists the
// bytes the stack's linears read, in the order they read them; serial(fn) runs fn on thread 0
// while thread 1 loads the stream's next lines (one load per 64-byte line, from where the next
// linear starts, at most `ahead` bytes past that start), until fn returns. The lines land in
// that core's caches and in the shared L3, where the linear then finds them. Nothing is
// computed from the loaded bytes: results are unchanged bit for bit, only where the bytes wait
// changes. Only the attention is wrapped: the shorter serial parts (the norms, the activation)
// gain nothing, a parallel region costing what they could save (docs/decisions.md#weight-prefetch-serial).
//
// Contract: serial(fn) returns after fn returns, and rethrows what fn threw (outside the
// parallel region: an exception must not cross it). With one thread, inside a parallel
// region, with `ahead` 0 or nothing left to load, fn simply runs. fn runs on OpenMP thread 0
// of a parallel region: ATen and the kernels run their own loops serially there, so work
// that needs both threads must not be in fn.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <vector>

namespace kvserve_stack {

class WeightStream {
 public:
  // A new linear's bytes start here (call before its add()s); returns the linear's index.
  int begin_linear() {
    starts_.push_back(bytes_.size());
    return static_cast<int>(starts_.size()) - 1;
  }
  // n bytes at p, read by the linear begun last.
  void add(const void* p, size_t n) {
    if (n > 0) bytes_.push_back({static_cast<const uint8_t*>(p), n});
  }
  // Forget every linear (the distance stays).
  void clear() {
    bytes_.clear();
    starts_.clear();
    range_ = offset_ = limit_range_ = limit_budget_ = 0;
  }
  void set_ahead(size_t ahead) { ahead_ = ahead; }
  size_t ahead() const { return ahead_; }
  // Bytes loaded ahead so far (all steps; for tests and A/B runs).
  uint64_t loaded_bytes() const { return loaded_; }
  // The next linear to run is `linear` (the stack calls this as it goes; a new step starts at 0).
  void at_linear(int linear) {
    if (linear < 0 || linear >= static_cast<int>(starts_.size())) return;
    const size_t first = starts_[linear];
    if (linear == 0 || range_ < first) {  // a new step, or the loads fell behind the reads
      range_ = first;
      offset_ = 0;
    }
    limit_range_ = first;
    limit_budget_ = ahead_;
  }

  template <typename F>
  void serial(F&& fn) {
    if (ahead_ == 0 || omp_in_parallel() || omp_get_max_threads() < 2 ||
        range_ >= bytes_.size()) {
      fn();
      return;
    }
    std::atomic<bool> done{false};
    std::exception_ptr error;
#pragma omp parallel num_threads(2)
    {
      if (omp_get_thread_num() == 0) {
        try {
          fn();
        } catch (...) {
          error = std::current_exception();
        }
        done.store(true, std::memory_order_release);
      } else {
        load_until(done);
      }
    }
    if (error) std::rethrow_exception(error);
  }

 private:
  struct Range {
    const uint8_t* p;
    size_t n;
  };
  static constexpr size_t kLine = 64;
  static constexpr size_t kCheckEvery = 4096;  // bytes between looks at `done`

  // Loads lines from (range_, offset_) on, until `done` or `ahead_` bytes past the next
  // linear's start have been loaded; the position is kept for the next serial part.
  void load_until(const std::atomic<bool>& done) {
    uint64_t acc = 0;
    size_t budget = budget_left();
    while (range_ < bytes_.size() && budget > 0) {
      const Range& r = bytes_[range_];
      const size_t stop = std::min(r.n, offset_ + std::min(budget, kCheckEvery));
      for (size_t o = offset_; o < stop; o += kLine) {
        acc += *reinterpret_cast<const volatile uint8_t*>(r.p + o);
      }
      budget -= std::min(budget, stop - offset_);
      loaded_ += stop - offset_;
      offset_ = stop;
      if (offset_ >= r.n) {
        range_++;
        offset_ = 0;
      }
      if (done.load(std::memory_order_acquire)) break;
    }
    sink_ = acc;
  }

  // Bytes still allowed: ahead_ past the next linear's start, less what lies loaded past it.
  size_t budget_left() const {
    size_t loaded = 0;
    for (size_t i = limit_range_; i < range_ && i < bytes_.size(); i++) loaded += bytes_[i].n;
    loaded += offset_;
    return loaded >= limit_budget_ ? 0 : limit_budget_ - loaded;
  }

  std::vector<Range> bytes_;
  std::vector<size_t> starts_;  // per linear: its first range
  size_t ahead_ = 0;
  size_t range_ = 0, offset_ = 0;  // the next byte to load
  size_t limit_range_ = 0, limit_budget_ = 0;
  uint64_t loaded_ = 0;
  volatile uint64_t sink_ = 0;
};

}  // namespace kvserve_stack
