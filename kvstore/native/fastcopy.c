/*
 * kvstore's native helper: a batch of copies, each hashed with xxh3-64 as it is copied, and
 * the read table's probe, for the co-located read and write paths (client/_readtable.py,
 * client/_segment.py). Loaded with ctypes (kvstore/native/__init__.py), which releases the GIL
 * for each call; no Python headers. Every function works on a whole batch in one call.
 *
 * A copy and its checksum are one pass over memory: a block is copied one xxh3 block (1 KiB) at
 * a time, and each is hashed from the destination right after it is copied, while it is
 * still in cache, so what is hashed is what the caller got. The hash is xxh3-64 with seed 0,
 * the same as python-xxhash's xxh3_64_intdigest (tests/unit/test_native.py checks both agree).
 *
 * The read table's layout is kvstore/readtable.py's; this file reads it only through the
 * parameters the Python side validated when it opened the table (capacity, shift and the hash
 * constants), and masks every slot index with capacity - 1, so a damaged table can make a
 * read miss, never read outside the table.
 *
 * xxhash.h (BSD-2-Clause, Yann Collet) is vendored beside this file, unchanged; its licence
 * is at its top and in LICENSE.xxhash.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include "xxhash.h"

#define EXPORT __attribute__((visibility("default")))

/*
 * What the CPU running this runs: 2 AVX-512 (F and BW), 1 AVX2, 0 neither (or not x86-64).
 * The loader asks the generic build, then loads the build made for that level.
 */
EXPORT int kv_cpu_level(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
        return 2;
    if (__builtin_cpu_supports("avx2"))
        return 1;
#endif
    return 0;
}

/* Bytes of a block of several spans (hashed with xxh3's streaming state) hashed at a time,
 * right after they are copied. */
#define DEFAULT_PIECE ((size_t)256 * 1024)
#define PAGE 4096u
#define ALIAS 64u

/* The read table's layout (kvstore/readtable.py). */
#define HEADER_BYTES 4096u
#define SLOT_WORDS 8u
#define W_VERSION 0
#define W_KEY 1
#define W_NS 5
#define W_LOC 6
#define W_LENGTH 7

/* Outcomes of kv_table_read per key, beside a length copied (>= 0). */
#define MISS (-1)     /* not in the table, or its slot was changing while probed */
#define REJECTED (-2) /* in the table, but the copy did not hold: ask the daemon */

/*
 * dst = src for n bytes. When dst lies a few bytes past src modulo the page size, `rep movsb`
 * (glibc's memcpy for mid-sized copies) runs several times slower on AMD Zen cores; a plain
 * vector loop does not (client/_buffers.py copy_bytes says the same for numpy).
 */
__attribute__((optimize("no-tree-loop-distribute-patterns")))
static void copy_aliased(unsigned char *dst, const unsigned char *src, size_t n) {
    typedef unsigned char v32 __attribute__((vector_size(32), aligned(1), may_alias));
    typedef unsigned char a32 __attribute__((vector_size(32), aligned(32), may_alias));
    size_t at = 0;
    /* Stores aligned (a store split over two cache lines costs more than a split load). */
    for (; at < n && ((uintptr_t)(dst + at) & 31); at++)
        dst[at] = src[at];
    for (; at + 128 <= n; at += 128) {
        v32 a = *(const v32 *)(src + at), b = *(const v32 *)(src + at + 32);
        v32 c = *(const v32 *)(src + at + 64), d = *(const v32 *)(src + at + 96);
        *(a32 *)(dst + at) = a;
        *(a32 *)(dst + at + 32) = b;
        *(a32 *)(dst + at + 64) = c;
        *(a32 *)(dst + at + 96) = d;
    }
    for (; at < n; at++)
        dst[at] = src[at];
}

static void copy_bytes(unsigned char *dst, const unsigned char *src, size_t n) {
    size_t skew = ((uintptr_t)dst - (uintptr_t)src) % PAGE;
    if (skew > 0 && skew < ALIAS)
        copy_aliased(dst, src, n);
    else
        memcpy(dst, src, n);
}

/* Copy one span piece by piece, hashing each piece from dst into state. */
static void copy_update(unsigned char *dst, const unsigned char *src, size_t n, size_t piece,
                        XXH3_state_t *state) {
    for (size_t at = 0; at < n; at += piece) {
        size_t take = n - at < piece ? n - at : piece;
        copy_bytes(dst + at, src + at, take);
        XXH3_64bits_update(state, dst + at, take);
    }
}

/* Copy up to one xxh3 block (1 KiB) with plain vector loads and stores: no call, and no
 * `rep movsb` to be slowed by 4 KiB aliasing. */
__attribute__((optimize("no-tree-loop-distribute-patterns")))
static inline void copy_small(unsigned char *dst, const unsigned char *src, size_t n) {
    typedef unsigned char v32 __attribute__((vector_size(32), aligned(1), may_alias));
    size_t at = 0;
    for (; at + 32 <= n; at += 32)
        *(v32 *)(dst + at) = *(const v32 *)(src + at);
    for (; at < n; at++)
        dst[at] = src[at];
}

#define PREFETCH_BLOCKS 4

/*
 * Copy one span and return the xxh3-64 of the bytes, hashed from dst. A long span is copied
 * and hashed one xxh3 block (16 stripes, 1 KiB) at a time, so each block is hashed from the
 * L1 cache right after it is copied and the copy's loads and stores overlap the hash's
 * arithmetic. This is XXH3_hashLong_64b_internal of the vendored xxhash.h (default secret,
 * seed 0) with a copy before each block; tests/unit/test_native.py checks it against
 * python-xxhash at every boundary. Short spans (up to 240 bytes) are copied, then hashed.
 */
static uint64_t copy_hash_fused(unsigned char *dst, const unsigned char *src, size_t n) {
    enum { SECRET = sizeof(XXH3_kSecret), STRIPES = (SECRET - XXH_STRIPE_LEN) / 8,
           BLOCK = XXH_STRIPE_LEN * STRIPES };
    if (n <= XXH3_MIDSIZE_MAX) {
        copy_bytes(dst, src, n);
        return XXH3_64bits(dst, n);
    }
    XXH_ALIGN(XXH_ACC_ALIGN) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;
    const xxh_u8 *secret = XXH3_kSecret;
    size_t blocks = (n - 1) / BLOCK;
    for (size_t b = 0; b < blocks; b++) {
        /* A page ahead: the hardware's prefetchers stop at 4 KiB page boundaries, and the
         * arena is 4 KiB pages (2 MiB blocks: 0.80-0.83x of memcpy without, 0.85-0.89x with). */
        if ((b + PREFETCH_BLOCKS + 1) * BLOCK <= n)
            for (size_t line = 0; line < BLOCK; line += 64)
                __builtin_prefetch(src + (b + PREFETCH_BLOCKS) * BLOCK + line);
        copy_small(dst + b * BLOCK, src + b * BLOCK, BLOCK);
        XXH3_accumulate(acc, dst + b * BLOCK, secret, STRIPES);
        XXH3_scrambleAcc(acc, secret + SECRET - XXH_STRIPE_LEN);
    }
    size_t done = blocks * BLOCK;
    copy_small(dst + done, src + done, n - done);
    XXH3_accumulate(acc, dst + done, secret, ((n - 1) - done) / XXH_STRIPE_LEN);
    XXH3_accumulate_512(acc, dst + n - XXH_STRIPE_LEN,
                        secret + SECRET - XXH_STRIPE_LEN - XXH_SECRET_LASTACC_START);
    return XXH3_mergeAccs(acc, secret + XXH_SECRET_MERGEACCS_START, (xxh_u64)n * XXH_PRIME64_1);
}

/*
 * Copy n spans: len[i] bytes from src[i] to dst[i]. With hashes, each block's xxh3-64 as
 * copied (hashed from dst): a block is one span (copied and hashed 1 KiB at a time), or, where
 * more[i] is nonzero, span i and the spans after it up to the next whose more is 0, hashed as
 * one stream (xxh3's streaming state, piece bytes at a time; 0: the default).
 * hashes[i] is set at a block's last span (0 elsewhere).
 */
EXPORT void kv_copy_hash(size_t n, const uint64_t *src, const uint64_t *dst,
                         const uint64_t *len, uint64_t *hashes, size_t piece,
                         const uint8_t *more) {
    XXH3_state_t state;
    int open = 0;
    if (piece == 0)
        piece = DEFAULT_PIECE;
    for (size_t i = 0; i < n; i++) {
        unsigned char *d = (unsigned char *)(uintptr_t)dst[i];
        const unsigned char *s = (const unsigned char *)(uintptr_t)src[i];
        int goes_on = more != NULL && more[i];
        if (!hashes) {
            copy_bytes(d, s, len[i]);
        } else if (!open && !goes_on) {
            hashes[i] = copy_hash_fused(d, s, len[i]);
        } else {
            if (!open)
                XXH3_64bits_reset(&state);
            copy_update(d, s, len[i], piece, &state);
            hashes[i] = goes_on ? 0 : XXH3_64bits_digest(&state);
        }
        open = goes_on;
    }
}

/* The hash constants of a table, as the Python side read and checked them at open. */
typedef struct {
    uint64_t capacity, shift, mult[4], ns_mult, mix;
} table_params;

static inline uint64_t load_version(const volatile uint64_t *slot) {
    return __atomic_load_n((const uint64_t *)slot, __ATOMIC_ACQUIRE);
}

/*
 * One seqlock read of a slot for key (4 words) in namespace ns: 1 when it holds the key,
 * unchanged and even while read, with a tier; its version, location, length and sum then.
 */
static int read_slot(const uint64_t *slots, const uint64_t *sums, uint64_t slot,
                     const uint64_t *key, uint64_t ns, uint64_t *out) {
    const volatile uint64_t *row = slots + slot * SLOT_WORDS;
    uint64_t before = load_version(row);
    uint64_t k0 = row[W_KEY], k1 = row[W_KEY + 1], k2 = row[W_KEY + 2], k3 = row[W_KEY + 3];
    uint64_t tag = row[W_NS], loc = row[W_LOC], length = row[W_LENGTH];
    uint64_t sum = sums ? ((const volatile uint64_t *)sums)[slot] : 0;
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    uint64_t after = load_version(row);
    if (before != after || (before & 1) || (loc & 0xFF) == 0 || tag != ns || k0 != key[0] ||
        k1 != key[1] || k2 != key[2] || k3 != key[3])
        return 0;
    out[0] = before;
    out[1] = loc;
    out[2] = length;
    out[3] = sum;
    return 1;
}

/* Keys whose home slots are computed and prefetched before any of them is read: the slots lie
 * at random places in the table, so a cold probe is a cache miss per key, and misses asked for
 * together overlap. */
#define PROBE_AHEAD 32

static inline void homes(const table_params *p, const uint64_t *key, uint64_t ns_term,
                         uint64_t *first, uint64_t *second) {
    uint64_t mask = p->capacity - 1;
    uint64_t h = key[0] * p->mult[0] + key[1] * p->mult[1] + key[2] * p->mult[2] +
                 key[3] * p->mult[3] + ns_term;
    *first = (h >> p->shift) & mask;
    *second = ((h * p->mix) >> p->shift) & mask;
}

/*
 * Probe n keys (32 bytes each, back to back) in namespace tag ns. Per key: its slot (-1: not
 * found) and the slot's version, location word, length and sum (sum NULL: the sums are not
 * read, a cache miss a key fewer for a lookup). Returns how many keys from the first are found.
 */
EXPORT size_t kv_probe(const uint64_t *table, const table_params *p, uint64_t ns,
                       const uint64_t *keys, size_t n, int64_t *slot_out, uint64_t *version,
                       uint64_t *loc, uint64_t *length, uint64_t *sum) {
    const uint64_t *slots = table + HEADER_BYTES / 8;
    const uint64_t *sums = sum ? slots + p->capacity * SLOT_WORDS : NULL;
    uint64_t got[4], ns_term = ns * p->ns_mult, first[PROBE_AHEAD], second[PROBE_AHEAD];
    size_t prefix = n;
    for (size_t start = 0; start < n; start += PROBE_AHEAD) {
        size_t end = n - start < PROBE_AHEAD ? n : start + PROBE_AHEAD;
        for (size_t i = start; i < end; i++) {
            homes(p, keys + 4 * i, ns_term, &first[i - start], &second[i - start]);
            __builtin_prefetch(slots + first[i - start] * SLOT_WORDS);
            if (sum)
                __builtin_prefetch(sums + first[i - start]);
        }
        for (size_t i = start; i < end; i++) {
            const uint64_t *key = keys + 4 * i;
            int64_t at = -1;
            if (read_slot(slots, sums, first[i - start], key, ns, got))
                at = (int64_t)first[i - start];
            else if (read_slot(slots, sums, second[i - start], key, ns, got))
                at = (int64_t)second[i - start];
            slot_out[i] = at;
            if (at < 0) {
                version[i] = loc[i] = length[i] = 0;
                if (prefix == n)
                    prefix = i;
            } else {
                version[i] = got[0];
                loc[i] = got[1];
                length[i] = got[2];
            }
            if (sum)
                sum[i] = at < 0 ? 0 : got[3];
        }
    }
    return prefix;
}

/*
 * A whole read through the table in one call: probe n keys (as kv_probe), copy each found
 * block from the segment [base, base + limit) into dst[i] (dst_bytes[i] bytes of room),
 * hashing it as it is copied when verify, compare the hash with the table's sum, and re-read
 * the slot's version after the copies. got[i]: the length copied, MISS, or REJECTED (a block
 * out of the segment's bounds, too big for its buffer, failing its checksum, or whose slot
 * changed while it was copied: the daemon is asked); slot, version, loc, length and sum are
 * kv_probe's. Returns how many blocks were copied.
 */
EXPORT size_t kv_table_read(const uint64_t *table, const table_params *p, uint64_t ns,
                            const uint64_t *keys, size_t n, uint64_t base, uint64_t limit,
                            const uint64_t *dst, const uint64_t *dst_bytes, int verify,
                            int64_t *slot, uint64_t *version, uint64_t *loc,
                            uint64_t *length, uint64_t *sum, int64_t *got) {
    size_t copied = 0;
    kv_probe(table, p, ns, keys, n, slot, version, loc, length, sum);
    for (size_t i = 0; i < n; i++) {
        got[i] = MISS;
        if (slot[i] < 0)
            continue;
        uint64_t offset = loc[i] >> 8, len = length[i];
        got[i] = REJECTED;
        if (offset > limit || len > limit - offset || len > dst_bytes[i])
            continue;
        unsigned char *d = (unsigned char *)(uintptr_t)dst[i];
        const unsigned char *s = (const unsigned char *)(uintptr_t)(base + offset);
        if (verify) {
            if (copy_hash_fused(d, s, len) != sum[i])
                continue;
        } else {
            copy_bytes(d, s, len);
        }
        got[i] = (int64_t)len;
    }
    const uint64_t *slots = table + HEADER_BYTES / 8;
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    for (size_t i = 0; i < n; i++) {
        if (got[i] < 0)
            continue;
        if (load_version(slots + (uint64_t)slot[i] * SLOT_WORDS) != version[i])
            got[i] = REJECTED;
        else
            copied++;
    }
    return copied;
}
