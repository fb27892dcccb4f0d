// The paged stash pool and the model registry of the runtime (no Python, no libtorch).
//
// PagePool: fixed-size pages carved from one aligned allocation made once. alloc(n_bytes)
// hands out a *contiguous run* of pages (its page table is {first, count}), so a stashed tensor
// is one contiguous byte range of the pool and the framework can view it without a gather;
// free(run) returns the pages. A request that does not fit is refused (kOverflow) and counted,
// never silently truncated. Every method is thread-safe (one mutex; alloc scans a page bitmap).
//
// Registry: the model registers each MoE layer once at build (LayerSpec) and gets a handle
// (its registration index) that the layer keeps; nothing is negotiated per step.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace moeplug {

// A contiguous run of pages: the page table of one stashed tensor.
struct PageRun {
  int64_t first = -1;  // -1: not allocated (overflow)
  int64_t count = 0;
};

struct PoolStats {
  int64_t page_bytes = 0;
  int64_t num_pages = 0;
  int64_t pages_in_use = 0;
  int64_t high_water = 0;  // max pages_in_use since construction or reset_high_water()
  int64_t overflows = 0;   // refused alloc() calls since construction
  int64_t allocs = 0;      // successful alloc() calls since construction
};

class PagePool {
 public:
  // own_memory=false: only the page bookkeeping (the caller owns the bytes, e.g. GPU memory).
  PagePool(int64_t page_bytes, int64_t num_pages, bool own_memory = true);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  static constexpr int64_t kAlignment = 4096;  // page_bytes must be a multiple of 64

  // Pages for n_bytes (>= 1 page, first fit); {-1, 0} and overflows+1 when no run fits.
  PageRun alloc(int64_t n_bytes);
  // Returns a run from alloc(); throws std::invalid_argument on a run it does not hold.
  void free(PageRun run);
  PoolStats stats() const;
  void reset_high_water();

  uint8_t* data() const { return data_; }  // nullptr when !own_memory
  int64_t page_bytes() const { return page_bytes_; }
  int64_t num_pages() const { return num_pages_; }
  int64_t size_bytes() const { return page_bytes_ * num_pages_; }

 private:
  const int64_t page_bytes_;
  const int64_t num_pages_;
  uint8_t* data_ = nullptr;
  mutable std::mutex mu_;
  std::vector<uint8_t> used_;  // per page: 1 = part of an allocated run
  int64_t search_from_ = 0;    // first page that may be free (first-fit starts here)
  PoolStats stats_;
};

// What a model declares about one MoE layer when it registers.
struct LayerSpec {
  int64_t index = 0;              // position among the model's MoE layers
  int64_t num_experts = 0;        // E
  int64_t top_k = 0;              // K
  int64_t hidden = 0;             // D
  int64_t ffn_hidden = 0;         // F
  int64_t num_local_experts = 0;  // L
  std::string dtype;              // compute dtype, e.g. "float32"
  std::string activation;         // e.g. "swiglu"
  int64_t stash_bytes = 0;        // what it will stash per step (its reservation)
  std::vector<std::string> streams;
};

struct LayerGrant {
  int64_t handle = -1;
  int64_t stash_pages = 0;  // the reservation in pages of the registry's page size
};

class Registry {
 public:
  explicit Registry(int64_t page_bytes);
  // Throws std::invalid_argument on a repeated index or a negative size.
  LayerGrant register_layer(const LayerSpec& spec);
  const LayerSpec& layer(int64_t handle) const;
  const LayerGrant& grant(int64_t handle) const;
  int64_t num_layers() const;
  int64_t reserved_pages() const;  // sum of the grants' stash_pages

 private:
  const int64_t page_bytes_;
  mutable std::mutex mu_;
  std::vector<LayerSpec> layers_;
  std::vector<LayerGrant> grants_;
};

}  // namespace moeplug
