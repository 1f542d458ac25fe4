// moa-jittor's addition to Jittor's op compiler (src/jit_compiler.cc includes it; scripts/jittor_patches.sh copies it
// into Jittor's src/ folder). Jittor took one lock over its whole cache folder for every batch of kernels it
// compiled (src/lock.cc, a write lock on the cache's jittor.lock held by OpCompiler::do_compile and
// parallel_compile_all_ops), so two processes sharing a cache compiled one at a time: the test suite's workers
// waited for each other's g++ on a fresh machine. What needs excluding is two processes writing the same kernel's
// files (its source, library and cache key), so on Linux each kernel now takes a lock of its own: one byte of
// <cache_path>/kernels.lock, at an offset its file name hashes to, locked with an open file description lock
// (F_OFD_SETLKW), which excludes other threads as well as other processes and goes away with its descriptor,
// also when a process dies. Two kernels whose names hash alike only wait for each other.
#pragma once
#ifdef __linux__
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
#include <cstring>
#include <functional>
#include "utils/cache_compile.h"

namespace jittor {
namespace jit_compiler {

// byte 0 is the precompiled prelude's (jit_prelude.h), which a compile builds while it holds its kernel's byte
inline off_t kernel_byte(const string& kernel_file) {
    return 1 + (std::hash<string>()(kernel_file) & ((1ull << 40) - 1));
}

struct kernel_lock {
    int fd = -1;
    kernel_lock(const string& cache_folder, off_t byte_offset) {
        string lock_file = join(cache_folder, "kernels.lock");
        fd = open(lock_file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        CHECK(fd >= 0) << "Cannot open" << lock_file << ":" << strerror(errno);
        struct flock byte = {};
        byte.l_type = F_WRLCK;
        byte.l_whence = SEEK_SET;
        byte.l_start = byte_offset;
        byte.l_len = 1;
        int command = F_OFD_SETLKW;
        while (fcntl(fd, command, &byte) != 0) {
            if (errno == EINTR) continue;
            // a kernel before Linux 3.15 or a file system without them: a process's lock, as Jittor's was
            if (errno == EINVAL && command == F_OFD_SETLKW) { command = F_SETLKW; continue; }
            int error = errno;
            close(fd);
            LOGf << "Cannot lock" << lock_file << ":" << strerror(error);
        }
    }
    ~kernel_lock() { close(fd); }
    kernel_lock(const kernel_lock&) = delete;
    kernel_lock& operator=(const kernel_lock&) = delete;
};

} // jit_compiler
} // jittor
#endif
