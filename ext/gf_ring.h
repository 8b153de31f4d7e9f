/* gf_ring.h: declarations shared by gf_ring.c and the cffi build (ext/build_ring.py). */
#ifndef GF_RING_H
#define GF_RING_H
#include <stdint.h>

#define GF_OK 0
#define GF_ETIMEDOUT -1      /* nothing arrived / no space freed before the deadline */
#define GF_ETOOSMALL -2      /* the caller's buffer is too small; *needed says how big */
#define GF_EMAGIC -3         /* record header magic is wrong: torn or foreign bytes */
#define GF_ELENGTH -4        /* record length is impossible for this ring */
#define GF_ESEQ -5           /* record sequence number is not the expected next one */
#define GF_ETOOBIG -6        /* record can never fit in this ring */
#define GF_ECOUNTERS -7      /* the shared positions are inconsistent (written by a third party) */
#define GF_EINVAL -8         /* bad arguments (capacity not a power of two, ...) */
#define GF_EINTR -9          /* a signal interrupted the wait; nothing was written or read */
#define GF_WAKE 1            /* written; the polling peer sleeps on its doorbell: ring it */

#define GF_RING_MAGIC 0x47465247u   /* "GRFG": the control block is initialised */
#define GF_RECORD_MAGIC 0x52454331u /* "1CER": starts every record */
#define GF_RECORD_HEADER 16u

/* spin flag: poll with growing sleeps instead of futexes (peers under different kernels) */
#define GF_SPIN_POLL 0x80000000u
#define GF_POLL_MIN_NS 20000LL   /* first polling sleep: 20 us */
#define GF_POLL_MAX_NS 2000000LL /* longest polling sleep of a young wait: 2 ms */
#define GF_POLL_IDLE_AFTER_NS 200000000LL /* a wait this long (200 ms) is idle ... */
#define GF_POLL_IDLE_MAX_NS 20000000LL    /* ... and sleeps up to 20 ms at a time */
#define GF_BELL_MAX_NS 1000000000LL       /* longest block on a doorbell: 1 s */

typedef struct gf_ring {
    /* producer-owned cache line */
    uint64_t write_pos;
    uint64_t write_seq;
    uint32_t data_futex;        /* bumped by the producer after every publish */
    uint32_t producer_sleeping; /* set by the producer while it waits for space */
    uint8_t _pad0[40];
    /* consumer-owned cache line */
    uint64_t read_pos;
    uint64_t read_seq;
    uint32_t space_futex;       /* bumped by the consumer after every consume */
    uint32_t consumer_sleeping; /* set by the consumer while it waits for data */
    uint8_t _pad1[40];
    /* set once by gf_ring_init, read-only afterwards */
    uint32_t magic;
    uint32_t spin;              /* busy-wait iterations before sleeping on the futex */
    uint64_t capacity;          /* bytes in data[], a power of two */
    uint8_t _pad2[48];
    uint8_t data[];
} gf_ring;

/* One party's private view of a ring (never in shared memory; invariant 12): its own
 * counter as it last left it, a lower bound of the peer's counter, and the state of a
 * wait cut into slices (interval 0: no wait in progress). */
typedef struct gf_side {
    uint64_t write_pos;  /* producer: exactly the shared write_pos; consumer: a lower bound */
    uint64_t read_pos;   /* consumer: exactly the shared read_pos; producer: a lower bound */
    int64_t slept;       /* polling time already slept by earlier slices of this wait */
    int64_t interval;    /* next polling sleep; 0 when no wait is in progress */
} gf_side;

uint64_t gf_ring_control_size(void);
void gf_side_sync(const gf_ring *ring, gf_side *side);
int gf_ring_init(gf_ring *ring, uint64_t capacity, uint32_t spin);
int gf_ring_check(const gf_ring *ring, uint64_t capacity);
int gf_ring_write(gf_ring *ring, uint64_t cap, uint32_t spin, gf_side *side, const void *head,
                  uint32_t head_len, const void *body, uint32_t body_len, int64_t timeout_ns);
int64_t gf_ring_read(gf_ring *ring, uint64_t cap, uint32_t spin, gf_side *side, void *out,
                     uint64_t out_cap, int64_t timeout_ns, uint64_t *needed, int bell_fd);
uint64_t gf_ring_pending(const gf_ring *ring);
uint32_t gf_ring_consumer_sleeping(const gf_ring *ring);
#endif
