// Runtime of the SIMT emulator (csrc/cuda/emu/cuda_emu.h): launches, the per-block
// fiber scheduler, __syncthreads and warp collectives, and their checks.
//
// Why fibers and not OS threads: a block is blockDim (up to 1024) threads that meet at
// every barrier and every warp collective (the GCLA kernels shuffle once per key). With OS
// threads each meeting is a futex wake-up of every thread, on a 2-core machine; with
// fibers a meeting is a user-space stack switch per thread (a few ns with the switch
// below), and runs are deterministic: between meetings the threads run one at a time, in
// the order of the launch's schedule (forward, reverse or a seeded shuffle, fresh at every
// meeting: runtime.h), so a missing barrier shows up reproducibly as a wrong result under
// some order. Blocks are independent, so
// blocks run in parallel on a few OS threads (WIOLA_EMU_THREADS, default 2) — which also
// lets ThreadSanitizer see races between blocks.
//
// ThreadSanitizer (WIOLA_EMU_TSAN): every fiber is a TSan fiber, switches do not
// synchronise, and only the emulated barriers do (release on arrival, acquire on
// leaving, per barrier generation), so TSan reports exactly the accesses that the
// device's memory model leaves unordered. This file is compiled without instrumentation:
// the scheduler's own bookkeeping is invisible to TSan.
#include "runtime.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cuda_emu.h"

#if defined(WIOLA_EMU_TSAN)
#include <sanitizer/tsan_interface.h>
extern "C" void AnnotateIgnoreWritesBegin(const char* file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char* file, int line);
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace wiola_emu {

__thread ThreadInfo* tls_thread = nullptr;

namespace {

// ---------------------------------------------------------------------------------
// Stack switching
// ---------------------------------------------------------------------------------
#if defined(__x86_64__)
extern "C" void wiola_emu_switch_context(void** save_sp, void* load_sp);
// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack,
// stores the stack pointer in *save_sp and resumes the stack at load_sp (System V ABI).
asm(R"(
  .text
  .globl wiola_emu_switch_context
  .hidden wiola_emu_switch_context
  .type wiola_emu_switch_context,@function
wiola_emu_switch_context:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size wiola_emu_switch_context,.-wiola_emu_switch_context
)");
struct Context {
  void* sp = nullptr;
};
#else
struct Context {
  ucontext_t uc;
};
#endif

[[noreturn]] void fiber_main();

struct Stacks {  // one mapping: [guard page | stack] × n
  char* base = nullptr;
  size_t stride = 0, size = 0, n = 0;
};

size_t stack_bytes() {
#if defined(WIOLA_EMU_TSAN)
  return 512 * 1024;
#else
  return 128 * 1024;
#endif
}

Stacks map_stacks(size_t n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  Stacks s;
  s.size = stack_bytes();
  s.stride = s.size + page;
  s.n = n;
  void* p = mmap(nullptr, s.stride * n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error("wiola cuda_emu: cannot map fiber stacks");
  s.base = static_cast<char*>(p);
  for (size_t i = 0; i < n; ++i) mprotect(s.base + i * s.stride, page, PROT_NONE);  // overflow faults
  return s;
}

// ---------------------------------------------------------------------------------
// Block state
// ---------------------------------------------------------------------------------
enum class State : uint8_t { kReady, kBarrier, kWarp, kExited };

const char* collective_name(Collective k) {
  switch (k) {
    case Collective::kShfl: return "__shfl_sync";
    case Collective::kShflXor: return "__shfl_xor_sync";
    case Collective::kShflUp: return "__shfl_up_sync";
    case Collective::kShflDown: return "__shfl_down_sync";
    case Collective::kBallot: return "__ballot_sync";
    case Collective::kAny: return "__any_sync";
    case Collective::kAll: return "__all_sync";
    case Collective::kSyncWarp: return "__syncwarp";
  }
  return "?";
}

struct Block;

struct Thread {
  ThreadInfo info;
  Context ctx;
  Block* block = nullptr;
  int linear = 0, lane = 0, warp = 0;
  State state = State::kReady;
  Collective kind = Collective::kShfl;  // pending collective
  unsigned mask = 0;
  uint64_t value = 0, result = 0;
  int arg = 0, width = 32;
#if defined(WIOLA_EMU_TSAN)
  void* tsan_fiber = nullptr;
  bool entered = false;
#endif
};

struct Group {  // one warp collective in flight: lanes of `mask` meet
  Collective kind;
  unsigned mask, arrived;
};

// Fixed-size state only: under TSan, the heap and memmove are intercepted even from this
// uninstrumented file, and fibers touching them would be reported as racing.
struct Warp {
  unsigned lanes = 0;   // lanes that exist (a partial last warp has fewer)
  unsigned exited = 0;
  Group open[32];       // collectives in flight (at most one per lane)
  int n_open = 0;
  uint64_t completed = 0;
};

struct Block {
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  std::vector<int> order;  // the threads of one round, in the order they run
  Schedule schedule;
  bool ftz = false;
  const std::function<void()>* body = nullptr;
  int n = 0, at_barrier = 0, exited = 0;
  uint64_t barrier_gen = 0;
  const char* barrier_site = nullptr;  // where the threads of the open barrier wait
  std::string fault;
  Context scheduler;
  Thread* running = nullptr;
  volatile bool in_fiber = false;  // a fiber runs (not the scheduler): read by the fault handler
#if defined(WIOLA_EMU_TSAN)
  void* tsan_scheduler = nullptr;
  char barrier_sync[2] = {0, 0};  // TSan sync objects, one per barrier generation parity
  char warp_sync[64] = {};        // per warp (mod 32) and parity of its completed count
  char done_sync = 0;
#endif
};

__thread Block* tls_block = nullptr;

std::string thread_name(const Thread& t) {
  char buf[160];
  const ThreadInfo& i = t.info;
  std::snprintf(buf, sizeof buf, "block (%u, %u, %u) thread (%u, %u, %u) [warp %d lane %d]", i.block_idx.x,
                i.block_idx.y, i.block_idx.z, i.thread_idx.x, i.thread_idx.y, i.thread_idx.z, t.warp, t.lane);
  return buf;
}

void switch_to(Context& from, Context& to) {
#if defined(__x86_64__)
  wiola_emu_switch_context(&from.sp, to.sp);
#else
  swapcontext(&from.uc, &to.uc);
#endif
}

// From a fiber back to its block's scheduler (returns when the scheduler resumes it).
void yield_to_scheduler(Thread& t) {
  Block& b = *t.block;
#if defined(WIOLA_EMU_TSAN)
  __tsan_switch_to_fiber(b.tsan_scheduler, __tsan_switch_to_fiber_no_sync);
#endif
  switch_to(t.ctx, b.scheduler);
}

// Records a device fault and leaves the fiber for good: the block is abandoned.
[[noreturn]] void fault(Thread& t, const std::string& what) {
  Block& b = *t.block;
#if defined(WIOLA_EMU_TSAN)
  AnnotateIgnoreWritesBegin(__FILE__, __LINE__);  // the message's heap memory is not the kernels'
#endif
  if (b.fault.empty()) b.fault = thread_name(t) + ": " + what;
#if defined(WIOLA_EMU_TSAN)
  AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
#endif
  yield_to_scheduler(t);
  std::abort();  // never resumed
}

[[noreturn]] void fiber_main() {
  Block& b = *tls_block;
  Thread& t = *b.running;
  (*b.body)();
  t.state = State::kExited;
  ++b.exited;
  Warp& w = b.warps[t.warp];
  w.exited |= 1u << t.lane;
  for (int i = 0; i < w.n_open; ++i) {
    const Group& g = w.open[i];
    if (g.mask & (1u << t.lane)) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "exited while lanes 0x%08x wait for it in %s(mask 0x%08x)", g.arrived,
                    collective_name(g.kind), g.mask);
      fault(t, buf);
    }
  }
#if defined(WIOLA_EMU_TSAN)
  __tsan_release(&b.done_sync);
#endif
  yield_to_scheduler(t);
  std::abort();
}

void init_fiber(Thread& t, const Stacks& s, size_t i) {
  char* lo = s.base + i * s.stride + (s.stride - s.size);
#if defined(__x86_64__)
  auto* sp = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(lo + s.size) & ~uintptr_t(15));
  uint32_t mxcsr;
  uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  // Flush-to-zero of results only: DAZ (read subnormal inputs as zero) would flush doubles
  // as well, which the device never does (atm.cu compares a double τ of -5e-324 with 0).
  constexpr uint32_t kFtz = 1u << 15, kDaz = 1u << 6;
  mxcsr = (mxcsr & ~(kFtz | kDaz)) | (t.block->ftz ? kFtz : 0u);
  *--sp = 0;                                          // fiber_main's return address slot (alignment)
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);    // where the first switch "returns"
  for (int r = 0; r < 6; ++r) *--sp = 0;              // rbp rbx r12 r13 r14 r15
  *--sp = uint64_t(mxcsr) | (uint64_t(fpucw) << 32);
  t.ctx.sp = sp;
#else
  getcontext(&t.ctx.uc);
  t.ctx.uc.uc_stack.ss_sp = lo;
  t.ctx.uc.uc_stack.ss_size = s.size;
  t.ctx.uc.uc_link = nullptr;
  makecontext(&t.ctx.uc, reinterpret_cast<void (*)()>(&fiber_main), 0);
#endif
#if defined(WIOLA_EMU_TSAN)
  // TSan fibers are made once per worker and launch (creating one per thread and block
  // is what makes TSan slow) and reused by every block of that worker.
  if (t.tsan_fiber == nullptr) t.tsan_fiber = __tsan_create_fiber(0);
  t.entered = false;
#endif
}

// The scheduler is stuck: say which thread is missing where.
std::string diagnose(Block& b) {
  const auto where = [&](const Thread& t) -> std::string {
    switch (t.state) {
      case State::kExited: return "has exited";
      case State::kBarrier: return "waits at __syncthreads";
      case State::kWarp: {
        char buf[96];
        std::snprintf(buf, sizeof buf, "waits in %s(mask 0x%08x)", collective_name(t.kind), t.mask);
        return buf;
      }
      case State::kReady: return "is ready";
    }
    return "?";
  };
  for (size_t wi = 0; wi < b.warps.size(); ++wi) {
    for (int gi = 0; gi < b.warps[wi].n_open; ++gi) {
      const Group& g = b.warps[wi].open[gi];
      const unsigned missing = g.mask & ~g.arrived;
      const int lane = __builtin_ctz(missing);
      const Thread& waiting = b.threads[wi * 32 + static_cast<unsigned>(__builtin_ctz(g.arrived))];
      const Thread& absent = b.threads[wi * 32 + static_cast<unsigned>(lane)];
      char buf[256];
      std::snprintf(buf, sizeof buf,
                    "%s(mask 0x%08x): lane %d named in the mask never arrived (it %s); lanes 0x%08x wait",
                    collective_name(g.kind), g.mask, lane, where(absent).c_str(), g.arrived);
      return thread_name(waiting) + ": " + buf;
    }
  }
  for (const Thread& t : b.threads) {
    if (t.state == State::kBarrier) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "__syncthreads reached by %d of %d threads; %d exited before it", b.at_barrier,
                    b.n, b.exited);
      return thread_name(t) + ": " + buf;
    }
  }
  return "scheduler stuck";
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// b.order for one round of the scheduler: every ready thread runs once, in this order,
// until it reaches its next meeting point (or exits).
void order_threads(Block& b, uint64_t block_linear, uint64_t round) {
  const int n = b.n;
  for (int i = 0; i < n; ++i) b.order[i] = b.schedule.kind == Schedule::kReverse ? n - 1 - i : i;
  if (b.schedule.kind != Schedule::kShuffle) return;
  uint64_t state = b.schedule.seed;
  state = splitmix64(state) ^ block_linear;
  state = splitmix64(state) ^ round;
  for (int i = n - 1; i > 0; --i) {  // Fisher-Yates
    const int j = static_cast<int>(splitmix64(state) % static_cast<uint64_t>(i + 1));
    std::swap(b.order[i], b.order[j]);
  }
}

void run_block(Block& b, const Stacks& stacks, dim3 grid, dim3 block, uint3 bidx) {
  for (int i = 0; i < b.n; ++i) {
    Thread& t = b.threads[i];
    t.block = &b;
    t.linear = i;
    t.lane = i % 32;
    t.warp = i / 32;
    t.state = State::kReady;
    t.info.thread_idx = {unsigned(i) % block.x, (unsigned(i) / block.x) % block.y, unsigned(i) / (block.x * block.y)};
    t.info.block_idx = bidx;
    t.info.block_dim = block;
    t.info.grid_dim = grid;
    init_fiber(t, stacks, static_cast<size_t>(i));
  }
  for (size_t w = 0; w < b.warps.size(); ++w) {
    const int lanes = std::min(32, b.n - static_cast<int>(w) * 32);
    b.warps[w] = Warp{};
    b.warps[w].lanes = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
  }
  b.at_barrier = b.exited = 0;
  b.fault.clear();
#if defined(WIOLA_EMU_TSAN)
  b.tsan_scheduler = __tsan_get_current_fiber();
#endif
  const uint64_t block_linear = bidx.x + uint64_t(grid.x) * (bidx.y + uint64_t(grid.y) * bidx.z);
  for (uint64_t round = 0; b.exited < b.n && b.fault.empty(); ++round) {
    bool progress = false;
    order_threads(b, block_linear, round);
    for (int k = 0; k < b.n && b.fault.empty(); ++k) {
      Thread& t = b.threads[b.order[k]];
      if (t.state != State::kReady) continue;
      progress = true;
      b.running = &t;
      tls_thread = &t.info;
#if defined(WIOLA_EMU_TSAN)
      // The first entry inherits the launch (arguments, poisoned shared memory); later
      // switches order nothing.
      __tsan_switch_to_fiber(t.tsan_fiber, t.entered ? __tsan_switch_to_fiber_no_sync : 0);
      t.entered = true;
#endif
      b.in_fiber = true;
      switch_to(b.scheduler, t.ctx);
      b.in_fiber = false;
    }
    if (!progress && b.exited < b.n && b.fault.empty()) b.fault = diagnose(b);
  }
  tls_thread = nullptr;
#if defined(WIOLA_EMU_TSAN)
  __tsan_acquire(&b.done_sync);
  // Fibers abandoned by a fault never released: order their accesses before the host's
  // (a synchronising switch from each of them back to the scheduler, stacks untouched).
  for (Thread& t : b.threads) {
    if (b.fault.empty() || !t.entered) continue;
    __tsan_switch_to_fiber(t.tsan_fiber, __tsan_switch_to_fiber_no_sync);
    __tsan_switch_to_fiber(b.tsan_scheduler, 0);
  }
#endif
}

// ---------------------------------------------------------------------------------
// Errors, attributes, dynamic shared memory
// ---------------------------------------------------------------------------------
thread_local cudaError_t last_error = cudaSuccess;
std::mutex attr_mutex;
std::unordered_map<const void*, int>& max_dynamic_smem() {
  static std::unordered_map<const void*, int> m;
  return m;
}
std::vector<void* (*)()>& dynamic_shared() {
  static std::vector<void* (*)()> v;
  return v;
}

cudaError_t fail(cudaError_t err) {
  last_error = err;
  return err;
}

// ---------------------------------------------------------------------------------
// Schedules and flush-to-zero
// ---------------------------------------------------------------------------------
std::mutex mode_mutex;
bool schedule_set = false, ftz_set = false, ftz_value = true;
Schedule schedule_value;

// ---------------------------------------------------------------------------------
// Guarded device memory
// ---------------------------------------------------------------------------------
struct Allocation {
  char* map = nullptr;  // [guard page | pad | data | slack | guard page]
  size_t map_bytes = 0, bytes = 0, slack = 0, pad = 0;
};
std::mutex alloc_mutex;
std::map<uintptr_t, Allocation>& allocations() {  // by data address
  static std::map<uintptr_t, Allocation> m;
  return m;
}
size_t page_bytes() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }
constexpr size_t kPadChecked = 256;  // bytes before a buffer checked for stray writes

// Where `addr` lies relative to the device buffers ("" when in none of their mappings).
// From the fault handler: never blocks on the registry.
void describe_address(uintptr_t addr, char* buf, size_t n) {
  buf[0] = '\0';
  if (!alloc_mutex.try_lock()) return;
  for (const auto& [data, a] : allocations()) {
    const uintptr_t lo = reinterpret_cast<uintptr_t>(a.map), hi = lo + a.map_bytes;
    if (addr < lo || addr >= hi) continue;
    if (addr >= data + a.bytes) {
      std::snprintf(buf, n, "%zu bytes past the end of a %zu-byte device buffer at %p", size_t(addr - data - a.bytes),
                    a.bytes, reinterpret_cast<void*>(data));
    } else if (addr < data) {
      std::snprintf(buf, n, "%zu bytes before the start of a %zu-byte device buffer at %p", size_t(data - addr),
                    a.bytes, reinterpret_cast<void*>(data));
    } else {
      std::snprintf(buf, n, "at offset %zu of a %zu-byte device buffer at %p", size_t(addr - data), a.bytes,
                    reinterpret_cast<void*>(data));
    }
    break;
  }
  alloc_mutex.unlock();
}

// Stray writes into the bytes around the buffers (no guard page there): a description of
// the first, the bytes restored; "" when none.
std::string check_canaries() {
  const std::lock_guard<std::mutex> lock(alloc_mutex);
  std::string found;
  for (auto& [data, a] : allocations()) {
    auto* tail = reinterpret_cast<unsigned char*>(data + a.bytes);
    auto* head = reinterpret_cast<unsigned char*>(data) - std::min(a.pad, kPadChecked);
    const size_t head_n = std::min(a.pad, kPadChecked);
    for (size_t i = 0; i < a.slack + head_n; ++i) {
      unsigned char& c = i < a.slack ? tail[i] : head[i - a.slack];
      if (c == 0xff) continue;
      if (found.empty()) {
        char buf[200];
        if (i < a.slack) {
          std::snprintf(buf, sizeof buf, "a kernel wrote past the end of a %zu-byte device buffer at %p (byte %zu after it)",
                        a.bytes, reinterpret_cast<void*>(data), i);
        } else {
          std::snprintf(buf, sizeof buf,
                        "a kernel wrote before the start of a %zu-byte device buffer at %p (byte %zu before it)", a.bytes,
                        reinterpret_cast<void*>(data), head_n - (i - a.slack));
        }
        found = buf;
      }
      c = 0xff;
    }
  }
  return found;
}

// ---------------------------------------------------------------------------------
// Memory faults in a fiber (a guard page, or any bad address): a device fault of the
// block, as cudaErrorIllegalAddress on the device, instead of the end of the process.
// Faults elsewhere go to the handler that was installed before.
// ---------------------------------------------------------------------------------
struct sigaction previous_segv, previous_bus;

void on_memory_fault(int sig, siginfo_t* info, void* uctx) {
  Block* b = tls_block;
  if (b != nullptr && b->in_fiber && b->running != nullptr) {
    b->in_fiber = false;
    const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
    char where[200], what[320];
    describe_address(addr, where, sizeof where);
    std::snprintf(what, sizeof what, "illegal memory access (%s) at %p%s%s", sig == SIGBUS ? "SIGBUS" : "SIGSEGV",
                  info->si_addr, where[0] ? ": " : "", where);
    fault(*b->running, what);  // never returns: the fiber is abandoned
  }
  struct sigaction& prev = sig == SIGBUS ? previous_bus : previous_segv;
  if ((prev.sa_flags & SA_SIGINFO) != 0 && prev.sa_sigaction != nullptr) {
    prev.sa_sigaction(sig, info, uctx);
  } else if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN) {
    prev.sa_handler(sig);
  } else {
    signal(sig, SIG_DFL);  // the faulting instruction runs again and ends the process
  }
}

// (Re)installs on_memory_fault when another handler took its place since the last launch.
void install_fault_handler() {
#if !defined(WIOLA_EMU_TSAN)  // TSan's signal interception does not survive a handler that never returns
  static std::mutex m;
  const std::lock_guard<std::mutex> lock(m);
  for (int sig : {SIGSEGV, SIGBUS}) {
    struct sigaction cur {};
    sigaction(sig, nullptr, &cur);
    if ((cur.sa_flags & SA_SIGINFO) != 0 && cur.sa_sigaction == &on_memory_fault) continue;
    struct sigaction act {};
    act.sa_sigaction = &on_memory_fault;
    act.sa_flags = SA_SIGINFO | SA_NODEFER;  // NODEFER: left by a context switch, the signal stays unblocked
    sigemptyset(&act.sa_mask);
    sigaction(sig, &act, sig == SIGBUS ? &previous_bus : &previous_segv);
  }
#endif
}

int worker_count(size_t blocks) {
  int n = 2;
  if (const char* env = std::getenv("WIOLA_EMU_THREADS")) n = std::atoi(env);
  if (n < 1) n = 1;
  return static_cast<int>(std::min<size_t>(static_cast<size_t>(n), blocks));
}

}  // namespace

// ---------------------------------------------------------------------------------
// Device-side entry points
// ---------------------------------------------------------------------------------
int tls_init_anchor() { return 0; }

void syncthreads(const char* site) {
  Block& b = *tls_block;
  Thread& t = *b.running;
  if (b.at_barrier == 0) {
    b.barrier_site = site;
  } else if (std::strcmp(site, b.barrier_site) != 0) {
    device_fault(std::string("__syncthreads in divergent code: this thread waits at ") + site + ", " +
                 std::to_string(b.at_barrier) + " other(s) at " + b.barrier_site);
  }
#if defined(WIOLA_EMU_TSAN)
  const uint64_t gen = b.barrier_gen;
  __tsan_release(&b.barrier_sync[gen & 1]);
#endif
  if (++b.at_barrier == b.n) {  // last to arrive: release everyone
    b.at_barrier = 0;
    ++b.barrier_gen;
    for (Thread& o : b.threads)
      if (o.state == State::kBarrier) o.state = State::kReady;
    t.state = State::kReady;  // and wait for its turn: the schedule orders who goes on first
  } else {
    t.state = State::kBarrier;
  }
  yield_to_scheduler(t);
#if defined(WIOLA_EMU_TSAN)
  __tsan_acquire(&b.barrier_sync[gen & 1]);
#endif
}

uint64_t warp_collective(Collective kind, unsigned mask, uint64_t value, int arg, int width) {
  Block& b = *tls_block;
  Thread& t = *b.running;
  Warp& w = b.warps[t.warp];
  const unsigned bit = 1u << t.lane;
  char buf[200];
  if (!(mask & bit)) {
    std::snprintf(buf, sizeof buf, "%s(mask 0x%08x) called by a lane the mask does not name", collective_name(kind),
                  mask);
    fault(t, buf);
  }
  if (mask & ~w.lanes) {
    std::snprintf(buf, sizeof buf, "%s(mask 0x%08x) names lanes that do not exist in this warp (0x%08x)",
                  collective_name(kind), mask, w.lanes);
    fault(t, buf);
  }
  if (mask & w.exited) {
    std::snprintf(buf, sizeof buf, "%s(mask 0x%08x): lane %d named in the mask has exited", collective_name(kind), mask,
                  __builtin_ctz(mask & w.exited));
    fault(t, buf);
  }
  if (width <= 0 || width > 32 || (width & (width - 1))) {
    std::snprintf(buf, sizeof buf, "%s: width %d is not a power of two in [1, 32]", collective_name(kind), width);
    fault(t, buf);
  }
  // Join the open collective of the same mask. Groups with other (even overlapping) masks
  // may be waiting legitimately; a lane that never comes is found when the block is stuck.
  Group* g = nullptr;
  for (int i = 0; i < w.n_open; ++i) {
    Group& o = w.open[i];
    if (o.mask != mask) continue;
    if (o.kind != kind) {
      std::snprintf(buf, sizeof buf, "calls %s(mask 0x%08x) while lanes 0x%08x wait in %s with the same mask",
                    collective_name(kind), mask, o.arrived, collective_name(o.kind));
      fault(t, buf);
    }
    g = &o;
  }
  if (g == nullptr) {
    g = &w.open[w.n_open++];
    *g = Group{kind, mask, 0u};
  }
  t.kind = kind;
  t.mask = mask;
  t.value = value;
  t.arg = arg;
  t.width = width;
#if defined(WIOLA_EMU_TSAN)
  char* sync = &b.warp_sync[2 * (t.warp % 32) + (w.completed & 1)];
  if (kind == Collective::kSyncWarp) __tsan_release(sync);
#endif
  g->arrived |= bit;
  if (g->arrived != mask) {
    t.state = State::kWarp;
    yield_to_scheduler(t);
  } else {  // last to arrive: compute every lane's result, release the others
    Thread* lanes = &b.threads[static_cast<size_t>(t.warp) * 32];
    uint64_t ballot = 0;
    for (unsigned m = mask; m; m &= m - 1) ballot |= uint64_t(lanes[__builtin_ctz(m)].value != 0) << __builtin_ctz(m);
    for (unsigned m = mask; m; m &= m - 1) {
      Thread& l = lanes[__builtin_ctz(m)];
      const int seg = l.lane & ~(l.width - 1), pos = l.lane - seg;
      int src = l.lane;
      switch (kind) {
        case Collective::kShfl: src = seg + (l.arg & (l.width - 1)); break;
        case Collective::kShflXor: {
          const int x = l.lane ^ l.arg;
          src = (x & ~(l.width - 1)) > seg ? l.lane : x;  // later groups: own value
          break;
        }
        case Collective::kShflUp: src = pos - l.arg < 0 ? l.lane : l.lane - l.arg; break;
        case Collective::kShflDown: src = pos + l.arg >= l.width ? l.lane : l.lane + l.arg; break;
        default: break;
      }
      switch (kind) {
        case Collective::kBallot: l.result = ballot; break;
        case Collective::kAny: l.result = ballot != 0; break;
        case Collective::kAll: l.result = ballot == mask; break;
        case Collective::kSyncWarp: l.result = 0; break;
        default:
          if (src < 0 || src > 31 || !(mask & (1u << src))) {
            std::snprintf(buf, sizeof buf, "%s(mask 0x%08x): lane %d reads lane %d, outside the mask",
                          collective_name(kind), mask, l.lane, src);
            fault(t, buf);
          }
          l.result = lanes[src].value;
      }
      l.state = State::kReady;
    }
    *g = w.open[--w.n_open];  // remove: the last group takes its place
    ++w.completed;
    yield_to_scheduler(t);  // the schedule orders who goes on first
  }
#if defined(WIOLA_EMU_TSAN)
  if (kind == Collective::kSyncWarp) __tsan_acquire(sync);
#endif
  return t.result;
}

// ---------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------
cudaError_t cudaGetLastError() {
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error (cuda_emu)";
    case cudaErrorInvalidValue: return "invalid argument (cuda_emu)";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument (cuda_emu)";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch (cuda_emu)";
  }
  return "unknown error (cuda_emu)";
}

cudaError_t set_func_attribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      static_cast<size_t>(value) > kMaxSmemPerBlock)
    return fail(cudaErrorInvalidValue);
  const std::lock_guard<std::mutex> lock(attr_mutex);
  max_dynamic_smem()[func] = value;
  return cudaSuccess;
}

void register_dynamic_shared(void* (*address)()) {
  const std::lock_guard<std::mutex> lock(attr_mutex);
  dynamic_shared().push_back(address);
}

Schedule parse_schedule(const std::string& text) {
  Schedule s;
  if (text == "forward") return s;
  if (text == "reverse") {
    s.kind = Schedule::kReverse;
    return s;
  }
  const std::string prefix = "shuffle:";
  if (text.rfind(prefix, 0) == 0 && text.size() > prefix.size() &&
      text.find_first_not_of("0123456789", prefix.size()) == std::string::npos && text.size() - prefix.size() <= 19) {
    s.kind = Schedule::kShuffle;
    s.seed = std::stoull(text.substr(prefix.size()));
    return s;
  }
  throw std::invalid_argument("wiola cuda_emu: schedule must be forward, reverse or shuffle:<decimal seed>, got '" +
                              text + "'");
}

std::string schedule_name(Schedule s) {
  switch (s.kind) {
    case Schedule::kForward: return "forward";
    case Schedule::kReverse: return "reverse";
    case Schedule::kShuffle: return "shuffle:" + std::to_string(s.seed);
  }
  return "?";
}

Schedule current_schedule() {
  {
    const std::lock_guard<std::mutex> lock(mode_mutex);
    if (schedule_set) return schedule_value;
  }
  const char* env = std::getenv("WIOLA_EMU_SCHEDULE");
  return env != nullptr && env[0] != '\0' ? parse_schedule(env) : Schedule{};
}

void set_schedule(const Schedule& s) {
  const std::lock_guard<std::mutex> lock(mode_mutex);
  schedule_set = true;
  schedule_value = s;
}

void clear_schedule() {
  const std::lock_guard<std::mutex> lock(mode_mutex);
  schedule_set = false;
}

bool flush_to_zero() {
#if defined(__x86_64__)
  {
    const std::lock_guard<std::mutex> lock(mode_mutex);
    if (ftz_set) return ftz_value;
  }
  const char* env = std::getenv("WIOLA_EMU_FTZ");
  if (env == nullptr || env[0] == '\0') return true;
  if (std::strcmp(env, "0") == 0) return false;
  if (std::strcmp(env, "1") == 0) return true;
  throw std::invalid_argument(std::string("wiola cuda_emu: WIOLA_EMU_FTZ must be 0 or 1, got '") + env + "'");
#else
  return false;
#endif
}

void set_flush_to_zero(bool on) {
  const std::lock_guard<std::mutex> lock(mode_mutex);
  ftz_set = true;
  ftz_value = on;
}

void clear_flush_to_zero() {
  const std::lock_guard<std::mutex> lock(mode_mutex);
  ftz_set = false;
}

void* device_alloc(size_t bytes, size_t phase) {
  const size_t page = page_bytes();
  phase %= kGuardAlign;
  const size_t slack = (kGuardAlign - (bytes + phase) % kGuardAlign) % kGuardAlign;
  const size_t body = (bytes + slack + page - 1) / page * page;
  const size_t map_bytes = body + 2 * page;
  void* m = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) throw std::bad_alloc();
  char* map = static_cast<char*>(m);
  if (mprotect(map, page, PROT_NONE) != 0 || mprotect(map + page + body, page, PROT_NONE) != 0) {
    munmap(map, map_bytes);
    throw std::runtime_error("wiola cuda_emu: cannot protect the guard pages of a device buffer");
  }
  char* data = map + page + body - slack - bytes;
  std::memset(map + page, 0xff, body);  // never-written memory reads as NaN / -1
  Allocation a;
  a.map = map;
  a.map_bytes = map_bytes;
  a.bytes = bytes;
  a.slack = slack;
  a.pad = body - slack - bytes;
  const std::lock_guard<std::mutex> lock(alloc_mutex);
  allocations()[reinterpret_cast<uintptr_t>(data)] = a;
  return data;
}

void device_free(void* p) noexcept {
  if (p == nullptr) return;
  Allocation a;
  {
    const std::lock_guard<std::mutex> lock(alloc_mutex);
    const auto it = allocations().find(reinterpret_cast<uintptr_t>(p));
    if (it == allocations().end()) {  // (called from tensors' deleters: no exception can leave here)
      std::fprintf(stderr, "wiola cuda_emu: device_free(%p): not from device_alloc\n", p);
      std::abort();
    }
    a = it->second;
    allocations().erase(it);
  }
  munmap(a.map, a.map_bytes);
}

void device_fault(const std::string& what) {
  Block* b = tls_block;
  if (b == nullptr || !b->in_fiber || b->running == nullptr) throw std::runtime_error("wiola cuda_emu: device fault: " + what);
  fault(*b->running, what);
}

void misaligned_access(const void* p, size_t bytes) {
  char buf[200];
  std::snprintf(buf, sizeof buf,
                "misaligned %zu-byte vector access at %p (address %% %zu = %zu; cudaErrorMisalignedAddress on the device)",
                bytes, p, bytes, size_t(reinterpret_cast<uintptr_t>(p) % bytes));
  device_fault(buf);
}

cudaError_t launch(const void* func, dim3 grid, dim3 block, size_t smem, cudaStream_t,
                   const std::function<void()>& body) {
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.x > 0x7fffffffu || grid.y > kMaxGridY || grid.z > kMaxGridZ)
    return fail(cudaErrorInvalidConfiguration);
  {
    size_t limit = kDefaultDynamicSmem;
    const std::lock_guard<std::mutex> lock(attr_mutex);
    const auto it = max_dynamic_smem().find(func);
    if (it != max_dynamic_smem().end()) limit = std::max(limit, static_cast<size_t>(it->second));
    if (smem > limit) return fail(cudaErrorInvalidValue);  // the device refuses the launch too
  }
  const Schedule schedule = current_schedule();
  const bool ftz = flush_to_zero();
  install_fault_handler();
  const uint64_t total = uint64_t(grid.x) * grid.y * grid.z;
  const int workers = worker_count(total);
  std::atomic<uint64_t> next{0};
  std::mutex fault_mutex;
  std::string first_fault;
  std::atomic<bool> stop{false};
  const auto work = [&] {
    Block b;
    b.n = static_cast<int>(threads);
    b.threads.resize(threads);
    b.warps.resize((threads + 31) / 32);
    b.order.resize(threads);
    b.schedule = schedule;
    b.ftz = ftz;
    b.body = &body;
    tls_block = &b;
    const Stacks stacks = map_stacks(threads);
    for (uint64_t i; !stop.load() && (i = next.fetch_add(1)) < total;) {
      const uint3 bidx{unsigned(i % grid.x), unsigned((i / grid.x) % grid.y),
                       unsigned(i / (uint64_t(grid.x) * grid.y))};
      for (void* (*addr)() : dynamic_shared()) std::memset(addr(), 0xff, smem);
      run_block(b, stacks, grid, block, bidx);
      if (!b.fault.empty()) {
        const std::lock_guard<std::mutex> lock(fault_mutex);
        if (first_fault.empty()) first_fault = b.fault;
        stop = true;
      }
    }
    munmap(stacks.base, stacks.stride * stacks.n);
#if defined(WIOLA_EMU_TSAN)
    for (Thread& t : b.threads)
      if (t.tsan_fiber != nullptr) __tsan_destroy_fiber(t.tsan_fiber);
#endif
    tls_block = nullptr;
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < workers; ++i) pool.emplace_back(work);
  work();
  for (std::thread& th : pool) th.join();
  const std::string stray = check_canaries();  // (restores the bytes either way)
  if (!first_fault.empty()) throw std::runtime_error("wiola cuda_emu: device fault: " + first_fault);
  if (!stray.empty()) throw std::runtime_error("wiola cuda_emu: device fault: " + stray);
  return cudaSuccess;
}

}  // namespace wiola_emu
