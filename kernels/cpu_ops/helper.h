// The helper thread decode's matmuls share their work with (the engine's batch_helper).
#pragma once
#include <immintrin.h>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <algorithm>
#include <cstdint>
#include <functional>
#include <mutex>
#include <sched.h>
#include <thread>

// One helper thread (set_batch_helper(true): decode, where prefill's core is mostly idle)
// that takes work items from the calling thread's matmul as it gets a core (int4_gemv.cpp's
// and batch_gemm.cpp's). Items are claimed from one counter, so a helper that the OS does
// not schedule (prefill busy on its core) costs nothing but its wake-up: the calling thread
// takes the items it leaves. Between matmuls it waits kSpinUs yielding the core (a decode
// step's next matmul comes within ~0.1 ms; sched_yield lets prefill run there meanwhile),
// then sleeps on a condition variable. An item runs the same instructions on either
// thread: the bits do not depend on which.
class Helper {
 public:
  static constexpr int kSpinUs = 300;

  // run item(i) for i in [0, n) on this thread and the helper; return when all are done
  void run(int64_t n, const std::function<void(int64_t)>& item) {
    if (running_.exchange(true, std::memory_order_acquire)) {   // another thread's matmul
      for (int64_t i = 0; i < n; ++i) item(i);                  // holds the helper: alone
      return;
    }
    next_.store(0);
    {
      std::lock_guard<std::mutex> lk(mu_);
      item_ = &item, n_ = n, open_ = true, ++gen_;
      pub_.store(gen_, std::memory_order_release);
    }
    cv_.notify_one();
    for (int64_t i; (i = next_.fetch_add(1)) < n;) item(i);
    {
      std::lock_guard<std::mutex> lk(mu_);
      open_ = false;                       // a helper that wakes from here on finds no job
    }
    while (busy_.load(std::memory_order_acquire)) _mm_pause();   // its item, µs at most
    running_.store(false, std::memory_order_release);
  }

  static Helper* get() {   // started on first use, never destroyed (a detached thread)
    static Helper* h = [] {
      auto* p = new Helper;
      std::thread([p] { p->loop(); }).detach();
      return p;
    }();
    return h;
  }

 private:
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int64_t)>* item;
      int64_t n;
      // a decode step's next matmul comes within ~0.1 ms: wait for it yielding the core
      // (to prefill, if it runs there) rather than asleep (a wake-up costs about as much)
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinUs);
      while (pub_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until)
        sched_yield();
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return gen_ != seen; });
        seen = gen_;
        if (!open_) continue;
        busy_.store(true, std::memory_order_release);   // under the lock: run() waits for it
        item = item_, n = n_;
      }
      for (int64_t i; (i = next_.fetch_add(1)) < n;) (*item)(i);
      busy_.store(false, std::memory_order_release);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void(int64_t)>* item_ = nullptr;
  int64_t n_ = 0;
  uint64_t gen_ = 0;
  std::atomic<uint64_t> pub_{0};   // gen_, readable without the lock
  bool open_ = false;
  std::atomic<int64_t> next_{0};
  std::atomic<bool> busy_{false};
  std::atomic<bool> running_{false};   // a run() in progress
};

// whether the matmuls use it (set_batch_helper); off until the engine turns it on
inline std::atomic<bool>& helper_flag() {
  static std::atomic<bool> on{false};
  return on;
}
inline bool helper_on() { return helper_flag().load(std::memory_order_relaxed); }

// run item(i) for i in [0, n): shared with the helper when it is on, else on this thread
inline void share(int64_t n, const std::function<void(int64_t)>& item) {
  if (helper_on() && n > 1) {
    Helper::get()->run(n, item);
  } else {
    for (int64_t i = 0; i < n; ++i) item(i);
  }
}

// f(n0, n) over N weight rows: spans of 64 (whole cache lines of a float y) shared with the
// helper when it is on, else one call over all N. f must not name a thread_local: the
// helper has its own (copy this thread's pointers into f's captures)
template <typename F>
void over_spans(int64_t N, F f) {
  constexpr int64_t kSpan = 64;
  const int64_t spans = (N + kSpan - 1) / kSpan;
  if (!helper_on() || spans < 2) return f(int64_t{0}, N);
  share(spans, [&](int64_t i) { f(i * kSpan, std::min(kSpan, N - i * kSpan)); });
}
