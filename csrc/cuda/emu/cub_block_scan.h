// The cub::BlockScan subset that csrc/cuda/atm.cu uses, for the SIMT emulator only
// (csrc/cuda/emu/cuda_emu.h): same interface (TempStorage, ItemsPerThread arrays,
// block aggregate), computed through shared memory and one __syncthreads. As with cub,
// the caller must __syncthreads() before reusing the TempStorage.
#pragma once

namespace cub {

template <typename T, int BLOCK_DIM_X>
class BlockScan {
 public:
  struct TempStorage {
    T partial[BLOCK_DIM_X];
  };

  explicit BlockScan(TempStorage& storage) : s_(storage) {}

  template <int N, typename Op>
  void InclusiveScan(const T (&in)[N], T (&out)[N], Op op, T& block_aggregate) {
    T prefix{};
    const bool has_prefix = Publish(in, op, prefix, block_aggregate);
    T run = has_prefix ? op(prefix, in[0]) : in[0];
    out[0] = run;
    for (int i = 1; i < N; ++i) out[i] = run = op(run, in[i]);
  }

  template <int N>
  void ExclusiveSum(const T (&in)[N], T (&out)[N], T& block_aggregate) {
    const auto sum = [](const T& a, const T& b) { return a + b; };
    T prefix{};
    const bool has_prefix = Publish(in, sum, prefix, block_aggregate);
    T run = has_prefix ? prefix : T{};
    for (int i = 0; i < N; ++i) {
      const T v = in[i];
      out[i] = run;
      run = run + v;
    }
  }

 private:
  // Writes this thread's aggregate, waits for the block, then folds the aggregates of
  // the threads before it (prefix, false for thread 0) and of all threads.
  template <int N, typename Op>
  bool Publish(const T (&in)[N], Op op, T& prefix, T& block_aggregate) {
    const int tid = static_cast<int>(threadIdx.x);
    T own = in[0];
    for (int i = 1; i < N; ++i) own = op(own, in[i]);
    s_.partial[tid] = own;
    __syncthreads();
    T total = s_.partial[0];
    for (int t = 1; t < BLOCK_DIM_X; ++t) {
      if (t == tid) prefix = total;
      total = op(total, s_.partial[t]);
    }
    block_aggregate = total;
    return tid > 0;
  }

  TempStorage& s_;
};

}  // namespace cub
