// Checkpoint bytes read straight into the base's Vars, and counted finite as they are read
// (Models/formats/reading.py).
#ifndef MOA_READ_FILE_H
#define MOA_READ_FILE_H
#include <unistd.h>
#include <algorithm>
#include <cstdint>
// nbytes of fd from offset into dst; pread may return less than asked (2 GB cap)
static bool read_fully(int fd, char *dst, int64_t nbytes, int64_t offset) {
    int64_t done = 0;
    while (done < nbytes) {
        ssize_t got = pread(fd, dst + done, nbytes - done, offset + done);
        if (got <= 0) return false;
        done += got;
    }
    return true;
}
// the elements of p [n] whose magnitude (sign bit cleared) reaches `from`, compared in T's own width,
// which vectorises (the same loop comparing in 64 bits took about 40 ns an element)
template <typename T> static inline int64_t count_from(const char *p, int64_t n, T from) {
    const T *v = (const T *)p, magnitude = T(~T(0)) >> 1;
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad += (v[i] & magnitude) >= from;
    return bad;
}
// elements of p [nbytes] of `item` bytes (2, 4 or 8) not finite from `from` on; from 0: nothing to check
static inline int64_t not_finite(const char *p, int64_t nbytes, int64_t item, uint64_t from) {
    if (from == 0) return 0;
    if (item == 2) return count_from<uint16_t>(p, nbytes / 2, (uint16_t)from);
    if (item == 4) return count_from<uint32_t>(p, nbytes / 4, (uint32_t)from);
    return count_from<uint64_t>(p, nbytes / 8, from);
}
#endif
