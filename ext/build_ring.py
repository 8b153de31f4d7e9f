"""cffi build script for the shared-memory ring (ext/gf_ring.c) -> gym_fork._ring."""

from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent

ffibuilder = FFI()
ffibuilder.cdef(
    """
    #define GF_OK 0
    #define GF_ETIMEDOUT -1
    #define GF_ETOOSMALL -2
    #define GF_EMAGIC -3
    #define GF_ELENGTH -4
    #define GF_ESEQ -5
    #define GF_ETOOBIG -6
    #define GF_ECOUNTERS -7
    #define GF_EINVAL -8
    #define GF_EINTR -9
    #define GF_WAKE 1
    #define GF_RECORD_HEADER 16
    #define GF_SPIN_POLL 0x80000000
    typedef struct gf_ring gf_ring;
    typedef struct gf_side {
        uint64_t write_pos;
        uint64_t read_pos;
        int64_t slept;
        int64_t interval;
    } gf_side;
    uint64_t gf_ring_control_size(void);
    void gf_side_sync(const gf_ring *ring, gf_side *side);
    int gf_ring_init(gf_ring *ring, uint64_t capacity, uint32_t spin);
    int gf_ring_check(const gf_ring *ring, uint64_t capacity);
    int gf_ring_write(gf_ring *ring, uint64_t cap, uint32_t spin, gf_side *side,
                      const void *head, uint32_t head_len, const void *body, uint32_t body_len,
                      int64_t timeout_ns);
    int64_t gf_ring_read(gf_ring *ring, uint64_t cap, uint32_t spin, gf_side *side, void *out,
                         uint64_t out_cap, int64_t timeout_ns, uint64_t *needed, int bell_fd);
    uint64_t gf_ring_pending(const gf_ring *ring);
    uint32_t gf_ring_consumer_sleeping(const gf_ring *ring);
    """
)
ffibuilder.set_source(
    "gym_fork._ring",
    '#include "gf_ring.h"',
    sources=["ext/gf_ring.c"],
    include_dirs=["ext"],
    extra_compile_args=["-O2", "-std=gnu11"],
    # The stable ABI: one wheel for every CPython >= 3.11 (cffi modules need no more).
    py_limited_api=True,
    define_macros=[("Py_LIMITED_API", "0x030B0000")],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
