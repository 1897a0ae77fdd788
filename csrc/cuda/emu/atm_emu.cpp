// csrc/cuda/atm.cu compiled as host C++ for the SIMT emulator (backend cuda_emu).
#define WIOLA_CUDA_EMU 1
#include "../atm.cu"
