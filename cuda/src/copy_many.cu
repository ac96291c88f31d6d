// ---- multi-range copy ----------------------------------------------------------------------
// Copies each entry's `bytes` bytes from `src` to `dst` (non-overlapping), every entry of a
// list in one launch. Entry t owns `blocks` consecutive blocks of the 1-d grid from block
// `first`; its block k moves the 16-byte units k*256+j, k*256+j+blocks*256, ... when `src`,
// `dst` and `bytes` are multiples of 16, else single bytes in the same pattern.
struct CopyEntry { unsigned long long src; unsigned long long dst; i64 bytes; i64 first; int blocks; int pad; };

#define COPY_THREADS 256

extern "C" __global__ void copy_many(const CopyEntry* list, int entries) {
    const i64 b = blockIdx.x;
    // This block's entry: the last one whose first block is at most b.
    int lo = 0, hi = entries - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (list[mid].first <= b) lo = mid; else hi = mid - 1;
    }
    const CopyEntry e = list[lo];
    const i64 stride = (i64)e.blocks * COPY_THREADS;
    i64 i = (b - e.first) * COPY_THREADS + threadIdx.x;
    if (((e.src | e.dst | (unsigned long long)e.bytes) & 15ULL) == 0) {
        const uint4* s = (const uint4*)e.src;
        uint4* d = (uint4*)e.dst;
        const i64 n = e.bytes >> 4;
        for (; i < n; i += stride) d[i] = s[i];
    } else {
        const unsigned char* s = (const unsigned char*)e.src;
        unsigned char* d = (unsigned char*)e.dst;
        for (; i < e.bytes; i += stride) d[i] = s[i];
    }
}
