// The persistent pool behind parallel_for (see thread_pool.hpp).
//
// One job at a time: a caller that wins try_lock on job_mutex publishes the job (function,
// item count, number of workers wanted) under state_mutex, bumps the generation and wakes the
// workers; workers 1..wanted take items from the shared counter, then report done. The caller
// takes items too, then waits until every wanted worker has reported. Workers that were not
// wanted for this job go back to sleep at once.
#include "thread_pool.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace twinattn {
namespace {

class ThreadPool {
public:
    static ThreadPool& instance() {
        // Never destroyed: workers may still be parked when the process exits.
        static ThreadPool* pool = new ThreadPool();
        return *pool;
    }

    void run(int64_t items, int num_threads, const ItemFn& fn) {
        std::unique_lock<std::mutex> job_lock(job_mutex_, std::try_to_lock);
        if (!job_lock.owns_lock()) {  // busy: run on the caller's thread
            for (int64_t item = 0; item < items; ++item) fn(item, 0);
            return;
        }
        const int wanted = static_cast<int>(std::min<int64_t>(num_threads, items)) - 1;
        ensure_workers(wanted);
        {
            std::lock_guard<std::mutex> lock(state_mutex_);
            fn_ = &fn;
            items_ = items;
            wanted_ = wanted;
            pending_ = wanted;
            next_item_.store(0, std::memory_order_relaxed);
            error_ = nullptr;
            ++generation_;
        }
        wake_.notify_all();
        take_items(0);
        std::unique_lock<std::mutex> lock(state_mutex_);
        done_.wait(lock, [&] { return pending_ == 0; });
        fn_ = nullptr;
        if (error_) std::rethrow_exception(error_);
    }

private:
    ThreadPool() = default;

    void ensure_workers(int count) {
        while (static_cast<int>(workers_.size()) < count) {
            const int thread = static_cast<int>(workers_.size()) + 1;
            uint64_t seen;
            {
                std::lock_guard<std::mutex> lock(state_mutex_);
                seen = generation_;
            }
            workers_.emplace_back([this, thread, seen] { worker_loop(thread, seen); });
            workers_.back().detach();
        }
    }

    void take_items(int thread) {
        for (;;) {
            const int64_t item = next_item_.fetch_add(1, std::memory_order_relaxed);
            if (item >= items_) return;
            try {
                (*fn_)(item, thread);
            } catch (...) {
                std::lock_guard<std::mutex> lock(state_mutex_);
                if (!error_) error_ = std::current_exception();
                next_item_.store(items_, std::memory_order_relaxed);  // stop handing out items
            }
        }
    }

    void worker_loop(int thread, uint64_t seen) {
        for (;;) {
            {
                std::unique_lock<std::mutex> lock(state_mutex_);
                wake_.wait(lock, [&] { return generation_ != seen; });
                seen = generation_;
                if (thread > wanted_) continue;  // not needed for this job
            }
            take_items(thread);
            std::lock_guard<std::mutex> lock(state_mutex_);
            if (--pending_ == 0) done_.notify_one();
        }
    }

    std::mutex job_mutex_;    // held by the caller that owns the pool for one job
    std::mutex state_mutex_;  // guards everything below except next_item_
    std::condition_variable wake_, done_;
    std::vector<std::thread> workers_;
    uint64_t generation_ = 0;
    const ItemFn* fn_ = nullptr;
    int64_t items_ = 0;
    int wanted_ = 0;
    int pending_ = 0;
    std::exception_ptr error_;
    std::atomic<int64_t> next_item_{0};
};

}  // namespace

void parallel_for(int64_t items, int num_threads, const ItemFn& fn) {
    if (items <= 0) return;
    if (num_threads <= 1 || items == 1) {
        for (int64_t item = 0; item < items; ++item) fn(item, 0);
        return;
    }
    ThreadPool::instance().run(items, num_threads, fn);
}

}  // namespace twinattn
