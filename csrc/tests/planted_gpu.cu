// The planted-bug copies of the CUDA kernels (csrc/tests/planted_bugs.py) on a GPU, torch-free,
// for compute-sanitizer (scripts/planted_gpu.sh builds and runs it):
//
//   planted_gpu none     the copies with every plant off: GCLA summary forward + backward
//                        (S = 1, two 64-row chunks, a row whose second chunk is all padding)
//                        and an ATM merge; must be clean under every tool
//   planted_gpu <plant>  one plant on, the kernels it is in; the plant's tool must report it
//
// Inputs are copied to the device with cudaMemcpy (initialised for initcheck); outputs and
// workspaces are plain cudaMalloc (never written until a kernel writes them). Exit 0 when every
// launch and the final synchronisation succeeded, 1 otherwise (a sanitizer sets its own code).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "planted.h"
#include "gcla_attention_planted.cu"
#include "atm_planted.cu"

namespace {

bool ok = true;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::printf("%s: %s\n", what, cudaGetErrorString(err));
    ok = false;
  }
}

// A device buffer of n elements (plus `pad` bytes before the data, to misalign it).
template <typename T>
struct Buf {
  char* base = nullptr;
  T* p = nullptr;
  explicit Buf(size_t n, size_t pad = 0) {
    check(cudaMalloc(&base, n * sizeof(T) + pad), "cudaMalloc");
    p = reinterpret_cast<T*>(base + pad);
  }
  Buf(const std::vector<T>& v, size_t pad = 0) : Buf(v.size(), pad) {
    check(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  ~Buf() { cudaFree(base); }
};

std::vector<float> randn(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// GCLA summary forward and backward, float32, S = 1, Λ' = 2, d_h 64, H 4 / H_kv 2 (permuted
// self heads), T 70 (two chunks), lengths {70, 23}: chunk 1 of row 1 is all padding.
void run_gcla() {
  const int64_t B = 2, H = 4, T = 70, D = 64, S = 1, L = 2, P = 2;
  const size_t rows = size_t(B * H * T), ctx = size_t(B * H * S * L * D);
  const Buf<float> o_self(randn(rows * D, 1)), lse_self(randn(rows, 2)), q(randn(rows * D, 3)), kc(randn(ctx, 4)),
      vc(randn(ctx, 5)), gate(randn(size_t(H), 6)), q_rot(randn(rows * D, 7)), grad(randn(rows * D, 8));
  const Buf<int64_t> lengths(std::vector<int64_t>{T, 23});
  const Buf<float> out(rows * D), lse(rows);
  const wiola::gcla::SelfTensor layout{nullptr, T * H * D, D, H * D};  // (B, T, H, d) memory, as the binding
  wiola::gcla::SummaryForwardParams p{};
  p.o_self = {o_self.p, layout.sb, layout.sh, layout.st};
  p.lse_self = {lse_self.p, H * T, T};
  p.q = q.p; p.kc = kc.p; p.vc = vc.p; p.gate = gate.p; p.lengths = lengths.p;
  p.out = out.p; p.lse = lse.p;
  p.B = B; p.H = H; p.T = T; p.dh = D; p.S = S; p.L = L; p.perm_kv = P;
  p.scale = 0.125f;
  p.dtype = wiola::gcla::DType::kFloat32;
  check(wiola::gcla::launch_summary_forward(p, nullptr), "gcla summary forward");
  const int64_t nchunks = wiola::gcla::backward_chunks(T);
  const Buf<float> dq(rows * D), dkc(ctx), dvc(ctx), dgate{size_t(H)}, do_self(rows * D), os(rows * D), qs(rows * D),
      ls(rows), gate_part(size_t(B * H * nchunks)), ckv_part(size_t(B * H * nchunks * 2 * L * D));
  wiola::gcla::SummaryBackwardParams bp{};
  bp.grad_out = grad.p; bp.out = out.p; bp.lse = lse.p; bp.q_rot = q_rot.p; bp.q = q.p; bp.kc = kc.p; bp.vc = vc.p;
  bp.gate = gate.p; bp.lengths = lengths.p;
  bp.dq = dq.p; bp.dkc = dkc.p; bp.dvc = dvc.p; bp.dgate = dgate.p;
  bp.do_self = {do_self.p, layout.sb, layout.sh, layout.st};
  bp.o_self = {os.p, layout.sb, layout.sh, layout.st};
  bp.q_self = {qs.p, layout.sb, layout.sh, layout.st};
  bp.lse_self = {ls.p, H * T, T};
  bp.gate_part = gate_part.p; bp.ckv_part = ckv_part.p;
  bp.B = B; bp.H = H; bp.T = T; bp.dh = D; bp.S = S; bp.L = L; bp.perm_kv = P;
  bp.scale = p.scale;
  bp.dtype = wiola::gcla::DType::kFloat32;
  check(wiola::gcla::launch_summary_backward(bp, nullptr), "gcla summary backward");
  check(cudaDeviceSynchronize(), "gcla synchronize");
}

// ATM merge, float32, B 3, T 1100, d 40, lengths {1100, 517, 0}, half the tokens a multiple of
// the one before (they merge); x starts `pad` bytes into its allocation.
void run_atm(size_t pad) {
  const int64_t B = 3, T = 1100, d = 40;
  std::vector<float> xs = randn(size_t(B * T * d), 9);
  std::mt19937 rng(10);
  std::bernoulli_distribution dup(0.5);
  std::vector<int64_t> pos(size_t(B * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      if (t > 0 && dup(rng))
        for (int64_t j = 0; j < d; ++j) xs[size_t((b * T + t) * d + j)] = 2.f * xs[size_t((b * T + t - 1) * d + j)];
      pos[size_t(b * T + t)] = 7 * t + b;
    }
  const Buf<float> x(xs, pad), merged(xs.size()), norm_sq(size_t(B * T)), dot(size_t(B * T));
  const Buf<int64_t> positions(pos), lengths(std::vector<int64_t>{1100, 517, 0}), mpos(size_t(B * T)), mlen{size_t(B)},
      imap(size_t(B * T)), src(size_t(B * T));
  wiola::atm::MergeParams p{x.p, positions.p, lengths.p, 0.5, merged.p, mpos.p, mlen.p, imap.p, norm_sq.p, dot.p, src.p,
                            B, T, d, wiola::atm::DType::kFloat32};
  check(wiola::atm::launch_merge(p, nullptr), "atm merge");
  check(cudaDeviceSynchronize(), "atm synchronize");
}

void plant(wiola_plant::Flag flag) {
  wiola_plant::host_flags[flag] = true;
  check(cudaMemcpyToSymbol(wiola_plant::device_flags, wiola_plant::host_flags, sizeof wiola_plant::host_flags),
        "cudaMemcpyToSymbol");
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  check(cudaFree(nullptr), "CUDA context");
  check(cudaMemcpyToSymbol(wiola_plant::device_flags, wiola_plant::host_flags, sizeof wiola_plant::host_flags),
        "cudaMemcpyToSymbol");
  struct Mode {
    const char* name;
    wiola_plant::Flag flag;
    bool gcla;
    size_t atm_pad;  // -1: no ATM run
  };
  const Mode modes[] = {
      {"missing-sync", wiola_plant::kMissingSync, true, size_t(-1)},
      {"divergent-barrier", wiola_plant::kDivergentBarrier, true, size_t(-1)},
      {"unwritten-partial", wiola_plant::kUnwrittenPartial, true, size_t(-1)},
      {"select-race", wiola_plant::kSelectRace, false, 0},
      {"overrun", wiola_plant::kLookAhead, false, 0},
      {"misaligned", wiola_plant::kIgnoreAlignment, false, 4},
  };
  if (mode == "none") {
    run_gcla();
    run_atm(0);
  } else {
    const Mode* m = nullptr;
    for (const Mode& c : modes)
      if (mode == c.name) m = &c;
    if (m == nullptr) {
      std::printf("usage: planted_gpu none|missing-sync|divergent-barrier|unwritten-partial|select-race|overrun|"
                  "misaligned\n");
      return 2;
    }
    plant(m->flag);
    if (m->gcla) run_gcla();
    if (m->atm_pad != size_t(-1)) run_atm(m->atm_pad);
  }
  std::printf("planted_gpu %s: %s\n", mode.c_str(), ok ? "ran" : "a CUDA call failed");
  return ok ? 0 : 1;
}
