// The CUDA that Models/kernels/cuda/ uses, emulated on the CPU so that tests/test_cuda_sources.py can run the decode
// layer's CUDA form on this machine and compare its numbers with the CPU's (a GPU machine runs the real thing).
// A launch runs its blocks one after another, each CUDA thread a coroutine: __syncthreads is a barrier of the
// block's threads, a warp shuffle an exchange through memory between two barriers of the warp's 32 threads,
// __shared__ memory a static of the kernel (one block runs at a time). The test rewrites `kernel<<<config>>>(args)`
// as `emu_launch(emu_config(config), kernel, args)` and `extern __shared__ T name[];` as
// `T *name = (T *)emu_dynamic_shared();`. With EMU_REVERSED defined 1, blocks and threads run in the reverse order:
// a source that reads what another warp writes without a barrier between gets another value in one of the two
// orders (a race on a GPU).
#ifndef MOA_CUDA_EMULATION_H
#define MOA_CUDA_EMULATION_H
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <csetjmp>
#include <functional>
#include <ucontext.h>
#include <vector>

#ifndef EMU_REVERSED
#define EMU_REVERSED 0
#endif
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ alignas(16) static  // aligned for float4 reads, as CUDA aligns shared memory
#define __align__(n)

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x = 1, unsigned y = 1, unsigned z = 1) : x(x), y(y), z(z) {}
};
struct float4 { float x, y, z, w; };
struct uint4 { uint32_t x, y, z, w; };
struct uint2 { uint32_t x, y; };
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }

// A launch's CUDA threads are coroutines on the calling thread: each runs until it waits at a barrier (its block's,
// or its warp's for a shuffle) or ends; the last to arrive at a barrier releases the others, and a block is done
// when all its threads are. Blocks run one after another. A coroutine starts on its own stack through ucontext and
// switches with _setjmp/_longjmp, which keep the signal mask as it is (swapcontext makes a system call each time).
// The first runnable thread in index order runs next (the reverse order with EMU_REVERSED, blocks too): a warp
// runs until all its threads wait at the block's barrier before the next one starts, as unfair as a GPU may be.
struct EmuThread {
    ucontext_t context;
    jmp_buf resume;
    bool started = false;
    std::vector<char> stack;
    bool done = false;
    int waiting = -1;  // the barrier group it waits at: 0 the block, 1 + w warp w; -1 runnable
};
struct EmuLaunch {
    std::vector<EmuThread> threads;
    std::vector<int> arrived;  // per group
    std::vector<float> exchange;
    std::vector<char> dynamic_shared;
    std::function<void()> kernel;
    ucontext_t scheduler;
    jmp_buf back;  // the scheduler, where a coroutine that waits or ends returns
    int finished = 0;   // threads of the block done
    int scan_from = 0;  // no thread earlier in the order is runnable
};
static EmuLaunch *emu_now = nullptr;
static dim3 threadIdx, blockIdx, blockDim, gridDim;
static int emu_thread = 0;
// the thread at position i of the scheduling order, and the position of thread t (the order reverses itself)
inline int emu_order(int i) { return EMU_REVERSED ? (int)emu_now->threads.size() - 1 - i : i; }

inline void emu_wait(int group, int size) {
    EmuLaunch &l = *emu_now;
    const int me = emu_thread;
    l.threads[me].waiting = group;
    if (++l.arrived[group] == size) {
        l.arrived[group] = 0;
        const int first = group == 0 ? 0 : 32 * (group - 1), end = group == 0 ? (int)l.threads.size() : first + 32;
        for (int t = first; t < end; t++) {
            if (l.threads[t].waiting != group) continue;
            l.threads[t].waiting = -1;
            l.scan_from = std::min(l.scan_from, emu_order(t));
        }
        return;
    }
    if (!_setjmp(l.threads[me].resume)) _longjmp(l.back, 1);
}
inline void __syncthreads() { emu_wait(0, (int)emu_now->threads.size()); }
inline void *emu_dynamic_shared() { return emu_now->dynamic_shared.data(); }
inline float __shfl_xor_sync(unsigned, float v, int offset) {
    EmuLaunch &l = *emu_now;
    const int me = emu_thread, warp = me / 32, lane = me % 32;
    l.exchange[me] = v;
    emu_wait(1 + warp, 32);
    const float other = l.exchange[warp * 32 + (lane ^ offset)];
    emu_wait(1 + warp, 32);
    return other;
}
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
inline unsigned long long atomicXor(unsigned long long *at, unsigned long long v) {
    const unsigned long long old = *at;
    *at ^= v;
    return old;
}

inline void emu_entry() {
    emu_now->kernel();
    emu_now->threads[emu_thread].done = true;
    emu_now->finished++;
    _longjmp(emu_now->back, 1);
}
struct EmuConfig { dim3 grid, block; size_t shared_bytes; };
inline EmuConfig emu_config(dim3 grid, dim3 block, size_t shared_bytes = 0) { return {grid, block, shared_bytes}; }
template <typename Kernel, typename... Args>
void emu_launch(EmuConfig c, Kernel kernel, Args... args) {
    const int threads = (int)(c.block.x * c.block.y * c.block.z);
    EmuLaunch l;
    l.threads = std::vector<EmuThread>(threads);
    l.arrived.assign(1 + (threads + 31) / 32, 0);
    l.exchange.assign(threads, 0.f);
    l.dynamic_shared.assign(std::max<size_t>(c.shared_bytes, 16), 0);
    l.kernel = [&] { kernel(args...); };
    EmuLaunch *outer = emu_now;
    emu_now = &l, blockDim = c.block, gridDim = c.grid;
    const unsigned blocks = c.grid.x * c.grid.y * c.grid.z;
    for (unsigned i = 0; i < blocks; i++) {
        const unsigned block = EMU_REVERSED ? blocks - 1 - i : i;
        blockIdx = dim3(block % c.grid.x, block / c.grid.x % c.grid.y, block / (c.grid.x * c.grid.y));
        for (auto &thread : l.threads) {
            thread.done = false, thread.waiting = -1, thread.started = false;
            thread.stack.resize(1 << 16);
            getcontext(&thread.context);
            thread.context.uc_stack.ss_sp = thread.stack.data();
            thread.context.uc_stack.ss_size = thread.stack.size();
            thread.context.uc_link = &l.scheduler;
            makecontext(&thread.context, emu_entry, 0);
        }
        l.finished = 0, l.scan_from = 0;
        while (l.finished < threads) {
            int i = l.scan_from;
            while (i < threads && (l.threads[emu_order(i)].done || l.threads[emu_order(i)].waiting != -1)) i++;
            if (i == threads) {
                std::fprintf(stderr, "cuda_emulation: threads wait at a barrier that not all reach\n");
                std::abort();
            }
            l.scan_from = i;  // the first runnable thread in the order runs next
            const int t = emu_order(i);
            emu_thread = t;
            threadIdx = dim3(t % c.block.x, t / c.block.x % c.block.y, t / (c.block.x * c.block.y));
            if (!_setjmp(l.back)) {
                if (l.threads[t].started) _longjmp(l.threads[t].resume, 1);
                l.threads[t].started = true;
                swapcontext(&l.scheduler, &l.threads[t].context);
            }
        }
    }
    emu_now = outer;
}

// the runtime's calls the sources make, on host memory
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
enum cudaMemcpyKind { cudaMemcpyHostToDevice };
typedef int cudaEvent_t;
template <typename T> inline int cudaMallocAsync(T **p, size_t bytes, int) { *p = (T *)std::malloc(bytes); return 0; }
inline int cudaFreeAsync(void *p, int) { std::free(p); return 0; }
inline int cudaMemsetAsync(void *p, int v, size_t bytes, int) { std::memset(p, v, bytes); return 0; }
inline int cudaMemcpy(void *to, const void *from, size_t bytes, cudaMemcpyKind) {
    std::memcpy(to, from, bytes);
    return 0;
}
template <typename F> inline int cudaFuncSetAttribute(F, cudaFuncAttribute, int) { return 0; }
#endif
