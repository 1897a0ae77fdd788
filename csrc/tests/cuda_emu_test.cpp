// Tests of the SIMT emulator (csrc/cuda/emu/) and of the CUDA kernels it runs, torch-free,
// for ctest: plain, and under ThreadSanitizer (scripts/test.sh, build-tsan). Oracles are
// independent: the compiler's _Float16 and a nearest-value search for the conversions,
// float64 loops for the kernels, float64 central differences for the GCLA summary gradients.
// Every buffer a kernel gets is device memory of the emulator (device_alloc: it ends at a
// guard page and starts poisoned), and every kernel runs under several thread orders
// (forward, reverse, seeded shuffles: a result that depends on the order is a race).
//
//   wiola_cuda_emu_tests [all|quick]
//   wiola_cuda_emu_planted <plant>   (csrc/tests/planted_bugs.py --names)
// `quick` (for the ThreadSanitizer build) skips the conversion sweep, runs the kernels under
// one shuffled order and checks the GCLA gradients along one direction over all inputs.
// wiola_cuda_emu_planted links copies of the kernels with the bugs of csrc/tests/planted_bugs.py
// planted, each switched on by a flag of csrc/tests/planted.h; each mode switches one on and passes
// only if the emulator catches it (see planted_main).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#define WIOLA_CUDA_EMU 1
#include "../cuda/emu/cuda_emu.h"
#include "planted.h"
#include "wiola/atm.h"
#include "wiola/cuda_launch.cuh"
#include "wiola/cuda_vector.cuh"
#include "wiola/gcla_attention.h"

namespace {

int failures = 0;
bool quick = false;  // `quick` mode (the ThreadSanitizer run): see the file comment

void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

// Device memory for a kernel argument (wiola_emu::device_alloc): ends at a guard page,
// starts at an address ≡ phase (mod 16), filled with 0xFF bytes (NaN, -1) unless copied from
// a host vector.
template <typename T>
class DeviceBuf {
 public:
  explicit DeviceBuf(size_t n, size_t phase = 0)
      : n_(n), p_(static_cast<T*>(wiola_emu::device_alloc(n * sizeof(T), phase))) {}
  explicit DeviceBuf(const std::vector<T>& v, size_t phase = 0) : DeviceBuf(v.size(), phase) {
    if (!v.empty()) std::memcpy(p_, v.data(), v.size() * sizeof(T));
  }
  DeviceBuf(const DeviceBuf&) = delete;
  DeviceBuf& operator=(const DeviceBuf&) = delete;
  ~DeviceBuf() { wiola_emu::device_free(p_); }
  T* data() const { return p_; }
  std::vector<T> vec() const { return std::vector<T>(p_, p_ + n_); }

 private:
  size_t n_;
  T* p_;
};

// Runs f under each schedule (set_schedule), naming it in f's checks.
const std::vector<std::string>* schedules = nullptr;

std::string fault_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

// ---------------------------------------------------------------------------------
// GCLA summary kernels: float64 oracle of the summary part (given the fused attention's
// O^self and lse), gradients by central differences
// ---------------------------------------------------------------------------------
struct GclaCase {
  int64_t B = 2, H = 4, Hkv = 2, T = 40, dh = 64, S = 1, L = 2;
  std::vector<int64_t> lengths{40, 23};
  int64_t perm_kv() const { return Hkv > 1 && Hkv < H ? Hkv : 1; }
  int64_t self_head(int64_t h) const {  // wiola/gcla_attention.h: p(h)
    const int64_t P = perm_kv();
    return (h % P) * (H / P) + h / P;
  }
};

// Inputs in natural order (double, values exact in float): 0 o_self, 1 lse_self, 2 q, 3 kc,
// 4 vc, 5 gate, 6 q_rot.
struct GclaInputs {
  std::vector<double> t[7];
};

size_t gcla_size(const GclaCase& c, int which) {
  switch (which) {
    case 0: case 2: case 6: return size_t(c.B * c.H * c.T * c.dh);
    case 1: return size_t(c.B * c.H * c.T);
    case 3: case 4: return size_t(c.B * c.H * c.S * c.L * c.dh);
    default: return size_t(c.H);
  }
}

struct GclaOracle {  // float64, natural order
  std::vector<double> out, lse, dq, dkc, dvc, dgate, o_self;  // o_self: out − σ O^cross (0 past the length)
};

// Forward (out, lse) and, for grad_out, the backward's analytic gradients.
GclaOracle gcla_oracle(const GclaCase& c, const GclaInputs& in, const std::vector<double>* grad_out = nullptr) {
  const int64_t T = c.T, D = c.dh, L = c.L;
  const double scale = 1.0 / std::sqrt(double(D));
  GclaOracle o;
  o.out.assign(gcla_size(c, 0), 0.0);
  o.lse.assign(gcla_size(c, 1), 0.0);
  o.dq.assign(gcla_size(c, 2), 0.0);
  o.dkc.assign(gcla_size(c, 3), 0.0);
  o.dvc.assign(gcla_size(c, 4), 0.0);
  o.dgate.assign(gcla_size(c, 5), 0.0);
  o.o_self.assign(gcla_size(c, 0), 0.0);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h) {
      const int64_t len = c.lengths[size_t(b)], bh = b * c.H + h;
      const double sig = 1.0 / (1.0 + std::exp(-in.t[5][size_t(h)]));
      for (int64_t i = 0; i < len; ++i) {
        const size_t row = size_t((bh * T + i) * D);
        const int64_t s0 = (bh * c.S + (c.S == 1 ? 0 : i)) * L;
        std::vector<double> a(static_cast<size_t>(L)), oc(static_cast<size_t>(D), 0.0);
        double zm = -INFINITY, zs = 0;
        for (int64_t k = 0; k < L; ++k) {
          double d = 0;
          for (int64_t e = 0; e < D; ++e) d += in.t[2][row + size_t(e)] * in.t[3][size_t((s0 + k) * D + e)];
          a[size_t(k)] = d * scale;
          zm = std::max(zm, a[size_t(k)]);
        }
        for (double& x : a) zs += (x = std::exp(x - zm));
        for (int64_t k = 0; k < L; ++k) {
          a[size_t(k)] /= zs;
          for (int64_t e = 0; e < D; ++e) oc[size_t(e)] += a[size_t(k)] * in.t[4][size_t((s0 + k) * D + e)];
        }
        for (int64_t e = 0; e < D; ++e) {
          o.out[row + size_t(e)] = in.t[0][row + size_t(e)] + sig * oc[size_t(e)];
          o.o_self[row + size_t(e)] = in.t[0][row + size_t(e)];
        }
        o.lse[size_t(bh * T + i)] = in.t[1][size_t(bh * T + i)];
        if (grad_out == nullptr) continue;
        const double* go = &(*grad_out)[row];
        std::vector<double> ev(static_cast<size_t>(L));
        double r = 0;
        for (int64_t k = 0; k < L; ++k) {
          double d = 0;
          for (int64_t e = 0; e < D; ++e) d += go[e] * in.t[4][size_t((s0 + k) * D + e)];
          ev[size_t(k)] = d;
          r += a[size_t(k)] * d;
        }
        o.dgate[size_t(h)] += sig * (1 - sig) * r;
        for (int64_t k = 0; k < L; ++k) {
          const double dz = sig * a[size_t(k)] * (ev[size_t(k)] - r);
          for (int64_t e = 0; e < D; ++e) {
            o.dq[row + size_t(e)] += scale * dz * in.t[3][size_t((s0 + k) * D + e)];
            o.dkc[size_t((s0 + k) * D + e)] += scale * dz * in.t[2][row + size_t(e)];
            o.dvc[size_t((s0 + k) * D + e)] += sig * a[size_t(k)] * go[e];
          }
        }
      }
    }
  return o;
}

struct GclaRun {  // the kernels' outputs, natural order (self tensors gathered back from p(h))
  std::vector<float> out, lse, dq, dkc, dvc, dgate, do_self, o_self, q_self, lse_self;
};

// Runs both kernels on float copies; the self tensors live in (B, T, H, dh) memory with
// heads in the order p(h), as the binding allocates them. Every output starts poisoned.
GclaRun gcla_kernels(const GclaCase& c, const GclaInputs& in, const std::vector<double>& grad_out, size_t q_phase = 0) {
  const int64_t B = c.B, H = c.H, T = c.T, D = c.dh;
  std::vector<float> f[7];
  for (int k = 0; k < 7; ++k) f[k].assign(in.t[k].begin(), in.t[k].end());
  std::vector<float> go(grad_out.begin(), grad_out.end());
  const wiola::gcla::SelfTensor layout{nullptr, T * H * D, D, H * D};  // (b, p, t) strides
  auto self_index = [&](int64_t b, int64_t h, int64_t t) {
    return size_t(b * layout.sb + c.self_head(h) * layout.sh + t * layout.st);
  };
  std::vector<float> o_perm(gcla_size(c, 0)), lse_perm(gcla_size(c, 1));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const size_t row = size_t(((b * H + h) * T + t) * D);
        std::copy_n(&f[0][row], D, &o_perm[self_index(b, h, t)]);
        lse_perm[size_t((b * H + c.self_head(h)) * T + t)] = f[1][size_t((b * H + h) * T + t)];
      }
  const DeviceBuf<float> d_o(o_perm), d_lse_self(lse_perm), d_q(f[2], q_phase), d_kc(f[3]), d_vc(f[4]), d_gate(f[5]),
      d_qrot(f[6]), d_go(go);
  const DeviceBuf<int64_t> d_len(c.lengths);
  const DeviceBuf<float> out(gcla_size(c, 0)), lse(gcla_size(c, 1));
  wiola::gcla::SummaryForwardParams p{};
  p.o_self = {d_o.data(), layout.sb, layout.sh, layout.st};
  p.lse_self = {d_lse_self.data(), H * T, T};
  p.q = d_q.data(); p.kc = d_kc.data(); p.vc = d_vc.data(); p.gate = d_gate.data();
  p.lengths = d_len.data();
  p.out = out.data(); p.lse = lse.data();
  p.B = B; p.H = H; p.T = T; p.dh = D; p.S = c.S; p.L = c.L; p.perm_kv = c.perm_kv();
  p.scale = float(1.0 / std::sqrt(double(D)));
  p.dtype = wiola::gcla::DType::kFloat32;
  if (wiola::gcla::launch_summary_forward(p, nullptr) != cudaSuccess) throw std::runtime_error("forward launch failed");

  const DeviceBuf<float> dq(gcla_size(c, 2)), dkc(gcla_size(c, 3)), dvc(gcla_size(c, 4)), dgate{size_t(H)};
  const DeviceBuf<float> do_perm(gcla_size(c, 0)), os_perm(gcla_size(c, 0)), q_perm(gcla_size(c, 0));
  const DeviceBuf<float> ls_perm(gcla_size(c, 1));
  const int64_t nchunks = wiola::gcla::backward_chunks(T);
  const DeviceBuf<float> gate_part(size_t(B * H * nchunks));
  const DeviceBuf<float> ckv_part(c.S == 1 ? size_t(B * H * nchunks * 2 * c.L * D) : 0);
  wiola::gcla::SummaryBackwardParams bp{};
  bp.grad_out = d_go.data(); bp.out = out.data(); bp.lse = lse.data(); bp.q_rot = d_qrot.data();
  bp.q = d_q.data(); bp.kc = d_kc.data(); bp.vc = d_vc.data(); bp.gate = d_gate.data(); bp.lengths = d_len.data();
  bp.dq = dq.data(); bp.dkc = dkc.data(); bp.dvc = dvc.data(); bp.dgate = dgate.data();
  bp.do_self = {do_perm.data(), layout.sb, layout.sh, layout.st};
  bp.o_self = {os_perm.data(), layout.sb, layout.sh, layout.st};
  bp.q_self = {q_perm.data(), layout.sb, layout.sh, layout.st};
  bp.lse_self = {ls_perm.data(), H * T, T};
  bp.gate_part = gate_part.data(); bp.ckv_part = c.S == 1 ? ckv_part.data() : nullptr;
  bp.B = B; bp.H = H; bp.T = T; bp.dh = D; bp.S = c.S; bp.L = c.L; bp.perm_kv = c.perm_kv();
  bp.scale = p.scale;
  bp.dtype = wiola::gcla::DType::kFloat32;
  if (wiola::gcla::launch_summary_backward(bp, nullptr) != cudaSuccess) throw std::runtime_error("backward launch failed");
  GclaRun r;
  r.out = out.vec(); r.lse = lse.vec();
  r.dq = dq.vec(); r.dkc = dkc.vec(); r.dvc = dvc.vec(); r.dgate = dgate.vec();
  const std::vector<float> dp = do_perm.vec(), op = os_perm.vec(), qp = q_perm.vec(), lp = ls_perm.vec();
  r.do_self.resize(gcla_size(c, 0)); r.o_self.resize(gcla_size(c, 0)); r.q_self.resize(gcla_size(c, 0));
  r.lse_self.resize(gcla_size(c, 1));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const size_t row = size_t(((b * H + h) * T + t) * D);
        std::copy_n(&dp[self_index(b, h, t)], D, &r.do_self[row]);
        std::copy_n(&op[self_index(b, h, t)], D, &r.o_self[row]);
        std::copy_n(&qp[self_index(b, h, t)], D, &r.q_self[row]);
        r.lse_self[size_t((b * H + h) * T + t)] = lp[size_t((b * H + c.self_head(h)) * T + t)];
      }
  return r;
}

double rel_err(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = double(got[i]) - want[i];
    num += std::isnan(d) ? INFINITY : d * d;
    den += want[i] * want[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

GclaInputs random_gcla(const GclaCase& c, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0.0, 1.0);
  GclaInputs in;
  for (int k = 0; k < 7; ++k) {
    in.t[k].resize(gcla_size(c, k));
    for (double& x : in.t[k]) x = float(n(rng));  // values exactly representable in float
  }
  return in;
}

// `x` with rows t ≥ len_b zeroed (natural (B, H, T, per) layout).
std::vector<double> zero_padding(const GclaCase& c, std::vector<double> x, int64_t per) {
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t t = c.lengths[size_t(b)]; t < c.T; ++t)
        std::fill_n(&x[size_t(((b * c.H + h) * c.T + t) * per)], per, 0.0);
  return x;
}

void test_gcla(const GclaCase& c, const char* name) {
  const GclaInputs in = random_gcla(c, 1);
  std::mt19937_64 rng(2);
  std::normal_distribution<double> n(0.0, 1.0);
  std::vector<double> go(gcla_size(c, 0));
  for (double& x : go) x = float(n(rng));
  const GclaOracle want = gcla_oracle(c, in, &go);
  GclaRun r;
  for (const std::string& order : *schedules) {
    wiola_emu::set_schedule(wiola_emu::parse_schedule(order));
    r = gcla_kernels(c, in, go);
    const std::string s = std::string(name) + " [" + order + "]";
    check(rel_err(r.out, want.out) < 2e-6, s + ": forward output vs float64");
    check(rel_err(r.lse, want.lse) < 1e-7, s + ": lse vs float64");
    check(rel_err(r.dq, want.dq) < 2e-5, s + ": dq vs float64");
    check(rel_err(r.dkc, want.dkc) < 2e-5, s + ": dkc vs float64");
    check(rel_err(r.dvc, want.dvc) < 2e-5, s + ": dvc vs float64");
    check(rel_err(r.dgate, want.dgate) < 2e-5, s + ": dgate vs float64");
    check(rel_err(r.do_self, zero_padding(c, go, c.dh)) == 0, s + ": dO in the self order, zero past the lengths");
    check(rel_err(r.o_self, want.o_self) < 2e-6, s + ": O^self = O - sigma O^cross in the self order");
    check(rel_err(r.q_self, zero_padding(c, in.t[6], c.dh)) == 0,
          s + ": q_rot in the self order, zero past the lengths");
    check(rel_err(r.lse_self, want.lse) == 0, s + ": lse in the self order");
  }
  wiola_emu::clear_schedule();
  // The analytic oracle itself against central differences of L = Σ grad_out · out, along
  // random directions in q, kc, vc, gate (one over all of them in `quick` mode); the
  // kernels' gradients (of the last schedule) along the same directions.
  const std::string s(name);
  const char* names[5] = {"q", "kc", "vc", "gate", "all inputs"};
  const int inputs[4] = {2, 3, 4, 5};
  for (int k = quick ? 4 : 0; k < 5; ++k) {
    const double eps = 1e-4;
    GclaInputs plus = in, minus = in;
    double an = 0, scale = 0;
    const std::vector<double>* grads[4] = {&want.dq, &want.dkc, &want.dvc, &want.dgate};
    const std::vector<float>* got[4] = {&r.dq, &r.dkc, &r.dvc, &r.dgate};
    double an_kernel = 0;
    for (int m = 0; m < 4; ++m) {
      if (k != 4 && k != m) continue;
      for (size_t i = 0; i < in.t[inputs[m]].size(); ++i) {
        const double u = n(rng);
        plus.t[inputs[m]][i] += eps * u;
        minus.t[inputs[m]][i] -= eps * u;
        an += (*grads[m])[i] * u;
        an_kernel += double((*got[m])[i]) * u;
        scale += std::fabs((*grads[m])[i] * u);
      }
    }
    const std::vector<double> op = gcla_oracle(c, plus).out, om = gcla_oracle(c, minus).out;
    double fd = 0;
    for (size_t i = 0; i < go.size(); ++i) fd += go[i] * (op[i] - om[i]) / (2 * eps);
    const double err = std::fabs(an - fd) / std::max(scale, 1e-12);
    const double err_k = std::fabs(an_kernel - fd) / std::max(scale, 1e-12);
    check(err < 1e-6 && err_k < 1e-4, s + ": grad " + names[k] + " vs central differences");
  }
}

// ---------------------------------------------------------------------------------
// ATM: greedy loop in float64, values by simple loops
// ---------------------------------------------------------------------------------
// The ATM case: B = 3 rows of T = 1100 tokens (two scan tiles of 1024), d = 40; about
// half the tokens are positive multiples of the one before (s = 1: they merge).
struct AtmCase {
  int64_t B = 3, T = 1100, d = 40;
  std::vector<int64_t> lengths{1100, 517, 0};
  std::vector<float> x;
  std::vector<int64_t> pos;
  // The greedy loop in float64 (SPEC §6): index map, merged lengths and values.
  std::vector<int64_t> want_map, want_len;
  std::vector<float> want_merged;
};

void greedy(AtmCase& c) {
  const int64_t B = c.B, T = c.T, d = c.d;
  c.want_map.assign(size_t(B * T), 0);
  c.want_len.assign(size_t(B), 0);
  c.want_merged.assign(c.x.size(), 0.f);
  for (int64_t b = 0; b < B; ++b) {
    int64_t slot = 0, t = 0;
    const int64_t len = c.lengths[size_t(b)];
    while (t < len) {
      const float* a = &c.x[size_t((b * T + t) * d)];
      bool merge = false;
      if (t + 1 < len) {
        double dot = 0, na = 0, nc = 0;
        for (int64_t j = 0; j < d; ++j) {
          dot += double(a[j]) * a[j + d];
          na += double(a[j]) * a[j];
          nc += double(a[j + d]) * a[j + d];
        }
        merge = dot / std::sqrt(na * nc) > 0.5;
      }
      float* o = &c.want_merged[size_t((b * T + slot) * d)];
      for (int64_t j = 0; j < d; ++j) o[j] = merge ? 0.5f * (a[j] + a[j + d]) : a[j];
      c.want_map[size_t(b * T + t)] = slot;
      if (merge) c.want_map[size_t(b * T + t + 1)] = slot;
      t += merge ? 2 : 1;
      ++slot;
    }
    c.want_len[size_t(b)] = slot;
    for (int64_t u = len; u < T; ++u) c.want_map[size_t(b * T + u)] = slot + (u - len);
  }
}

AtmCase atm_case() {
  AtmCase c;
  const int64_t B = c.B, T = c.T, d = c.d;
  std::mt19937_64 rng(3);
  std::normal_distribution<float> n(0.f, 1.f);
  std::bernoulli_distribution dup(0.5);
  c.x.resize(size_t(B * T * d));
  c.pos.resize(size_t(B * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      float* xt = &c.x[size_t((b * T + t) * d)];
      const bool copy = t > 0 && dup(rng);  // a positive multiple of the previous token: s = 1
      for (int64_t j = 0; j < d; ++j) xt[j] = copy ? 2.f * xt[j - d] : n(rng);
      c.pos[size_t(b * T + t)] = 7 * t + b;
    }
  greedy(c);
  return c;
}

struct AtmMerged {
  std::vector<float> merged;
  std::vector<int64_t> mpos, mlen, imap;
};

// atm merge of c.x on the device: x starts at an address ≡ x_phase (mod 16), with
// x_spare_rows tokens of (unread) memory after it.
AtmMerged atm_merge(const AtmCase& c, size_t x_phase = 0, int64_t x_spare_rows = 0) {
  const int64_t B = c.B, T = c.T, d = c.d;
  std::vector<float> xs(c.x);
  xs.resize(xs.size() + size_t(x_spare_rows * d), 0.f);
  const DeviceBuf<float> x(xs, x_phase), merged(c.x.size()), norm_sq(size_t(B * T)), dot(size_t(B * T));
  const DeviceBuf<int64_t> pos(c.pos), lengths(c.lengths), mpos(size_t(B * T)), mlen{size_t(B)}, imap(size_t(B * T)),
      src(size_t(B * T));
  wiola::atm::MergeParams p{x.data(), pos.data(), lengths.data(), 0.5, merged.data(), mpos.data(), mlen.data(),
                            imap.data(), norm_sq.data(), dot.data(), src.data(), B, T, d, wiola::atm::DType::kFloat32};
  if (wiola::atm::launch_merge(p, nullptr) != cudaSuccess) throw std::runtime_error("atm merge launch failed");
  return {merged.vec(), mpos.vec(), mlen.vec(), imap.vec()};
}

bool atm_decisions_right(const AtmCase& c, const AtmMerged& m) {
  return m.imap == c.want_map && m.mlen == c.want_len;
}

bool atm_values_right(const AtmCase& c, const AtmMerged& m) {
  bool values = true;
  for (size_t i = 0; i < c.x.size(); ++i) values = values && m.merged[i] == c.want_merged[i];
  return values;
}

bool atm_positions_right(const AtmCase& c, const AtmMerged& m) {
  const int64_t B = c.B, T = c.T;
  bool positions = true;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      int64_t first = -1;
      for (int64_t u = 0; u < c.lengths[size_t(b)] && first < 0; ++u)
        if (c.want_map[size_t(b * T + u)] == t) first = u;
      const int64_t expect = first < 0 ? 0 : c.pos[size_t(b * T + first)];
      positions = positions && m.mpos[size_t(b * T + t)] == expect;
    }
  return positions;
}

// Every output of the merge: decisions, values, positions.
bool atm_merge_right(const AtmCase& c, const AtmMerged& m) {
  return atm_decisions_right(c, m) && atm_values_right(c, m) && atm_positions_right(c, m);
}

void test_atm_merge(const AtmCase& c, const AtmMerged& m, const std::string& s) {
  check(atm_decisions_right(c, m), s + "atm: index map and merged lengths vs greedy loop");
  check(atm_values_right(c, m), s + "atm: merged values (pair means, zeros after T')");
  check(atm_positions_right(c, m), s + "atm: merged positions");
}

// Flush-to-zero (the device's -ftz=true): a merged pair of subnormal float32 tokens is 0 on
// the device and the exact mean without FTZ; the merge decisions are the same either way
// (atm.cu decides from exact_double and integer bit classes, never from a flushed float).
void test_atm_flush_to_zero() {
  AtmCase c;
  c.B = 1;
  c.T = 6;
  c.d = 8;
  c.lengths = {6};
  std::mt19937_64 rng(9);
  std::normal_distribution<float> n(0.f, 1.f);
  c.x.resize(size_t(c.T * c.d));
  c.pos = {0, 1, 2, 3, 4, 5};
  for (int64_t j = 0; j < c.d; ++j) {
    const float v = 0x1p-140f * float(j % 3 + 1);  // subnormal: 2^-140 .. 3·2^-140
    c.x[size_t(j)] = v;                               // tokens 0, 1: subnormal, parallel (s = 1)
    c.x[size_t(c.d + j)] = 3.f * v;
    c.x[size_t(2 * c.d + j)] = n(rng);               // tokens 2..5: normal, random
    c.x[size_t(3 * c.d + j)] = n(rng);
    c.x[size_t(4 * c.d + j)] = 0x1p-135f * float(j % 2 ? -1 : 1);  // 4, 5: subnormal, antiparallel
    c.x[size_t(5 * c.d + j)] = 0x1p-134f * float(j % 2 ? 1 : -1);
  }
  greedy(c);
  wiola_emu::set_flush_to_zero(false);
  const AtmMerged exact = atm_merge(c);
  wiola_emu::set_flush_to_zero(true);
  const AtmMerged ftz = atm_merge(c);
  wiola_emu::clear_flush_to_zero();
  bool pair_exact = true, pair_zero = true;
  for (int64_t j = 0; j < c.d; ++j) {
    pair_exact = pair_exact && exact.merged[size_t(j)] == c.want_merged[size_t(j)] && exact.merged[size_t(j)] != 0.f;
    pair_zero = pair_zero && ftz.merged[size_t(j)] == 0.f;
  }
  check(c.want_map[1] == 0 && atm_decisions_right(c, exact) && atm_decisions_right(c, ftz),
        "flush-to-zero: merge decisions on subnormal tokens are those of the greedy loop with and without FTZ");
  check(pair_exact && pair_zero,
        "flush-to-zero: a merged pair of subnormal tokens is its exact mean without FTZ and 0 with it (as -ftz=true)");
}

void test_atm(const AtmCase& c, const std::string& s) {
  const int64_t B = c.B, T = c.T, d = c.d;
  const AtmMerged m = atm_merge(c);
  test_atm_merge(c, m, s);
  const std::vector<int64_t>& want_map = c.want_map;
  const std::vector<int64_t>& want_len = c.want_len;
  // Unmerge, merge backward, unmerge backward against loops over the map.
  std::mt19937_64 rng(4);
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<float> gh(c.x.size());
  for (float& v : gh) v = n(rng);
  const DeviceBuf<float> g(gh), restored(c.x.size()), gx(c.x.size()), gy(c.x.size());
  const DeviceBuf<int64_t> imap(m.imap), mlen(m.mlen);
  wiola::atm::UnmergeParams up{g.data(), imap.data(), restored.data(), B, T, d, wiola::atm::DType::kFloat32};
  check(wiola::atm::launch_unmerge(up, nullptr) == cudaSuccess, s + "atm: unmerge launch");
  const DeviceBuf<int> row_sorted{size_t(B)};
  wiola::atm::UnmergeParams ub{g.data(), imap.data(), gy.data(), B, T, d, wiola::atm::DType::kFloat32,
                               row_sorted.data()};
  check(wiola::atm::launch_unmerge_backward(ub, nullptr) == cudaSuccess, s + "atm: unmerge backward launch");
  check(row_sorted.vec() == std::vector<int>(size_t(B), 1), s + "atm: maps from merge are sorted (parallel segments)");
  wiola::atm::MergeBackwardParams mb{g.data(), imap.data(), mlen.data(), gx.data(), B, T, d,
                                     wiola::atm::DType::kFloat32};
  check(wiola::atm::launch_merge_backward(mb, nullptr) == cudaSuccess, s + "atm: merge backward launch");
  const std::vector<float> rh = restored.vec(), gxh = gx.vec(), gyh = gy.vec();
  bool ok_r = true, ok_y = true, ok_x = true;
  std::vector<double> sum(c.x.size(), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t sl = want_map[size_t(b * T + t)];
      const bool paired = (t > 0 && want_map[size_t(b * T + t - 1)] == sl) ||
                          (t + 1 < T && want_map[size_t(b * T + t + 1)] == sl);
      const float w = sl >= want_len[size_t(b)] ? 0.f : (paired ? 0.5f : 1.f);
      for (int64_t j = 0; j < d; ++j) {
        const float gs = gh[size_t((b * T + sl) * d + j)];
        ok_r = ok_r && rh[size_t((b * T + t) * d + j)] == gs;
        ok_x = ok_x && gxh[size_t((b * T + t) * d + j)] == w * gs;
        sum[size_t((b * T + sl) * d + j)] += gh[size_t((b * T + t) * d + j)];
      }
    }
  for (size_t i = 0; i < c.x.size(); ++i) ok_y = ok_y && std::fabs(gyh[i] - sum[i]) <= 1e-5 * (1 + std::fabs(sum[i]));
  check(ok_r, s + "atm: unmerge gathers the slot values");
  check(ok_x, s + "atm: merge backward = w · grad(slot)");
  check(ok_y, s + "atm: unmerge backward = segment sums");
  // Unsorted maps (row 0: a slot in two separate runs; row 1: reversed; row 2: an entry
  // out of range) take the sequential walk; sorted ones with gaps the segments.
  std::vector<int64_t> map2(m.imap);
  std::swap(map2[5], map2[700]);
  for (int64_t t = 0; t < T; ++t) map2[size_t(T + t)] = T - 1 - t;
  for (int64_t t = 0; t < T; ++t) map2[size_t(2 * T + t)] = t < 40 ? 3 : (t < 540 ? 2 * t : T - 1);
  std::vector<int64_t> map3(map2);
  map3[size_t(2 * T + 17)] = T;  // invalid: contributes nothing
  for (const auto* mp : {&map2, &map3}) {
    const DeviceBuf<float> gy2(c.x.size());
    const DeviceBuf<int64_t> dmap(*mp);
    wiola::atm::UnmergeParams u2{g.data(), dmap.data(), gy2.data(), B, T, d, wiola::atm::DType::kFloat32,
                                 row_sorted.data()};
    check(wiola::atm::launch_unmerge_backward(u2, nullptr) == cudaSuccess,
          s + "atm: unmerge backward launch (any map)");
    std::vector<double> want(c.x.size(), 0.0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t sl = (*mp)[size_t(b * T + t)];
        if (sl < 0 || sl >= T) continue;
        for (int64_t j = 0; j < d; ++j) want[size_t((b * T + sl) * d + j)] += gh[size_t((b * T + t) * d + j)];
      }
    const std::vector<float> got = gy2.vec();
    bool ok = true;
    for (size_t i = 0; i < c.x.size(); ++i) ok = ok && std::fabs(got[i] - want[i]) <= 1e-5 * (1 + std::fabs(want[i]));
    const std::vector<int> want_sorted{0, 0, mp == &map2 ? 1 : 0};
    check(row_sorted.vec() == want_sorted, s + "atm: unsorted / invalid rows detected");
    check(ok, s + "atm: unmerge backward = segment sums (unsorted maps, gaps, invalid entries)");
  }
  // x 4 bytes past a 16-byte boundary: the row kernels take their element-wise path.
  test_atm_merge(c, atm_merge(c, 4), s + "x misaligned: ");
}

// ---------------------------------------------------------------------------------
// The emulator itself
// ---------------------------------------------------------------------------------
uint16_t bf16_oracle(float f) {  // nearest bfloat16 by search, ties to the even pattern
  if (std::isnan(f)) return 0x7fff;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
  float a, b;
  std::memcpy(&a, &lo, 4);
  std::memcpy(&b, &hi, 4);
  const double da = std::fabs(double(f) - a);
  const double db = std::isinf(b) && !std::isinf(f) ? INFINITY : std::fabs(double(f) - b);
  if ((u & 0xffffu) == 0) return uint16_t(lo >> 16);
  if ((u & 0x7fffffffu) >= 0x7f7f8000u && (u & 0x7fffffffu) < 0x7f800000u) {  // rounds to ±Inf at/above the midpoint
    return uint16_t((u & 0x80000000u) >> 16 | 0x7f80u);
  }
  if (da < db) return uint16_t(lo >> 16);
  if (db < da) return uint16_t(hi >> 16);
  return uint16_t(((lo >> 16) & 1u) ? hi >> 16 : lo >> 16);
}

void test_conversions() {
  bool half_ok = true, bf_ok = true, back_ok = true;
  std::mt19937 rng(5);
  std::vector<uint32_t> patterns;
  for (uint32_t e = 0; e < 256; ++e)  // every exponent with edge mantissas, both signs
    for (uint32_t m : {0u, 1u, 0xfffu, 0x1000u, 0x1001u, 0x2000u, 0x3000u, 0x7fffu, 0x8000u, 0x8001u, 0x18000u,
                       0x7fffffu, 0x400000u})
      for (uint32_t s : {0u, 1u}) patterns.push_back(s << 31 | e << 23 | m);
  for (int i = 0; i < 2000000; ++i) patterns.push_back(rng());
  for (uint32_t u : patterns) {
    float f;
    std::memcpy(&f, &u, 4);
    const __half h = __float2half_rn(f);
    const _Float16 ref = static_cast<_Float16>(f);
    uint16_t rb;
    std::memcpy(&rb, &ref, 2);
    if (std::isnan(f) ? h.bits != 0x7fff : h.bits != rb) {
      if (half_ok) std::printf("  half(%a): got 0x%04x want 0x%04x\n", double(f), h.bits, rb);
      half_ok = false;
    }
    const uint16_t bw = bf16_oracle(f);
    if (__float2bfloat16_rn(f).bits != bw) {
      if (bf_ok) std::printf("  bf16(%a): got 0x%04x want 0x%04x\n", double(f), __float2bfloat16_rn(f).bits, bw);
      bf_ok = false;
    }
  }
  for (uint32_t v = 0; v < 65536; ++v) {  // every half / bfloat16 to float, exactly
    _Float16 hf;
    const uint16_t b16 = uint16_t(v);
    std::memcpy(&hf, &b16, 2);
    const float want = static_cast<float>(hf), got = __half2float(__half{b16});
    back_ok = back_ok && (std::isnan(want) ? std::isnan(got) : std::memcmp(&want, &got, 4) == 0);
    const uint32_t bu = v << 16;
    float bw;
    std::memcpy(&bw, &bu, 4);
    const float bg = __bfloat162float(__nv_bfloat16{b16});
    back_ok = back_ok && std::memcmp(&bw, &bg, 4) == 0;
  }
  check(half_ok, "float -> half round-to-nearest-even (vs the compiler's _Float16)");
  check(bf_ok, "float -> bfloat16 round-to-nearest-even (vs nearest-value search)");
  check(back_ok, "half / bfloat16 -> float exact for all 65536 patterns");
}

__global__ void collectives_kernel(int* out) {
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  int* o = out + (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  const int v = 100 * warp + lane;
  o[0] = __shfl_sync(0xffffffffu, v, 5);
  o[1] = __shfl_xor_sync(0xffffffffu, v, 3);
  o[2] = __shfl_down_sync(0xffffffffu, v, 4);
  o[3] = __shfl_up_sync(0xffffffffu, v, 2, 16);
  o[4] = static_cast<int>(__ballot_sync(0xffffffffu, lane % 3 == 0));
  o[5] = __any_sync(0xffffffffu, lane == 17) + 2 * __all_sync(0xffffffffu, lane < 40);
  if (lane < 16) o[6] = __shfl_xor_sync(0x0000ffffu, v, 8);  // a half-warp collective with its own mask
  else o[6] = __shfl_xor_sync(0xffff0000u, v, 1);
  __syncwarp();
  o[7] = static_cast<int>(blockIdx.x);
}

__global__ void reverse_kernel(const float* in, float* out, int n) {
  __shared__ float s[256];
  s[threadIdx.x] = in[blockIdx.x * n + threadIdx.x];
  __syncthreads();
  out[blockIdx.x * n + threadIdx.x] = s[n - 1 - threadIdx.x];
}

__global__ void half_warp_shuffle_kernel(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x % 32 < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);  // lanes 16-31 never come
  out[threadIdx.x] = v;
}

__global__ void half_warp_then_barrier_kernel(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x % 32 < 16) v = __shfl_sync(0xffffffffu, v, 0);
  __syncthreads();
  out[threadIdx.x] = v;
}

__global__ void early_exit_barrier_kernel(float* out) {
  if (threadIdx.x >= 64) return;
  __syncthreads();
  out[threadIdx.x] = 1.f;
}

void test_emulator() {
  const int blocks = 3, threads = 96;
  std::vector<int> out(size_t(blocks * threads * 8), -1);
  wiola::cuda::launch_kernel(collectives_kernel, blocks, threads, 0, nullptr, out.data());
  bool ok = cudaGetLastError() == cudaSuccess;
  for (int i = 0; i < blocks * threads; ++i) {
    const int lane = i % 32, warp = (i % threads) / 32, v = 100 * warp + lane;
    const int* o = &out[size_t(i) * 8];
    unsigned ballot = 0;
    for (int l = 0; l < 32; l += 3) ballot |= 1u << l;
    const int up = (lane % 16) >= 2 ? v - 2 : v;
    ok = ok && o[0] == 100 * warp + 5 && o[1] == 100 * warp + (lane ^ 3) && o[2] == (lane + 4 < 32 ? v + 4 : v) &&
         o[3] == up && unsigned(o[4]) == ballot && o[5] == 3 &&
         o[6] == 100 * warp + (lane < 16 ? lane ^ 8 : lane ^ 1) && o[7] == i / threads;
  }
  check(ok, "warp collectives: shfl / xor / down / up(width 16) / ballot / any / all / per-half masks");
  std::vector<float> in(4 * 200), rev(4 * 200, NAN);
  for (size_t i = 0; i < in.size(); ++i) in[i] = float(i);
  wiola::cuda::launch_kernel(reverse_kernel, 4, 200, 0, nullptr, in.data(), rev.data(), 200);
  bool rev_ok = true;
  for (int b = 0; b < 4; ++b)
    for (int t = 0; t < 200; ++t) rev_ok = rev_ok && rev[size_t(b * 200 + t)] == in[size_t(b * 200 + 199 - t)];
  check(rev_ok, "__syncthreads orders shared memory (block reverse)");

  std::vector<float> buf(128, 0.f);
  std::string f =
      fault_of([&] { wiola::cuda::launch_kernel(half_warp_shuffle_kernel, 1, 64, 0, nullptr, buf.data()); });
  std::printf("  reported: %s\n", f.c_str());
  check(f.find("__shfl_xor_sync(mask 0xffffffff)") != std::string::npos && f.find("exited") != std::string::npos,
        "a shuffle called by half a warp is reported (lanes exit)");
  f = fault_of([&] { wiola::cuda::launch_kernel(half_warp_then_barrier_kernel, 1, 64, 0, nullptr, buf.data()); });
  std::printf("  reported: %s\n", f.c_str());
  check(f.find("never arrived (it waits at __syncthreads)") != std::string::npos,
        "a shuffle called by half a warp is reported (lanes wait at a barrier)");
  f = fault_of([&] { wiola::cuda::launch_kernel(early_exit_barrier_kernel, 1, 128, 0, nullptr, buf.data()); });
  std::printf("  reported: %s\n", f.c_str());
  check(f.find("__syncthreads reached by 64 of 128 threads") != std::string::npos,
        "__syncthreads after some threads exited is reported");
  wiola::cuda::launch_kernel(reverse_kernel, 1, 2048, 0, nullptr, in.data(), rev.data(), 200);
  check(cudaGetLastError() == cudaErrorInvalidConfiguration, "a block of 2048 threads is refused");
  wiola::cuda::launch_kernel(reverse_kernel, 1, 32, 64 * 1024, nullptr, in.data(), rev.data(), 32);
  check(cudaGetLastError() == cudaErrorInvalidValue,
        "64 KB of dynamic shared memory without cudaFuncSetAttribute is refused");
}

// Each thread appends its index to the block's log, twice, with a barrier between: the
// order the schedule gave (deliberately racy: not run under TSan).
__global__ void order_kernel(int* log, int* count) {
  int* l = log + blockIdx.x * 2 * blockDim.x;
  int* n = count + blockIdx.x;
  l[(*n)++] = static_cast<int>(threadIdx.x);
  __syncthreads();
  l[(*n)++] = static_cast<int>(threadIdx.x);
}

__global__ void copy_kernel(const float* in, float* out, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = in[i];
}

__global__ void vector_copy_kernel(const float* in, float* out) {  // 16 bytes per thread
  using V = wiola::cuda::Words<16>;
  wiola::cuda::vector_cast<V>(out)[threadIdx.x] = wiola::cuda::vector_cast<const V>(in)[threadIdx.x];
}

__global__ void halve_kernel(const float* in, float* out) { out[threadIdx.x] = in[threadIdx.x] * 0.5f; }

std::vector<int> run_order(const std::string& schedule, int blocks, int threads) {
  wiola_emu::set_schedule(wiola_emu::parse_schedule(schedule));
  const DeviceBuf<int> log(size_t(blocks * threads * 2)), count(std::vector<int>(size_t(blocks), 0));
  wiola::cuda::launch_kernel(order_kernel, blocks, threads, 0, nullptr, log.data(), count.data());
  wiola_emu::clear_schedule();
  return log.vec();
}

// The emulator's harsh modes: schedules, guard pages, alignment, flush-to-zero.
void test_emulator_checks() {
  bool parse_ok = wiola_emu::schedule_name(wiola_emu::parse_schedule("shuffle:42")) == "shuffle:42" &&
                  wiola_emu::parse_schedule("reverse").kind == wiola_emu::Schedule::kReverse;
  for (const char* bad : {"shuffle", "shuffle:", "shuffle:x1", "backwards", ""}) {
    try {
      wiola_emu::parse_schedule(bad);
      parse_ok = false;
    } catch (const std::invalid_argument&) {
    }
  }
  setenv("WIOLA_EMU_SCHEDULE", "shuffle:7", 1);
  parse_ok = parse_ok && wiola_emu::schedule_name(wiola_emu::current_schedule()) == "shuffle:7";
  unsetenv("WIOLA_EMU_SCHEDULE");
  check(parse_ok && wiola_emu::current_schedule().kind == wiola_emu::Schedule::kForward,
        "schedules: forward | reverse | shuffle:<seed>, from set_schedule or WIOLA_EMU_SCHEDULE");
#if !defined(__SANITIZE_THREAD__)
  const int threads = 64;
  const std::vector<int> fwd = run_order("forward", 2, threads), rev = run_order("reverse", 2, threads);
  const std::vector<int> sh = run_order("shuffle:5", 2, threads), sh2 = run_order("shuffle:5", 2, threads);
  const std::vector<int> sh3 = run_order("shuffle:6", 2, threads);
  bool fwd_ok = true, rev_ok = true, perm_ok = true;
  for (int b = 0; b < 2; ++b)
    for (int r = 0; r < 2; ++r)
      for (int i = 0; i < threads; ++i) {
        const size_t k = size_t((b * 2 + r) * threads + i);
        fwd_ok = fwd_ok && fwd[k] == i;
        rev_ok = rev_ok && rev[k] == threads - 1 - i;
      }
  for (int part = 0; part < 4; ++part) {  // each (block, round) of the shuffle: a permutation
    std::vector<int> v(sh.begin() + part * threads, sh.begin() + (part + 1) * threads);
    std::sort(v.begin(), v.end());
    for (int i = 0; i < threads; ++i) perm_ok = perm_ok && v[size_t(i)] == i;
  }
  const auto part = [&](const std::vector<int>& v, int k) {
    return std::vector<int>(v.begin() + k * threads, v.begin() + (k + 1) * threads);
  };
  check(fwd_ok && rev_ok, "schedules: forward runs thread 0 first, reverse the last thread first");
  check(perm_ok && sh == sh2 && sh != sh3 && part(sh, 0) != part(sh, 1) && part(sh, 0) != part(sh, 2) &&
            part(sh, 0) != part(fwd, 0) && part(sh, 0) != part(rev, 0),
        "schedules: shuffle:<seed> is a fresh permutation per block and meeting point, reproducible from the seed");

  // Guard pages: a read one element past the end of a buffer whose size is a multiple of
  // 16 bytes faults; a write into the < 16 bytes between a buffer and its guard is found
  // after the launch.
  const DeviceBuf<float> in(std::vector<float>(100, 1.f)), out(100), out99(99);
  std::string f = fault_of([&] { wiola::cuda::launch_kernel(copy_kernel, 1, 128, 0, nullptr, in.data(), out.data(), 101); });
  std::printf("  reported: %s\n", f.c_str());
  check(f.find("illegal memory access") != std::string::npos &&
            f.find("0 bytes past the end of a 400-byte device buffer") != std::string::npos,
        "guard pages: a read one element past the end of a device buffer is a device fault");
  f = fault_of([&] { wiola::cuda::launch_kernel(copy_kernel, 1, 128, 0, nullptr, in.data(), out99.data(), 100); });
  std::printf("  reported: %s\n", f.c_str());
  check(f.find("wrote past the end of a 396-byte device buffer") != std::string::npos,
        "guard pages: a write between a buffer's end and its guard page is a device fault");
  f = fault_of([&] { wiola::cuda::launch_kernel(copy_kernel, 1, 32, 0, nullptr, static_cast<const float*>(nullptr),
                                                out.data(), 32); });
  check(f.find("illegal memory access (SIGSEGV) at (nil)") != std::string::npos || f.find("at 0x0") != std::string::npos,
        "a kernel's memory fault anywhere is a device fault of the launch, not the end of the process");

  // Vector accesses must be aligned to their size.
  const DeviceBuf<float> vin(std::vector<float>(64, 2.f), 4), vout(64), ain(std::vector<float>(64, 2.f));
  f = fault_of([&] { wiola::cuda::launch_kernel(vector_copy_kernel, 1, 16, 0, nullptr, vin.data(), vout.data()); });
  std::printf("  reported: %s\n", f.c_str());
  wiola::cuda::launch_kernel(vector_copy_kernel, 1, 16, 0, nullptr, ain.data(), vout.data());
  check(f.find("misaligned 16-byte vector access") != std::string::npos && vout.vec() == std::vector<float>(64, 2.f),
        "vector_cast: a misaligned 16-byte access is a device fault, an aligned one copies");
  // What the GCLA binding's alignment checks keep from the kernels: a q that starts 4 bytes
  // past an 8-byte boundary (a view at an element offset) faults on its first 8-byte load.
  GclaCase small;
  small.T = 5;
  small.lengths = {5, 3};
  const GclaInputs gin = random_gcla(small, 3);
  f = fault_of([&] { gcla_kernels(small, gin, std::vector<double>(gcla_size(small, 0), 1.0), 4); });
  std::printf("  reported: %s\n", f.c_str());
  check(f.find("misaligned 8-byte vector access") != std::string::npos,
        "gcla summary kernels: a misaligned q (d_h 64, float32: 8-byte loads) is a device fault");
#endif
  // Flush-to-zero: a result that would be subnormal is 0.
  const DeviceBuf<float> sub(std::vector<float>{0x1p-130f, 0x1p-126f, 3.f, -0x1p-149f}), half(4);
  wiola_emu::set_flush_to_zero(false);
  wiola::cuda::launch_kernel(halve_kernel, 1, 4, 0, nullptr, sub.data(), half.data());
  const std::vector<float> ieee = half.vec();
  wiola_emu::set_flush_to_zero(true);
  wiola::cuda::launch_kernel(halve_kernel, 1, 4, 0, nullptr, sub.data(), half.data());
  const std::vector<float> ftz = half.vec();
  wiola_emu::clear_flush_to_zero();
  check(ieee == std::vector<float>{0x1p-131f, 0x1p-127f, 1.5f, -0.f} && ftz == std::vector<float>{0.f, 0.f, 1.5f, -0.f} &&
            !std::signbit(ftz[0]),
        "flush-to-zero: x/2 of subnormal and smallest-normal x is subnormal in IEEE mode, 0 under FTZ");
}

void plant(wiola_plant::Flag flag) { wiola_plant::host_flags[flag] = true; }

// Kernels with a bug of csrc/tests/planted_bugs.py planted (csrc/tests/planted.h): each mode
// switches one on and returns 0 only if the emulator catches it, printing how.
int planted_main(const std::string& mode) {
#if defined(__SANITIZE_THREAD__)  // TSan reports a race whatever the order
  const std::vector<std::string> orders{"shuffle:1"};
#else
  const std::vector<std::string> orders{"forward", "reverse", "shuffle:1", "shuffle:2", "shuffle:3"};
#endif
  if (mode == "missing-sync") {
    // gcla_attention.cu's summary backward without the barrier between the warps' partial
    // sums and thread 0's sum of them.
    GclaCase c;
    const GclaInputs in = random_gcla(c, 1);
    std::vector<double> go(gcla_size(c, 0), 1.0);
    const GclaOracle want = gcla_oracle(c, in, &go);
    const GclaRun good = gcla_kernels(c, in, go);
    if (!(std::max(rel_err(good.dgate, want.dgate), rel_err(good.dkc, want.dkc)) < 2e-5)) return 2;
    plant(wiola_plant::kMissingSync);
    std::string wrong;
    for (const std::string& order : orders) {
      wiola_emu::set_schedule(wiola_emu::parse_schedule(order));
      const GclaRun r = gcla_kernels(c, in, go);
      const double err = std::max(rel_err(r.dgate, want.dgate), rel_err(r.dkc, want.dkc));
      std::printf("backward without a __syncthreads, %s order: relative error %.3g\n", order.c_str(), err);
      if (!(err < 2e-5)) wrong += " " + order;
    }
    if (wrong.empty()) {
      std::printf("missing barrier NOT detected by the result\n");
      return 1;
    }
    std::printf("missing barrier detected: wrong result under%s\n", wrong.c_str());
    return 0;
  }
  if (mode == "divergent-barrier") {
    // The S = 1 backward with the barrier between the halves' sums inside the writing half:
    // the reading half waits at the next __syncthreads (undefined on the device; synccheck).
    GclaCase c;  // S = 1
    const GclaInputs in = random_gcla(c, 1);
    std::vector<double> go(gcla_size(c, 0), 1.0);
    if (!(rel_err(gcla_kernels(c, in, go).dkc, gcla_oracle(c, in, &go).dkc) < 2e-5)) return 2;
    plant(wiola_plant::kDivergentBarrier);
    const std::string f = fault_of([&] { gcla_kernels(c, in, go); });
    std::printf("S = 1 backward with a barrier in divergent code: %s\n", f.empty() ? "no fault" : f.c_str());
    if (f.find("__syncthreads in divergent code") == std::string::npos) return 1;
    std::printf("divergent barrier detected\n");
    return 0;
  }
  if (mode == "unwritten-partial") {
    // The backward without a gate partial from blocks whose rows are all padding (rows 64..69
    // of the second batch row, length 23): dgate_kernel reads never-written memory, which the
    // emulator's device memory holds as 0xFF bytes (NaN); initcheck on the device.
    GclaCase c;
    c.T = 70;
    c.lengths = {70, 23};
    const GclaInputs in = random_gcla(c, 1);
    std::vector<double> go(gcla_size(c, 0), 1.0);
    const GclaOracle want = gcla_oracle(c, in, &go);
    if (!(rel_err(gcla_kernels(c, in, go).dgate, want.dgate) < 2e-5)) return 2;
    plant(wiola_plant::kUnwrittenPartial);
    const GclaRun r = gcla_kernels(c, in, go);
    bool finite = true;
    for (float g : r.dgate) finite = finite && std::isfinite(g);
    std::printf("dgate with unwritten partials: %s (relative error %.3g)\n", finite ? "finite" : "NaN",
                rel_err(r.dgate, want.dgate));
    if (finite) return 1;
    std::printf("read of a never-written partial detected (NaN from poisoned device memory)\n");
    return 0;
  }
  const AtmCase c = atm_case();
  if (!atm_merge_right(c, atm_merge(c))) return 2;  // the copy without its plant
  if (mode == "select-race") {
    // atm.cu's select_kernel reading the taken flags of the thread before without the
    // barrier after they are written: right in forward order (that thread ran first).
    plant(wiola_plant::kSelectRace);
    std::string wrong;
    for (const std::string& order : orders) {
      wiola_emu::set_schedule(wiola_emu::parse_schedule(order));
      const bool right = atm_merge_right(c, atm_merge(c));
      std::printf("select without a __syncthreads, %s order: %s\n", order.c_str(), right ? "right" : "WRONG");
      if (!right) wrong += " " + order;
    }
    if (wrong.empty()) {
      std::printf("race NOT detected by the result\n");
      return 1;
    }
    std::printf("race detected: wrong result under%s\n", wrong.c_str());
    return 0;
  }
  if (mode == "overrun") {
    // norms_and_dots reading a look-ahead token after the last one of a row: the row after
    // it, never used (right results), or — for the last row — past the end of x.
    plant(wiola_plant::kLookAhead);
    const bool right = atm_merge_right(c, atm_merge(c, 0, 1));
    std::printf("overrun with a spare token after x: results %s\n", right ? "right (the bug hides)" : "WRONG");
    const std::string f = fault_of([&] { atm_merge(c); });
    std::printf("overrun with x ending at a guard page: %s\n", f.empty() ? "no fault" : f.c_str());
    if (f.find("past the end of a") == std::string::npos) return 1;
    std::printf("overrun detected\n");
    return 0;
  }
  if (mode == "misaligned") {
    // rows_vectorizable without its base-address test: 16-byte chunks of an x that starts
    // 4 bytes past a 16-byte boundary (x86 would load them quietly).
    plant(wiola_plant::kIgnoreAlignment);
    const bool right = atm_merge_right(c, atm_merge(c));
    std::printf("16-byte chunks with an aligned x: %s\n", right ? "right" : "WRONG");
    const std::string f = fault_of([&] { atm_merge(c, 4); });
    std::printf("16-byte chunks with x at 4 mod 16: %s\n", f.empty() ? "no fault" : f.c_str());
    if (f.find("misaligned 16-byte vector access") == std::string::npos) return 1;
    std::printf("misaligned access detected\n");
    return 0;
  }
  std::printf("unknown mode %s\n", mode.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "all";
  if (mode != "all" && mode != "quick") return planted_main(mode);
  quick = mode == "quick";
  // The thread orders every kernel runs under (one under TSan, whose reports do not depend on it).
  const std::vector<std::string> orders = quick ? std::vector<std::string>{"shuffle:11"}
                                                : std::vector<std::string>{"forward", "reverse", "shuffle:1", "shuffle:2"};
  schedules = &orders;
  test_emulator();
  test_emulator_checks();
  if (!quick) test_conversions();
  GclaCase paper;  // S = 1, permuted heads (H 4, H_kv 2), two 64-row chunks, lengths
  paper.T = 70;
  paper.lengths = {70, 23};
  test_gcla(paper, "gcla summary S=1 L=2 T=70 dh=64 H=4 Hkv=2");
  GclaCase causal;  // S = T, d_h 128, H/H_kv = 3 (permuted), a row of length 1
  causal.S = causal.T = 33;
  causal.L = 1;
  causal.H = 6;
  causal.Hkv = 3;
  causal.dh = 128;
  causal.lengths = {33, 1};
  test_gcla(causal, "gcla summary S=T L=1 T=33 dh=128 H=6 Hkv=3");
  GclaCase plain;  // Λ' = 0: the output is O^self, identity head order
  plain.L = 0;
  plain.Hkv = 1;
  test_gcla(plain, "gcla summary L=0 T=40 dh=64 H=4 Hkv=1");
  const AtmCase atm = atm_case();
  for (const std::string& order : orders) {
    wiola_emu::set_schedule(wiola_emu::parse_schedule(order));
    test_atm(atm, "[" + order + "] ");
  }
  wiola_emu::clear_schedule();
  test_atm_flush_to_zero();
  std::printf("%s (%d failures)\n", failures ? "FAILED" : "PASSED", failures);
  return failures ? 1 : 0;
}
