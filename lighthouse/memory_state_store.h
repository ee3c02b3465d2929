// A StateStore in memory: the same contract as the RocksDB store (atomic batches, forget deletes
// every record of a job, KV below an epoch dropped), with nothing on disk. For what needs the
// lighthouse's state but not its durability: tests that restart a Service in one process, and the
// route fuzzer, which runs millions of requests and must not pay for a disk per input.
// "Synced" writes are as durable as the process: a kill forgets everything.
// Thread-safety: every method takes one lock; safe from any thread.
#pragma once

#include <memory>

#include "lighthouse/state_store.h"

namespace lk::lighthouse {

std::unique_ptr<StateStore> NewMemoryStateStore();

}  // namespace lk::lighthouse
