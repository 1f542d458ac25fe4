// Checkpoint bytes read straight into the base's Vars (Models/formats/reading.py).
#ifndef MOA_READ_FILE_H
#define MOA_READ_FILE_H
#include <unistd.h>
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
#endif
