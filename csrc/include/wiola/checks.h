// Argument checks at the kernels' entries: every C++ kernel of a public op (csrc/cpu/*.cpp,
// csrc/cuda/*_binding.cpp) validates its inputs here, once per call, and nowhere else on its
// path. Failures raise c10::ValueError / c10::TypeError (Python ValueError / TypeError) whose
// messages name the argument and the expected shape — the same words as each op's check_<op>
// (wiola_kernels/ops/<op>.py), which checks the kernels written in Python (reference, Triton,
// the fakes), so every backend refuses a bad input alike (tests/test_op_layer.py compares them).
// Host code with ATen; never included by a .cu file.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/util/Exception.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

namespace wiola::checks {

// "float32", as Python spells str(dtype) without "torch.".
inline const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(t);
  }
}

// A shape as a Python tuple: "(2, 3)", "(3,)", "()".
inline std::string shape_str(at::IntArrayRef sizes) {
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(sizes[i]);
  }
  if (sizes.size() == 1) s += ",";
  return s + ")";
}

// A float as Python's repr prints it ("1e-06", "0.0", "nan", "inf").
inline std::string float_repr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), v);
  std::string s(buf, res.ptr);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

inline const char* kFloatDtypes = "float32, float64, bfloat16, float16";
inline const char* kIndexDtypes = "int64, int32, int16, uint8";

// t is a float tensor (float32, float64, bfloat16, float16).
inline void float_tensor(const char* name, const at::Tensor& t) {
  const auto s = t.scalar_type();
  TORCH_CHECK_TYPE(s == at::kFloat || s == at::kDouble || s == at::kBFloat16 || s == at::kHalf, name,
                   " must have dtype in (", kFloatDtypes, "), got ", dtype_name(s));
}

// t is an integer index tensor (position_ids, lengths).
inline void index_tensor(const char* name, const at::Tensor& t) {
  const auto s = t.scalar_type();
  TORCH_CHECK_TYPE(s == at::kLong || s == at::kInt || s == at::kShort || s == at::kByte, name,
                   " must have dtype in (", kIndexDtypes, "), got ", dtype_name(s));
}

// "got (2, 3)", or "got a 0-d tensor (a scalar)".
inline std::string got(const at::Tensor& t) {
  return t.dim() == 0 ? std::string("a 0-d tensor (a scalar)") : shape_str(t.sizes());
}

// t.dim() == rank; layout spells the expected shape, e.g. "(B, T, d)".
inline void rank(const char* name, const at::Tensor& t, int64_t r, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == r, name, " must have shape ", layout, " (", r, "-D), got ", got(t));
}

// t.dim() >= r: an open range such as (..., d).
inline void min_rank(const char* name, const at::Tensor& t, int64_t r, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() >= r, name, " must have shape ", layout, " (at least ", r, " dimension",
                    r > 1 ? "s" : "", "), got ", got(t));
}

inline void shape(const char* name, const at::Tensor& t, at::IntArrayRef expected, const char* layout) {
  TORCH_CHECK_VALUE(t.sizes() == expected, name, " must have shape ", layout, " = ", shape_str(expected), ", got ",
                    shape_str(t.sizes()));
}

inline void same_device(const char* name, const at::Tensor& t, const char* like_name, const at::Tensor& like) {
  TORCH_CHECK_VALUE(t.device() == like.device(), name, " must be on ", like.device(), " like ", like_name, ", got ",
                    t.device());
}

inline void same_dtype(const char* name, const at::Tensor& t, const char* like_name, const at::Tensor& like) {
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), name, " must have dtype torch.",
                   dtype_name(like.scalar_type()), " like ", like_name, ", got torch.", dtype_name(t.scalar_type()));
}

inline double positive(const char* name, double v) {
  TORCH_CHECK_VALUE(v > 0.0 && std::isfinite(v), name, " must be a finite number > 0, got ", float_repr(v));
  return v;
}

inline double finite(const char* name, double v) {
  TORCH_CHECK_VALUE(std::isfinite(v), name, " must be finite, got ", float_repr(v));
  return v;
}

// Values are read only on CPU tensors: on a GPU a check is a device sync per call (the CUDA
// kernels clamp instead; docs/ops.md, bad input).
inline bool reads_values(const at::Tensor& t) { return t.is_cpu() && t.numel() > 0; }

// "; these look like (B, T, H, d_h) = …" when 4-D attention tensors agree read as
// (B, T, H, d_h) — the layout of Linear(x).view(B, T, H, d_h) — instead of (B, H, T, d_h):
// same B, T, d_h, query heads a multiple of each other tensor's, and T equal to t when
// given (t < 0: not given). "" when they do not, so the hint never points the wrong way.
inline std::string bthd_hint(const at::Tensor& queries, std::initializer_list<const at::Tensor*> others,
                             int64_t t = -1) {
  if (queries.dim() != 4) return "";
  const int64_t b = queries.size(0), seq = queries.size(1), h = queries.size(2), dh = queries.size(3);
  for (const at::Tensor* x : others) {
    if (x->dim() != 4) return "";
    if (x->size(0) != b || x->size(1) != seq || x->size(3) != dh || x->size(2) == 0 || h % x->size(2)) return "";
  }
  if (t >= 0 && t != seq) return "";
  return "; these look like (B, T, H, d_h) = " + shape_str(queries.sizes()) +
         ", but the layout is (B, H, T, d_h) (heads before time): pass .transpose(1, 2) of each";
}

// d_h even and > 0 (rotate-half pairs).
inline void head_dim(const char* name, int64_t dh) {
  TORCH_CHECK_VALUE(dh != 0 && dh % 2 == 0, name, " must have an even, non-zero head dim d_h (last dim), got d_h = ",
                    dh);
}

struct QueryKeyDims {
  int64_t B, H, H_kv, T, dh;
};

// q (B, H, T, d_h), k (B, H_kv, T, d_h), H a multiple of H_kv, d_h even.
inline QueryKeyDims query_key(const char* q_name, const at::Tensor& q, const char* k_name, const at::Tensor& k) {
  rank(q_name, q, 4, "(B, H, T, d_h)");
  rank(k_name, k, 4, "(B, H_kv, T, d_h)");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), dh = q.size(3);
  TORCH_CHECK_VALUE(k.size(0) == B && k.size(2) == T && k.size(3) == dh, k_name, " must have shape (B, H_kv, T, d_h) = (",
                    B, ", H_kv, ", T, ", ", dh, ") to match ", q_name, ", got ", shape_str(k.sizes()),
                    bthd_hint(q, {&k}));
  const int64_t H_kv = k.size(1);
  TORCH_CHECK_VALUE(H_kv != 0 && H % H_kv == 0, q_name, "'s heads H = ", H, " (dim 1) must be a multiple of ", k_name,
                    "'s heads H_kv = ", H_kv, " (dim 1)", bthd_hint(q, {&k}));
  head_dim(q_name, dh);
  return {B, H, H_kv, T, dh};
}

// position_ids of an op over (B, T) tokens: (B, T), (1, T) or (T,) of an index dtype.
// Returns an int64 (B, T) view (expanded, not copied, when shared by the batch).
inline at::Tensor position_ids(const at::Tensor& p, int64_t B, int64_t T, const std::string& hint = "") {
  index_tensor("position_ids", p);
  const bool ok = (p.dim() == 2 && (p.size(0) == B || p.size(0) == 1) && p.size(1) == T) ||
                  (p.dim() == 1 && p.size(0) == T);
  TORCH_CHECK_VALUE(ok, "position_ids must have shape (B, T) = (", B, ", ", T, "), (1, T) = (1, ", T,
                    ") or (T,) = (", T, ",), got ", shape_str(p.sizes()), hint);
  const at::Tensor p64 = p.scalar_type() == at::kLong ? p : p.to(at::kLong);
  return p64.dim() == 2 && p64.size(0) == B ? p64 : p64.expand({B, T});
}

// min and max of a non-empty CPU int64 tensor of at most 2 dimensions, read through its
// strides (an expanded (1, T) position row is not copied).
inline std::pair<int64_t, int64_t> min_max(const at::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.dim() <= 2 && t.numel() > 0 && t.scalar_type() == at::kLong);
  const int64_t rows = t.dim() == 2 ? t.size(0) : 1, cols = t.dim() == 0 ? 1 : t.size(-1);
  const int64_t sr = t.dim() == 2 ? t.stride(0) : 0, sc = t.dim() == 0 ? 0 : t.stride(-1);
  const int64_t* p = t.const_data_ptr<int64_t>();
  int64_t lo = p[0], hi = p[0];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) lo = std::min(lo, p[r * sr + c * sc]), hi = std::max(hi, p[r * sr + c * sc]);
  }
  return {lo, hi};
}

// Optional per-row lengths (B,) of an index dtype with values in [0, T] (values checked on
// CPU tensors). Returns int64 (B,) contiguous, or nullopt.
inline std::optional<at::Tensor> lengths(const std::optional<at::Tensor>& lengths, int64_t B, int64_t T) {
  if (!lengths.has_value()) return std::nullopt;
  index_tensor("lengths", *lengths);
  shape("lengths", *lengths, {B}, "(B,)");
  at::Tensor l = lengths->to(at::kLong).contiguous();  // (B,): nothing to speak of
  if (reads_values(l)) {
    const auto [lo, hi] = min_max(l);
    TORCH_CHECK_VALUE(lo >= 0 && hi <= T, "lengths must lie in [0, T] = [0, ", T, "], got values in [", lo, ", ", hi,
                      "]");
  }
  return l;
}

// An ATM index_map: int64 (B, T) matching `like`'s first two dims, values in [0, T).
inline void index_map(const at::Tensor& m, int64_t B, int64_t T, const char* like) {
  TORCH_CHECK_TYPE(m.scalar_type() == at::kLong, "index_map must have dtype in (int64), got ",
                   dtype_name(m.scalar_type()));
  TORCH_CHECK_VALUE(m.dim() == 2 && m.size(0) == B && m.size(1) == T, "index_map must have shape (B, T) = (", B, ", ",
                    T, ") to match ", like, ", got ", shape_str(m.sizes()));
  if (reads_values(m)) {
    const auto [lo, hi] = min_max(m);
    TORCH_CHECK_VALUE(lo >= 0 && hi < T, "index_map values must lie in [0, T) = [0, ", T, "), got values in [", lo,
                      ", ", hi, "]");
  }
}

// x itself when its last dimension has stride 1 (the one layout the strided kernels cannot
// read otherwise), else a contiguous copy; an empty tensor with odd strides becomes a fresh
// contiguous one (its .contiguous() keeps the strides).
inline at::Tensor unit_last_stride(const at::Tensor& x) {
  if (x.dim() == 0 || x.size(-1) <= 1 || x.stride(-1) == 1) return x;
  if (x.numel() == 0) return at::empty(x.sizes(), x.options());
  return x.contiguous();
}

// ---------------------------------------------------------------------------------
// One function per public op, called by each of its C++ kernels (CPU, CUDA) at entry.
// ---------------------------------------------------------------------------------

// wiola::rms_norm: x (..., d), weight (d,), shift (d,) or None.
inline void rms_norm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& shift) {
  float_tensor("x", x);
  float_tensor("weight", weight);
  if (shift.has_value()) float_tensor("shift", *shift);
  min_rank("x", x, 1, "(..., d)");
  const int64_t d = x.size(-1);
  shape("weight", weight, {d}, "(d,)");
  if (shift.has_value()) shape("shift", *shift, {d}, "(d,)");
  same_device("weight", weight, "x", x);
  if (shift.has_value()) same_device("shift", *shift, "x", x);
  TORCH_CHECK_VALUE(d != 0, "x must have a non-empty last dimension d, got d = 0");
}

// wiola::add_rms_norm: x (..., d), residual of x's shape, dtype and device, then the checks of
// rms_norm on x.
inline void add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                         const std::optional<at::Tensor>& shift) {
  float_tensor("x", x);
  float_tensor("residual", residual);
  min_rank("x", x, 1, "(..., d)");
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes(), "residual must have the shape of x (..., d) = ",
                    shape_str(x.sizes()), ", got ", shape_str(residual.sizes()));
  same_dtype("residual", residual, "x", x);
  same_device("residual", residual, "x", x);
  rms_norm(x, weight, shift);
}

// The gated activations of wiola::glu (SPEC §10.2).
enum class GluActivation { kSilu, kGeluTanh };

// wiola::glu: a (..., n) and b of a's shape, dtype and device; or b absent and a (..., 2n),
// holding [a | b] (the packed form). activation "silu" or "gelu_tanh". Returns the activation.
inline GluActivation glu(const at::Tensor& a, const std::optional<at::Tensor>& b, c10::string_view activation) {
  float_tensor("a", a);
  if (b.has_value()) float_tensor("b", *b);
  min_rank("a", a, 1, b.has_value() ? "(..., n)" : "(..., 2n)");
  if (b.has_value()) {
    TORCH_CHECK_VALUE(b->sizes() == a.sizes(), "b must have the shape of a (..., n) = ", shape_str(a.sizes()),
                      ", got ", shape_str(b->sizes()));
    same_dtype("b", *b, "a", a);
    same_device("b", *b, "a", a);
  } else {
    TORCH_CHECK_VALUE(a.size(-1) % 2 == 0, "a must have an even last dimension 2n when b is None (a holds [a | b]), "
                      "got ", a.size(-1));
  }
  if (activation == "silu") return GluActivation::kSilu;
  TORCH_CHECK_VALUE(activation == "gelu_tanh", "activation must be 'silu' or 'gelu_tanh', got '",
                    std::string(activation), "'");
  return GluActivation::kGeluTanh;
}

// Largest |p| at which float32 SRPE outputs still meet SPEC §9's 1e-5: the float64 angle
// p·ω_j·(1 + 1/k_s) carries ~p·max_j ω_j·|1 + 1/k_s|·2^-52 rad of rounding
// (wiola_kernels.ops.srpe.srpe_max_position). max_frequency: max_j |ω_j| (1 for θ₀^(−2j/d_h)).
inline int64_t srpe_max_position(double spiral_divisor, double max_frequency = 1.0) {
  const double factor = std::abs(1.0 + 1.0 / spiral_divisor) * max_frequency;
  constexpr double kExact = 9007199254740992.0;  // 2^53: int64 -> float64 exact below it
  return factor == 0.0 ? int64_t(kExact) : int64_t(std::min(kExact, std::floor(1e-5 * 4503599627370496.0 / factor)));
}

// SRPE's given frequencies (SPEC §4): a floating (d_h/2,) tensor on q's device; on CPU its
// values are read: finite. Returns max_j |ω_j| (1.0 when the values are not read).
inline double srpe_inv_freq(const at::Tensor& inv_freq, int64_t dh, const char* q_name, const at::Tensor& q) {
  float_tensor("inv_freq", inv_freq);
  TORCH_CHECK_VALUE(inv_freq.dim() == 1 && inv_freq.size(0) == dh / 2, "inv_freq must have shape (d_h/2,) = (",
                    dh / 2, ",), got ", got(inv_freq));
  same_device("inv_freq", inv_freq, q_name, q);
  double largest = 1.0;
  if (reads_values(inv_freq)) {
    const at::Tensor w = inv_freq.scalar_type() == at::kDouble ? inv_freq : inv_freq.to(at::kDouble);
    const double* p = w.const_data_ptr<double>();
    const int64_t stride = w.stride(0);
    largest = 0.0;
    for (int64_t j = 0; j < w.size(0); ++j) {
      const double v = p[j * stride];
      TORCH_CHECK_VALUE(std::isfinite(v), "inv_freq must hold finite frequencies, got ", float_repr(v), " at pair ",
                        j);
      largest = std::max(largest, std::abs(v));
    }
  }
  return largest;
}

// wiola::srpe: q (B, H, T, d_h), k (B, H_kv, T, d_h) of one dtype and device, position_ids
// (B, T) / (1, T) / (T,) within srpe_max_position, theta > 0, spiral_divisor finite and ≠ 0
// or ±inf, radial terms finite; inv_freq None or (d_h/2,) finite frequencies, scale finite.
// Returns int64 (B, T) positions (a view when shared).
inline at::Tensor srpe(const char* q_name, const at::Tensor& q, const char* k_name, const at::Tensor& k,
                       const at::Tensor& position_ids, double theta, double spiral_divisor, double radial_amplitude,
                       double radial_frequency, const std::optional<at::Tensor>& inv_freq = std::nullopt,
                       double scale = 1.0) {
  float_tensor(q_name, q);
  float_tensor(k_name, k);
  same_dtype(k_name, k, q_name, q);
  const QueryKeyDims d = query_key(q_name, q, k_name, k);
  same_device(k_name, k, q_name, q);
  same_device("position_ids", position_ids, q_name, q);
  const std::string hint =
      position_ids.dim() == 1 || position_ids.dim() == 2 ? bthd_hint(q, {&k}, position_ids.size(-1)) : "";
  at::Tensor positions = checks::position_ids(position_ids, d.B, d.T, hint);
  positive("theta", theta);
  if (!std::isinf(spiral_divisor)) finite("spiral_divisor", spiral_divisor);  // 1/±inf = 0: plain RoPE angles
  TORCH_CHECK_VALUE(spiral_divisor != 0.0, "spiral_divisor must be non-zero (the angle uses 1 + 1/k_s)");
  finite("radial_amplitude", radial_amplitude);
  finite("radial_frequency", radial_frequency);
  const double max_frequency = inv_freq.has_value() ? srpe_inv_freq(*inv_freq, d.dh, q_name, q) : 1.0;
  finite("scale", scale);
  if (reads_values(positions)) {
    const auto [lo, hi] = min_max(positions);
    const auto magnitude = [](int64_t p) { return p < 0 ? uint64_t(0) - uint64_t(p) : uint64_t(p); };
    const uint64_t largest = std::max(magnitude(lo), magnitude(hi));
    const int64_t limit = srpe_max_position(spiral_divisor, max_frequency);
    TORCH_CHECK_VALUE(largest <= uint64_t(limit), "position_ids must lie within ±", limit,
                      " (float32 SRPE outputs lose SPEC accuracy beyond it for spiral_divisor=",
                      float_repr(spiral_divisor), inv_freq.has_value() ? " and max |inv_freq| = " : "",
                      inv_freq.has_value() ? float_repr(max_frequency) : "", "), got |p| = ", largest);
  }
  return positions;
}

// wiola::gcla_attention: the checks of the public function (docs/ops.md). Returns int64
// lengths (or nullopt).
inline std::optional<at::Tensor> gcla_attention(const at::Tensor& q_rot, const at::Tensor& k_rot, const at::Tensor& v,
                                                const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                                                const at::Tensor& gate, const std::optional<at::Tensor>& lengths) {
  float_tensor("q_rot", q_rot);
  float_tensor("k_rot", k_rot);
  float_tensor("v", v);
  float_tensor("q", q);
  float_tensor("kc", kc);
  float_tensor("vc", vc);
  float_tensor("gate", gate);
  const QueryKeyDims d = query_key("q_rot", q_rot, "k_rot", k_rot);
  // With H = H_kv the four tensors agree in either layout; kc/gate give a transposed call away.
  const std::string transposed = bthd_hint(q_rot, {&k_rot, &v, &q});
  shape("v", v, {d.B, d.H_kv, d.T, d.dh}, "(B, H_kv, T, d_h)");
  shape("q", q, {d.B, d.H, d.T, d.dh}, "(B, H, T, d_h)");
  rank("kc", kc, 5, "(B, H, S, Λ', d_h)");
  if (kc.size(0) != d.B || kc.size(1) != d.H || kc.size(4) != d.dh || (kc.size(2) != 1 && kc.size(2) != d.T)) {
    const std::string hint = kc.size(1) == d.T && (kc.size(2) == 1 || kc.size(2) == d.H) ? transposed : "";
    TORCH_CHECK_VALUE(false, "kc must have shape (B, H, S, Λ', d_h) = (", d.B, ", ", d.H, ", S, Λ', ", d.dh,
                      ") with S in {1, T = ", d.T, "}, got ", shape_str(kc.sizes()), hint);
  }
  rank("vc", vc, 5, "(B, H, S, Λ', d_h)");
  TORCH_CHECK_VALUE(vc.sizes() == kc.sizes(), "vc must have the shape of kc (B, H, S, Λ', d_h) = ",
                    shape_str(kc.sizes()), " (same S and Λ'), got ", shape_str(vc.sizes()));
  if (!(gate.dim() == 1 && gate.size(0) == d.H)) {
    const std::string hint = gate.dim() == 1 && gate.size(0) == d.T ? transposed : "";
    TORCH_CHECK_VALUE(false, "gate must have shape (H,) = (", d.H, ",), got ", shape_str(gate.sizes()), hint);
  }
  same_dtype("k_rot", k_rot, "q_rot", q_rot);
  same_dtype("v", v, "q_rot", q_rot);
  same_dtype("q", q, "q_rot", q_rot);
  same_dtype("kc", kc, "q_rot", q_rot);
  same_dtype("vc", vc, "q_rot", q_rot);
  if (lengths.has_value()) index_tensor("lengths", *lengths);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"k_rot", &k_rot}, {"v", &v}, {"q", &q},
                                {"kc", &kc}, {"vc", &vc}, {"gate", &gate}}) {
    same_device(name, *t, "q_rot", q_rot);
  }
  if (lengths.has_value()) same_device("lengths", *lengths, "q_rot", q_rot);
  return checks::lengths(lengths, d.B, d.T);
}

// wiola::gcla_attention_backward: the forward's checks, then grad_out and out with q_rot's
// shape, dtype and device, and lse the forward's (B, H, T) in the accumulation type (float64
// for float64, else float32). Returns int64 lengths (or nullopt).
inline std::optional<at::Tensor> gcla_attention_backward(const at::Tensor& grad_out, const at::Tensor& q_rot,
                                                         const at::Tensor& k_rot, const at::Tensor& v,
                                                         const at::Tensor& q, const at::Tensor& kc,
                                                         const at::Tensor& vc, const at::Tensor& gate,
                                                         const std::optional<at::Tensor>& lengths,
                                                         const at::Tensor& out, const at::Tensor& lse) {
  std::optional<at::Tensor> l = gcla_attention(q_rot, k_rot, v, q, kc, vc, gate, lengths);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"grad_out", &grad_out}, {"out", &out}}) {
    TORCH_CHECK_VALUE(t->sizes() == q_rot.sizes() && t->scalar_type() == q_rot.scalar_type() &&
                          t->device() == q_rot.device(),
                      name, " must have the shape and dtype of q_rot ", shape_str(q_rot.sizes()), " ",
                      dtype_name(q_rot.scalar_type()), ", got ", shape_str(t->sizes()), " ",
                      dtype_name(t->scalar_type()));
  }
  const int64_t B = q_rot.size(0), H = q_rot.size(1), T = q_rot.size(2);
  const auto acc = q_rot.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK_VALUE(lse.dim() == 3 && lse.size(0) == B && lse.size(1) == H && lse.size(2) == T &&
                        lse.scalar_type() == acc && lse.device() == q_rot.device(),
                    "lse must be the forward's (B, H, T) = ", shape_str({B, H, T}), " ", dtype_name(acc),
                    " tensor, got ", shape_str(lse.sizes()), " ", dtype_name(lse.scalar_type()));
  return l;
}

struct AtmMergeArgs {
  at::Tensor positions;  // int64 (B, T)
  at::Tensor lengths;    // int64 (B,), T when not given
};

// x (B, T, d) with d > 0 (also y, gradients: `name`).
inline void atm_tokens(const char* name, const at::Tensor& x) {
  float_tensor(name, x);
  rank(name, x, 3, "(B, T, d)");
  TORCH_CHECK_VALUE(x.size(2) != 0, name, " must have a non-empty last dimension d, got shape ", shape_str(x.sizes()));
}

// wiola::atm_merge: x (B, T, d), position_ids, threshold in [-1, 1], lengths (B,) or None.
inline AtmMergeArgs atm_merge(const at::Tensor& x, const at::Tensor& position_ids, double threshold,
                              const std::optional<at::Tensor>& lengths) {
  atm_tokens("x", x);
  const int64_t B = x.size(0), T = x.size(1);
  same_device("position_ids", position_ids, "x", x);
  if (lengths.has_value()) same_device("lengths", *lengths, "x", x);
  at::Tensor positions = checks::position_ids(position_ids, B, T);
  finite("threshold", threshold);
  TORCH_CHECK_VALUE(threshold >= -1.0 && threshold <= 1.0, "threshold must lie in [-1, 1] (a cosine similarity), got ",
                    float_repr(threshold));
  std::optional<at::Tensor> l = checks::lengths(lengths, B, T);
  return {positions, l.has_value() ? *l : at::full({B}, T, x.options().dtype(at::kLong))};
}

// wiola::atm_unmerge (and the backward ops): y (B, T, d), index_map (B, T).
inline void atm_unmerge(const char* name, const at::Tensor& y, const at::Tensor& map) {
  atm_tokens(name, y);
  index_map(map, y.size(0), y.size(1), name);
  same_device("index_map", map, name, y);
}


// A loss's num_items (wiola::linear_cross_entropy): None, or a real tensor of one element on
// `like`'s device or the CPU, > 0 (value read when it is on the CPU). Returns its value, or
// nullopt (not given, or not on the CPU).
inline std::optional<double> num_items(const std::optional<at::Tensor>& num_items, const at::Tensor& like) {
  if (!num_items.has_value()) return std::nullopt;
  const at::Tensor& t = *num_items;
  TORCH_CHECK_VALUE(t.numel() == 1 && t.scalar_type() != at::kBool && !t.is_complex(),
                    "num_items must be a number > 0 or a real tensor of one element, got a tensor of shape ",
                    shape_str(t.sizes()), " and dtype ", dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.device() == like.device() || t.is_cpu(), "num_items must be on ", like.device(),
                    " like h (or on the CPU), got ", t.device());
  if (!t.is_cpu()) return std::nullopt;
  const double v = t.item<double>();
  TORCH_CHECK_VALUE(v > 0.0 && std::isfinite(v), "num_items must be a finite number > 0, got ", float_repr(v));
  return v;
}

struct LinearCrossEntropyArgs {
  int64_t n;                         // rows N
  at::Tensor labels;                 // int64 (N,), contiguous
  std::optional<double> num_items;   // its value, when given on the CPU
};

// wiola::linear_cross_entropy: h (..., d) with d > 0, W (V, d) of h's dtype and V > 0, labels
// h.shape[:-1] or (N,) of an index dtype with values in [0, V) or equal to ignore_index (read
// on CPU tensors), reduction "mean" / "sum" / "none", label_smoothing in [0, 1], softcap None
// or > 0, z_loss >= 0, num_items (above).
inline LinearCrossEntropyArgs linear_cross_entropy(const at::Tensor& h, const at::Tensor& W, const at::Tensor& labels,
                                                   int64_t ignore_index, c10::string_view reduction,
                                                   double label_smoothing, std::optional<double> softcap,
                                                   double z_loss, const std::optional<at::Tensor>& num_items) {
  float_tensor("h", h);
  float_tensor("W", W);
  min_rank("h", h, 2, "(..., d)");
  const int64_t d = h.size(-1);
  rank("W", W, 2, "(V, d)");
  TORCH_CHECK_VALUE(W.size(1) == d, "W must have shape (V, d) = (V, ", d, ") to match h, got ", shape_str(W.sizes()));
  TORCH_CHECK_VALUE(d != 0, "h must have a non-empty last dimension d, got d = 0");
  TORCH_CHECK_VALUE(W.size(0) != 0, "W must have at least one row (V >= 1), got shape ", shape_str(W.sizes()));
  same_dtype("W", W, "h", h);
  index_tensor("labels", labels);
  const int64_t n = h.numel() / d;
  const auto lead = h.sizes().slice(0, h.dim() - 1);
  TORCH_CHECK_VALUE(labels.sizes() == lead || (labels.dim() == 1 && labels.size(0) == n),
                    "labels must have shape h.shape[:-1] = ", shape_str(lead), " or (N,) = (", n, ",), got ",
                    shape_str(labels.sizes()));
  same_device("W", W, "h", h);
  same_device("labels", labels, "h", h);
  TORCH_CHECK_VALUE(reduction == "mean" || reduction == "sum" || reduction == "none",
                    "reduction must be one of 'mean', 'sum', 'none', got '", std::string(reduction), "'");
  finite("label_smoothing", label_smoothing);
  TORCH_CHECK_VALUE(label_smoothing >= 0.0 && label_smoothing <= 1.0, "label_smoothing must lie in [0, 1], got ",
                    float_repr(label_smoothing));
  if (softcap.has_value()) positive("softcap", *softcap);
  TORCH_CHECK_VALUE(z_loss >= 0.0 && std::isfinite(z_loss), "z_loss must be a finite number >= 0, got ",
                    float_repr(z_loss));
  const std::optional<double> items = checks::num_items(num_items, h);
  at::Tensor y = labels.reshape({n}).to(at::kLong).contiguous();  // (N,) int64: nothing to speak of
  if (reads_values(y)) {
    const int64_t V = W.size(0);
    const int64_t* p = y.const_data_ptr<int64_t>();
    int64_t lo = 0, hi = 0;  // over the counted labels
    for (int64_t i = 0; i < n; ++i) {
      if (p[i] != ignore_index) lo = std::min(lo, p[i]), hi = std::max(hi, p[i]);
    }
    TORCH_CHECK_VALUE(lo >= 0 && hi < V, "labels must lie in [0, V) = [0, ", V, ") or equal ignore_index = ",
                      ignore_index, ", got ", lo < 0 ? lo : hi);
  }
  return {n, y, items};
}

// wiola::linear_cross_entropy_backward: the forward's checks, then grad_loss with the loss's
// element count (N for "none", else 1), lse the forward's (N,) in the accumulation type
// (float64 for float64, else float32), both on h's device, and the gradient buffers given
// (grad_h (N, d), grad_W (V, d)); precomputed gradients only for "mean" / "sum".
inline LinearCrossEntropyArgs linear_cross_entropy_backward(
    const at::Tensor& grad_loss, const at::Tensor& h, const at::Tensor& W, const at::Tensor& labels,
    const at::Tensor& lse, const std::optional<at::Tensor>& num_items, const std::optional<at::Tensor>& grad_h,
    const std::optional<at::Tensor>& grad_W, int64_t ignore_index, c10::string_view reduction,
    double label_smoothing, std::optional<double> softcap, double z_loss, bool precomputed) {
  LinearCrossEntropyArgs a =
      linear_cross_entropy(h, W, labels, ignore_index, reduction, label_smoothing, softcap, z_loss, num_items);
  const int64_t n = a.n, d = h.size(-1);
  const at::ScalarType acc = h.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const bool none = reduction == "none";
  TORCH_CHECK_VALUE(none ? grad_loss.numel() == n : grad_loss.numel() == 1, "grad_loss must have ",
                    none ? "n" : "1", " element(s) (the loss's shape), got shape ", shape_str(grad_loss.sizes()));
  TORCH_CHECK_VALUE(grad_loss.device() == h.device(), "grad_loss must be on ", h.device(), " like h, got ",
                    grad_loss.device());
  TORCH_CHECK_VALUE(lse.sizes() == at::IntArrayRef{n} && lse.scalar_type() == acc && lse.device() == h.device(),
                    "lse must have shape (N,) = (", n, ",) and dtype ", dtype_name(acc), " (the forward's), got ",
                    shape_str(lse.sizes()), " ", dtype_name(lse.scalar_type()));
  if (grad_h.has_value() && grad_h->defined()) shape("grad_h", *grad_h, {n, d}, "(N, d)");
  if (grad_W.has_value() && grad_W->defined()) shape("grad_W", *grad_W, {W.size(0), d}, "(V, d)");
  TORCH_CHECK_VALUE(!precomputed || !none, "precomputed gradients exist for reduction 'mean' or 'sum' only");
  return a;
}

}  // namespace wiola::checks
