/* gf_ring.c: a single-producer / single-consumer byte ring in shared memory.
 *
 * Invariants (everything below holds for every ring at every instant):
 *  1. Exactly one process writes records (the producer) and exactly one reads them
 *     (the consumer). The control block and data[] live in one MAP_SHARED mapping.
 *  2. capacity is a power of two, at least 64. write_pos and read_pos are byte counters
 *     that only grow (they never wrap: 2^64 bytes is out of reach); the byte at counter
 *     p lives at data[p & (capacity - 1)].
 *  3. Only the producer stores write_pos, write_seq, data_futex and producer_sleeping;
 *     only the consumer stores read_pos, read_seq, space_futex and consumer_sleeping.
 *  4. 0 <= write_pos - read_pos <= capacity. A party that sees otherwise reports
 *     GF_ECOUNTERS: a third party (or a hostile peer) scribbled on the control block.
 *  5. A record is a 16-byte header {u32 magic = GF_RECORD_MAGIC, u32 length, u64 seq}
 *     followed by `length` payload bytes, padded to a multiple of 8. It may wrap around
 *     the end of data[]; it is then copied in two pieces. seq is 1 for the first record
 *     and grows by exactly one per record.
 *  6. Memory ordering: the producer copies the whole record, then publishes it with a
 *     release store of write_pos; the consumer loads write_pos with acquire, copies the
 *     record out, then frees the space with a release store of read_pos. So a record is
 *     never visible half-written to a correct peer, and space is never reused while the
 *     consumer still copies from it.
 *  7. Nothing read from shared memory is trusted for memory safety: each side passes
 *     the capacity and spin count it was configured with (the copies in the control
 *     block are informational); every offset is masked with that capacity and every
 *     length is checked against the published byte count, so a hostile peer that
 *     scribbles on the region can make reads fail, never read or write out of bounds,
 *     and never make a waiter spin longer than its own `spin` or sleep past its deadline.
 *  8. A torn or corrupt record (bad magic, a length that cannot fit in what was
 *     published, a seq that is not read_seq + 1) is reported (GF_EMAGIC, GF_ELENGTH,
 *     GF_ESEQ) and NOT consumed: read_pos stays put, so the caller can report it and
 *     tear the ring down. A full ring never overwrites: the writer waits, then times out.
 *  9. Sleeping: a waiter spins `spin` times (pause, then sched_yield), then sets its
 *     *_sleeping flag, re-checks the condition after a seq_cst fence, and FUTEX_WAITs on
 *     the peer's futex word with the value it read before the check. The peer bumps that word (seq_cst) after each
 *     publish and wakes only when the flag is set. Either the waiter's re-check sees the
 *     publish or the peer sees the flag, so no wake-up is lost. The futex is not
 *     FUTEX_PRIVATE because the two parties are different processes.
 * 10. Polling (spin has GF_SPIN_POLL set): the two parties run under different kernels
 *     (a VM guest and its host share the region through ivshmem), so a futex cannot
 *     wake across. Both sides then never set *_sleeping and never FUTEX_WAIT: after the
 *     spin rounds a waiter sleeps for a growing interval (GF_POLL_MIN_NS doubling up
 *     to GF_POLL_MAX_NS, to GF_POLL_IDLE_MAX_NS after a long wait) and re-checks. Both
 *     ends of one ring must agree on the mode; a futex-mode waiter facing a polling
 *     peer would sleep until its deadline.
 * 11. Doorbell (polling reads given a bell_fd >= 0): once a read has waited
 *     GF_POLL_IDLE_AFTER_NS, the reader sets consumer_sleeping, re-checks after a seq_cst
 *     fence and blocks in poll() on bell_fd (at most GF_BELL_MAX_NS at a time, so a lost
 *     byte costs latency, never a hang). A polling writer that sees consumer_sleeping
 *     after its publish (the same fence pair as the futex mode of 9) returns GF_WAKE instead
 *     of GF_OK: its caller writes a byte to the peer's bell. Bytes are only wake-ups;
 *     the reader drains them and re-checks the ring. A bell that reports hang-up or
 *     error is not used again in that call (polling sleeps instead).
 * 12. Each party keeps a gf_side in its own, unshared memory: its own counter exactly as
 *     it last stored it, and the highest value of the peer's counter it has seen. Every
 *     call checks that its own counter in the control block still equals its copy and
 *     that the peer's counter never moved backwards (nor, by 4, ran ahead of its own by
 *     more than capacity, nor fell behind it); otherwise GF_ECOUNTERS. So a peer that
 *     rewinds read_pos (a writer would wait for space that never comes) or rewrites the
 *     other side's own counter is caught instead of waited for. gf_side_sync adopts the
 *     control block's counters: after init or attach, and when a channel takes over
 *     copied counters (a microVM clone).
 * 13. Every call is bounded and interruptible: it never waits past timeout_ns, and a
 *     futex wait, polling sleep or doorbell poll interrupted by a signal returns GF_EINTR
 *     with nothing published or consumed. Callers cut an unbounded wait into short
 *     calls (slices) with the same gf_side, so that signal handlers, deadlines and peer
 *     liveness are checked between them; a slice that continues a wait (side->interval
 *     != 0) skips the spin rounds and resumes the polling interval and time slept, so
 *     the doorbell of 11 still engages after GF_POLL_IDLE_AFTER_NS of one sliced wait.
 *     A completed call resets the wait state; a caller that gives up a wait resets it.
 */
#include "gf_ring.h"

#include <errno.h>
#include <sched.h>
#include <linux/futex.h>
#include <poll.h>
#include <stddef.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define LOAD_ACQ(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define LOAD_RLX(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define STORE_REL(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define STORE_RLX(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* The first few waits are pure pause loops (the peer is usually mid-copy); later ones
 * yield the core, since on a machine with fewer cores than sandboxes the peer we wait
 * for may need this very core to make progress. */
static inline void spin_once(uint32_t spins) {
    if (spins < 32)
        cpu_relax();
    else
        sched_yield();
}

static inline uint64_t align8(uint64_t n) { return (n + 7u) & ~(uint64_t)7u; }

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* One polling sleep of *interval (cut at the deadline); the next one is twice as long,
 * up to GF_POLL_MAX_NS while the wait is young and GF_POLL_IDLE_MAX_NS once it has
 * lasted GF_POLL_IDLE_AFTER_NS (an idle VM then wakes rarely; a busy one stays quick).
 * Returns 1 if a signal cut the sleep short (invariant 13). */
static int poll_sleep(int64_t *interval, int64_t *slept, int64_t deadline) {
    int64_t length = *interval;
    if (deadline >= 0) {
        int64_t left = deadline - now_ns();
        if (left <= 0) return 0;
        if (left < length) length = left;
    }
    struct timespec ts = {length / 1000000000LL, length % 1000000000LL};
    int interrupted = nanosleep(&ts, NULL) != 0 && errno == EINTR;
    *slept += length;
    int64_t cap = *slept >= GF_POLL_IDLE_AFTER_NS ? GF_POLL_IDLE_MAX_NS : GF_POLL_MAX_NS;
    *interval = *interval * 2 > cap ? cap : *interval * 2;
    return interrupted;
}

/* Sleep until *word != expected, a wake-up, or the deadline (-1: none). Returns 1 if a
 * signal interrupted the sleep. */
static int futex_wait(uint32_t *word, uint32_t expected, int64_t deadline) {
    struct timespec rel, *relp = NULL;
    if (deadline >= 0) {
        int64_t left = deadline - now_ns();
        if (left <= 0) return 0;
        rel.tv_sec = left / 1000000000LL;
        rel.tv_nsec = left % 1000000000LL;
        relp = &rel;
    }
    return syscall(SYS_futex, word, FUTEX_WAIT, expected, relp, NULL, 0) != 0 && errno == EINTR;
}

static void futex_wake(uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE, 1, NULL, NULL, 0); }

/* Load the peer's counter into *out; 0 if it is below what this side already saw
 * (counters only grow: invariant 12). */
static inline int peer_counter(const uint64_t *shared, uint64_t *seen, uint64_t *out) {
    uint64_t value = LOAD_ACQ(shared);
    if (value < *seen) return 0;
    *seen = value;
    *out = value;
    return 1;
}

/* The deadline of a call, computed once it first has to wait (not on the fast path). */
#define DEADLINE_UNSET (-2)

static inline int64_t deadline_after(int64_t timeout_ns) {
    return timeout_ns < 0 ? -1 : now_ns() + timeout_ns;
}

uint64_t gf_ring_control_size(void) { return offsetof(gf_ring, data); }

void gf_side_sync(const gf_ring *ring, gf_side *side) {
    side->write_pos = LOAD_ACQ(&ring->write_pos);
    side->read_pos = LOAD_ACQ(&ring->read_pos);
    side->slept = 0;
    side->interval = 0;
}

int gf_ring_init(gf_ring *ring, uint64_t capacity, uint32_t spin) {
    if (capacity < 64 || (capacity & (capacity - 1)) != 0) return GF_EINVAL;
    memset(ring, 0, offsetof(gf_ring, data));
    ring->capacity = capacity;
    ring->spin = spin;
    STORE_REL(&ring->magic, GF_RING_MAGIC);
    return GF_OK;
}

int gf_ring_check(const gf_ring *ring, uint64_t capacity) {
    if (LOAD_ACQ(&ring->magic) != GF_RING_MAGIC) return GF_EMAGIC;
    if (ring->capacity != capacity) return GF_EINVAL;
    return GF_OK;
}

uint32_t gf_ring_consumer_sleeping(const gf_ring *ring) {
    return __atomic_load_n(&ring->consumer_sleeping, __ATOMIC_SEQ_CST);
}

uint64_t gf_ring_pending(const gf_ring *ring) {
    return LOAD_ACQ(&ring->write_pos) - LOAD_ACQ(&ring->read_pos);
}

static void copy_in(gf_ring *ring, uint64_t cap, uint64_t pos, const void *src, uint64_t len) {
    uint64_t mask = cap - 1, off = pos & mask, first = cap - off;
    if (first > len) first = len;
    memcpy(ring->data + off, src, first);
    if (len > first) memcpy(ring->data, (const uint8_t *)src + first, len - first);
}

static void copy_out(const gf_ring *ring, uint64_t cap, uint64_t pos, void *dst, uint64_t len) {
    uint64_t mask = cap - 1, off = pos & mask, first = cap - off;
    if (first > len) first = len;
    memcpy(dst, ring->data + off, first);
    if (len > first) memcpy((uint8_t *)dst + first, ring->data, len - first);
}

int gf_ring_write(gf_ring *ring, uint64_t cap, uint32_t spin, gf_side *side, const void *head,
                  uint32_t head_len, const void *body, uint32_t body_len, int64_t timeout_ns) {
    uint64_t length = (uint64_t)head_len + body_len;
    uint64_t need = GF_RECORD_HEADER + align8(length);
    if (length > 0xffffffffu || need > cap) return GF_ETOOBIG;
    uint64_t wpos = LOAD_RLX(&ring->write_pos);
    if (wpos != side->write_pos) return GF_ECOUNTERS;
    int64_t deadline = DEADLINE_UNSET;
    int polling = (spin & GF_SPIN_POLL) != 0;
    int continued = side->interval != 0;
    int64_t interval = continued ? side->interval : GF_POLL_MIN_NS, slept = side->slept;
    spin &= ~GF_SPIN_POLL;
    uint32_t spins = continued ? spin : 0;
    int rc;
    for (;;) {
        uint32_t seen = LOAD_ACQ(&ring->space_futex);
        uint64_t rpos;
        if (!peer_counter(&ring->read_pos, &side->read_pos, &rpos)) return GF_ECOUNTERS;
        uint64_t used = wpos - rpos;
        if (used > cap) return GF_ECOUNTERS;
        if (cap - used >= need) break;
        if (deadline == DEADLINE_UNSET) deadline = deadline_after(timeout_ns);
        if (spins < spin) {
            spin_once(spins++);
            continue;
        }
        if (deadline >= 0 && now_ns() >= deadline) {
            rc = GF_ETIMEDOUT;
            goto cut;
        }
        if (polling) {
            if (poll_sleep(&interval, &slept, deadline)) {
                rc = GF_EINTR;
                goto cut;
            }
            continue;
        }
        STORE_RLX(&ring->producer_sleeping, 1);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (!peer_counter(&ring->read_pos, &side->read_pos, &rpos)) {
            STORE_RLX(&ring->producer_sleeping, 0);
            return GF_ECOUNTERS;
        }
        used = wpos - rpos;
        if (used <= cap && cap - used >= need) {
            STORE_RLX(&ring->producer_sleeping, 0);
            break;
        }
        int interrupted = futex_wait(&ring->space_futex, seen, deadline);
        STORE_RLX(&ring->producer_sleeping, 0);
        if (interrupted) {
            rc = GF_EINTR;
            goto cut;
        }
    }
    uint64_t seq = LOAD_RLX(&ring->write_seq) + 1;
    uint32_t hdr[4];
    hdr[0] = GF_RECORD_MAGIC;
    hdr[1] = (uint32_t)length;
    memcpy(&hdr[2], &seq, sizeof seq);
    copy_in(ring, cap, wpos, hdr, GF_RECORD_HEADER);
    if (head_len) copy_in(ring, cap, wpos + GF_RECORD_HEADER, head, head_len);
    if (body_len) copy_in(ring, cap, wpos + GF_RECORD_HEADER + head_len, body, body_len);
    STORE_RLX(&ring->write_seq, seq);
    STORE_REL(&ring->write_pos, wpos + need);
    side->write_pos = wpos + need;
    if (continued) side->interval = side->slept = 0;
    __atomic_fetch_add(&ring->data_futex, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&ring->consumer_sleeping, __ATOMIC_SEQ_CST)) {
        if (polling) return GF_WAKE;
        futex_wake(&ring->data_futex);
    }
    return GF_OK;
cut: /* the wait goes on in the caller's next slice (invariant 13) */
    side->interval = interval;
    side->slept = slept;
    return rc;
}

/* Block on the doorbell until a byte, the deadline or GF_BELL_MAX_NS. Returns 1, 0 if
 * the bell is unusable (hang-up, error), -1 if a signal interrupted the poll. The
 * sleeping flag is set and the ring re-checked first. */
static int bell_wait(gf_ring *ring, uint64_t rpos, int bell_fd, int64_t deadline) {
    STORE_RLX(&ring->consumer_sleeping, 1);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    int usable = 1;
    if (LOAD_ACQ(&ring->write_pos) == rpos) {
        int64_t wait = GF_BELL_MAX_NS;
        if (deadline >= 0 && deadline - now_ns() < wait) wait = deadline - now_ns();
        if (wait > 0) {
            struct pollfd p = {bell_fd, POLLIN, 0};
            int n = poll(&p, 1, (int)((wait + 999999) / 1000000));
            if (n > 0 && (p.revents & POLLIN)) {
                uint8_t drain[64];
                if (read(bell_fd, drain, sizeof drain) <= 0) usable = 0;
            } else if (n < 0 && errno == EINTR) {
                usable = -1;
            } else if (n != 0) {
                usable = 0;
            }
        }
    }
    STORE_RLX(&ring->consumer_sleeping, 0);
    return usable;
}

int64_t gf_ring_read(gf_ring *ring, uint64_t cap, uint32_t spin, gf_side *side, void *out,
                     uint64_t out_cap, int64_t timeout_ns, uint64_t *needed, int bell_fd) {
    uint64_t rpos = LOAD_RLX(&ring->read_pos);
    if (rpos != side->read_pos) return GF_ECOUNTERS;
    int64_t deadline = DEADLINE_UNSET;
    int polling = (spin & GF_SPIN_POLL) != 0;
    int continued = side->interval != 0;
    int64_t interval = continued ? side->interval : GF_POLL_MIN_NS, slept = side->slept;
    spin &= ~GF_SPIN_POLL;
    uint32_t spins = continued ? spin : 0;
    uint64_t avail, wpos;
    int64_t rc;
    for (;;) {
        uint32_t seen = LOAD_ACQ(&ring->data_futex);
        if (!peer_counter(&ring->write_pos, &side->write_pos, &wpos)) return GF_ECOUNTERS;
        avail = wpos - rpos;
        if (avail > cap) return GF_ECOUNTERS;
        if (avail > 0) break;
        if (deadline == DEADLINE_UNSET) deadline = deadline_after(timeout_ns);
        if (spins < spin) {
            spin_once(spins++);
            continue;
        }
        if (deadline >= 0 && now_ns() >= deadline) {
            rc = GF_ETIMEDOUT;
            goto cut;
        }
        if (polling) {
            if (bell_fd >= 0 && slept >= GF_POLL_IDLE_AFTER_NS) {
                int bell = bell_wait(ring, rpos, bell_fd, deadline);
                if (bell < 0) {
                    rc = GF_EINTR;
                    goto cut;
                }
                if (bell == 0) bell_fd = -1;
                continue;
            }
            if (poll_sleep(&interval, &slept, deadline)) {
                rc = GF_EINTR;
                goto cut;
            }
            continue;
        }
        STORE_RLX(&ring->consumer_sleeping, 1);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (!peer_counter(&ring->write_pos, &side->write_pos, &wpos)) {
            STORE_RLX(&ring->consumer_sleeping, 0);
            return GF_ECOUNTERS;
        }
        avail = wpos - rpos;
        if (avail != 0) {
            STORE_RLX(&ring->consumer_sleeping, 0);
            if (avail > cap) return GF_ECOUNTERS;
            break;
        }
        int interrupted = futex_wait(&ring->data_futex, seen, deadline);
        STORE_RLX(&ring->consumer_sleeping, 0);
        if (interrupted) {
            rc = GF_EINTR;
            goto cut;
        }
    }
    if (continued) side->interval = side->slept = 0;
    if (avail < GF_RECORD_HEADER) return GF_ELENGTH;
    uint32_t hdr[4];
    uint64_t seq;
    copy_out(ring, cap, rpos, hdr, GF_RECORD_HEADER);
    memcpy(&seq, &hdr[2], sizeof seq);
    if (hdr[0] != GF_RECORD_MAGIC) return GF_EMAGIC;
    uint64_t length = hdr[1];
    uint64_t need = GF_RECORD_HEADER + align8(length);
    if (need > avail) return GF_ELENGTH;
    if (seq != LOAD_RLX(&ring->read_seq) + 1) return GF_ESEQ;
    if (length > out_cap) {
        if (needed) *needed = length;
        return GF_ETOOSMALL;
    }
    copy_out(ring, cap, rpos + GF_RECORD_HEADER, out, length);
    STORE_RLX(&ring->read_seq, seq);
    STORE_REL(&ring->read_pos, rpos + need);
    side->read_pos = rpos + need;
    __atomic_fetch_add(&ring->space_futex, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&ring->producer_sleeping, __ATOMIC_SEQ_CST)) futex_wake(&ring->space_futex);
    return (int64_t)length;
cut: /* the wait goes on in the caller's next slice (invariant 13) */
    side->interval = interval;
    side->slept = slept;
    return rc;
}
