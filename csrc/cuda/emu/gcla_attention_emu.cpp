// csrc/cuda/gcla_attention.cu compiled as host C++ for the SIMT emulator (backend cuda_emu).
#define WIOLA_CUDA_EMU 1
#include "cuda_emu.h"

namespace wiola::gcla {
namespace {
WIOLA_EMU_EXTERN_SHARED(float, smem);  // the kernels' `extern __shared__ float smem[]`
}  // namespace
}  // namespace wiola::gcla

#include "../gcla_attention.cu"
