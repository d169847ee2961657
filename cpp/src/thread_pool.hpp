// A persistent pool of worker threads for the fast kernels (docs/kernels.md, step 7).
//
// parallel_for(items, num_threads, fn) calls fn(item, thread) once for every item in
// [0, items), on the calling thread (thread 0) and up to num_threads - 1 workers (threads
// 1, 2, ...). Items are handed out dynamically from an atomic counter, so callers order them
// most expensive first. Workers are created on first need and live until the process ends; no
// thread is created per call. A call that finds the pool busy (another caller, e.g. another
// Python thread, is using it) runs every item on its own thread rather than waiting, so
// concurrent calls never deadlock. The first exception thrown by fn is rethrown to the caller
// after every started item has finished.
#pragma once

#include <cstdint>
#include <functional>

namespace twinattn {

using ItemFn = std::function<void(int64_t item, int thread)>;

void parallel_for(int64_t items, int num_threads, const ItemFn& fn);

}  // namespace twinattn
