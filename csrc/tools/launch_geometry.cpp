// Prints the launch geometry of every CUDA kernel in csrc/cuda/*.cu (threads per block, grid
// blocks, dynamic shared memory) at one shape, as JSON, from the same constexpr functions the
// launchers call (wiola/atm_launch.h, wiola/gcla_launch.h). gpu-report compiles and runs it
// (wiola_kernels/devtools/cuda_report.py); no tool re-derives a launch.
//
//   launch_geometry B T d chunk_elems L
//     B, T, d: the ATM shape; chunk_elems: elements per 16-byte chunk of its dtype; L: GCLA's Λ'.
// Kernels whose geometry depends on a template head width print one entry per DH in HeadDims.
#include <cstdio>
#include <cstdlib>

#include "wiola/atm_launch.h"
#include "wiola/gcla_attention.h"  // HeadDims
#include "wiola/gcla_launch.h"

namespace {

bool first = true;

void entry(const char* kernel, int dh, long long blocks, int threads, long long smem) {
  std::printf("%s\n  {\"kernel\": \"%s\", \"dh\": %d, \"blocks\": %lld, \"threads\": %d, \"smem\": %lld}",
              first ? "[" : ",", kernel, dh, blocks, threads, smem);
  first = false;
}

void print(const char* kernel, const wiola::atm::Geometry& g) { entry(kernel, 0, g.blocks, g.threads, g.smem); }

// The summary kernels at (B, H = 1, T) for one head width: grids scale with B·H; shared memory
// is the larger of S = 1 and S = T.
void summary(int dh, long long B, long long T, long long L) {
  namespace gcla = wiola::gcla;
  entry("summary_forward_kernel", dh, gcla::summary_forward_blocks(B * T), gcla::kThreads, 0);
  entry("summary_backward_kernel", dh, B * gcla::backward_chunks(T), gcla::kThreads,
        static_cast<long long>(gcla::summary_backward_smem(L, dh, true)));
}

template <int... Ds>
void summaries(wiola::gcla::HeadDimList<Ds...>, long long B, long long T, long long L) {
  (summary(Ds, B, T, L), ...);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s B T d chunk_elems L\n", argv[0]);
    return 2;
  }
  const long long B = std::atoll(argv[1]), T = std::atoll(argv[2]), d = std::atoll(argv[3]);
  const long long per_chunk = std::atoll(argv[4]), L = std::atoll(argv[5]);
  namespace atm = wiola::atm;
  namespace gcla = wiola::gcla;
  print("norms_and_dots_kernel", atm::norms_and_dots_geometry(B, T));
  print("select_kernel", atm::select_geometry(B));
  print("gather_average_kernel", atm::row_geometry(B, T));
  print("merge_backward_kernel", atm::row_geometry(B, T));
  print("unmerge_kernel", atm::row_geometry(B, T));
  print("map_sorted_kernel", atm::map_sorted_geometry(B));
  const bool vec = d % per_chunk == 0;
  const atm::Geometry seg = atm::unmerge_backward_geometry(T, atm::unmerge_backward_lanes(d, per_chunk, vec));
  print("unmerge_backward_kernel", {seg.blocks * (B < atm::kMaxGridY ? B : atm::kMaxGridY), seg.threads, seg.smem});
  summaries(gcla::HeadDims{}, B, T, L);
  entry("context_sum_kernel", 0, gcla::context_sum_blocks(B * 2 * L), gcla::kContextSumThreads, 0);
  entry("dgate_kernel", 0, 1, gcla::kDgateThreads, 0);
  std::printf("\n]\n");
  return 0;
}
