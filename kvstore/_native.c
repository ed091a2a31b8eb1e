/*
 * kvstore._native -- small C helpers for the hot paths of kvstore.
 *
 *   chain_keys(seed, tokens, block_size, algo=0, id_size=4) -> bytes
 *       Chained XXH3-128 block keys (framing: docs/keys.md).
 *   checksum(buf) -> int
 *       XXH3-64 (seed 0) of a buffer; equal to xxhash.xxh3_64_intdigest.
 *   copy_checksum(dst, src) -> int
 *       Copy src into dst and return XXH3-64 of the bytes, fused into one
 *       pass over memory (see "Fused copy + checksum" below).
 *   copy_verify(dst, src, expected) -> bool
 *       The same fused copy; returns whether the checksum equals expected.
 *   copy_checksum_many(dsts, srcs, sums) -> None
 *       copy_checksum over a batch, the GIL released once for all of it.
 *   simd_target() -> str
 *       The XXH3 kernel this process uses ("avx512", "avx2", "sse2", ...).
 *   seq_begin(header) / seq_end(header)
 *       The writer's side of the shared index's sequence lock (first u64 of
 *       ``header``): odd while the daemon changes the index, even between.
 *   shared_lookup(header, gen, table, k0, k1, nscol, state, tier, keys, ns,
 *                 committed) -> (hit, tiers) | None
 *       A client's prefix lookup in the daemon's shared index (see
 *       kvstore/wire/shared_index.py); None when it raced a change.
 *   shared_slots(header, gen, table, k0, k1, nscol, state, tier, loc, size,
 *                csum, keys, ns, committed, dram) -> (hit, clean, slots) | None
 *       The same probe for a read: rows, offsets, sizes and checksums of
 *       the leading keys committed in DRAM.
 *   verify_scatter_many(srcs, expected, scratch, pieces, dsts, indices, ok)
 *       Verified copies of blocks whose pieces then go to an engine's
 *       per-layer arrays (the vLLM connector's load), each only when it
 *       checks; one call, one GIL release, for the whole batch.
 *   seal_check(srcs, keys, tp, rank, shard_bytes, sums, ok)
 *       The seals of sealed (tensor-parallel) blocks, one call per batch:
 *       which are whole and name their key, and one rank's shard checksum.
 *   scatter_slots(slab, slots, block_bytes, pieces, dsts, indices, seal=None)
 *       verify_scatter_many's direct scatter straight from the slab rows
 *       the shared index answered (seals checked too): a same-host load's
 *       whole copy in one call, with no Python object per block.
 *
 * Every function accepts any object exporting a C-contiguous buffer (bytes,
 * bytearray, memoryview, numpy arrays, ...) and releases the GIL around the
 * C work once the input is large enough for that to pay (KV_NOGIL_MIN).
 *
 * The pure-Python fallbacks (kvstore/keys.py, kvstore/checksum.py) compute
 * exactly the same values; this module is an optional accelerator.
 *
 * xxHash is vendored from the official single-header library
 * (kvstore/_vendor/xxhash, BSD-2-Clause).  On x86-64 the XXH3 kernels are
 * compiled for SSE2, AVX2 and AVX-512 side by side and chosen at load time
 * by CPUID (xxh_x86dispatch), so the binary is not tied to the build machine.
 * Elsewhere the compile-time default kernel (NEON on AArch64, ...) is used.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <errno.h>
#include <sys/mman.h>

/* Keep the vendored xxHash symbols out of the module's dynamic symbol table. */
#if defined(__GNUC__) || defined(__clang__)
#  pragma GCC visibility push(hidden)
#endif

/* KV_NO_DISPATCH: build the portable path on x86-64 too (for testing). */
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(KV_NO_DISPATCH)
#  define KV_X86_64 1
#  define XXH_DISPATCH_DISABLE_REPLACE 1
   /* defines XXH_INLINE_ALL and XXH_X86DISPATCH, includes xxhash.h itself */
#  include "_vendor/xxhash/xxh_x86dispatch.c"
#  include "_vendor/xxhash/xxh_x86dispatch.h"
#  include <emmintrin.h>
#  define KV_XXH3_128(p, n)  XXH3_128bits_dispatch((p), (n))
#  define KV_XXH3_64(p, n)   XXH3_64bits_dispatch((p), (n))
#else
#  define KV_X86_64 0
#  define XXH_INLINE_ALL
#  include "_vendor/xxhash/xxhash.h"
#  define KV_XXH3_128(p, n)  XXH3_128bits((p), (n))
#  define KV_XXH3_64(p, n)   XXH3_64bits((p), (n))
#endif

#if defined(__GNUC__) || defined(__clang__)
#  pragma GCC visibility pop
#endif

/* Framing constants (docs/keys.md). */
#define KV_KEY_LEN        16
#define KV_TAG_TOKENS     0x0100u
#define KV_FRAME_HDR      6            /* tag:u16le + len:u32le */
#define KV_MAX_BLOCK_SIZE 65536
#define KV_ALGO_XXH3_128  0
#define KV_XXH_MIDSIZE_MAX 240         /* XXH3_MIDSIZE_MAX: longest short-input */

/* Inputs smaller than this are processed without releasing the GIL: the
 * release/reacquire pair costs more than hashing a few KiB. */
#define KV_NOGIL_MIN      (16 * 1024)

/* Chain scratch up to this size lives on the stack, larger on the heap. */
#define KV_STACK_SCRATCH  4096


/* ------------------------------------------------------------------------ */
/* Buffer helpers                                                            */
/* ------------------------------------------------------------------------ */

/* Replace the pending exception with ValueError("<name> must be ...: <orig>"). */
static void
kv_contiguity_error(const char *name)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *value = PyErr_GetRaisedException();
#else
    PyObject *type = NULL, *value = NULL, *tb = NULL;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
#endif
    if (value != NULL) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be a C-contiguous buffer (%S)", name, value);
    } else {
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous buffer", name);
    }
    Py_XDECREF(value);
}

/* Read-only, C-contiguous view of obj.  Returns 0 or -1 with an exception. */
static int
kv_get_ro(PyObject *obj, Py_buffer *view, const char *name)
{
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "%s must support the buffer protocol (bytes, bytearray, "
                     "memoryview, numpy array), not %.100s",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) {
        kv_contiguity_error(name);
        return -1;
    }
    return 0;
}

/* Writable, C-contiguous view of obj.  Returns 0 or -1 with an exception. */
static int
kv_get_rw(PyObject *obj, Py_buffer *view, const char *name)
{
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "%s must be a writable buffer (bytearray, memoryview, "
                     "numpy array), not %.100s",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) == 0) {
        return 0;
    }
    /* Tell "read-only" apart from "not contiguous". */
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) == 0) {
        PyBuffer_Release(view);
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s must be writable, got a read-only %.100s",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    kv_contiguity_error(name);
    return -1;
}


/* ------------------------------------------------------------------------ */
/* Chained block keys (no Python API: runs without the GIL)                  */
/* ------------------------------------------------------------------------ */

/* Frames in flight per batch of the chain (see kv_chain_xxh3). */
#define KV_CHAIN_BATCH    16

/* key[i] = XXH3_128(key[i-1] || u16le(0x0100) || u32le(4*bs) || tokens_i),
 * key[-1] = seed; each key written in canonical (big-endian) form, one hash
 * call per block.
 *
 * The chain is latency-bound: each hash needs the previous key.  So frames
 * are laid out a batch at a time in a scratch area (16-byte aligned slots,
 * headers written once), all token bodies of the batch first, and then the
 * chain only stores each key into its slot as two 8-byte words that the next
 * hash's 8-byte loads forward from; the loads of a frame never straddle a
 * store still in flight.  Frames up to 240 bytes (block_size <= 54) use the
 * inlined short-input XXH3 path, longer ones the dispatched SIMD kernel.
 * scratch must hold KV_CHAIN_BATCH slots of kv_chain_stride(block_size).
 * Measured on a 2-core AMD EPYC at block_size 16: ~10 ns/block, against
 * ~18 ns/block for a single frame rewritten in place per block. */
static size_t
kv_chain_stride(size_t block_size)
{
    return (KV_KEY_LEN + KV_FRAME_HDR + 4 * block_size + 15) & ~(size_t)15;
}

/* Writes n little-endian 64-bit ids as little-endian uint32; returns the OR
 * of their high 32-bit halves (non-zero: some id is outside [0, 2**32)). */
static inline uint64_t
kv_narrow_ids(unsigned char *dst, const unsigned char *src, size_t n)
{
    uint64_t high = 0;
    size_t k = 0;
#if KV_X86_64
    /* 8 ids per step: the low and high dwords of four 64-bit lanes pairs
     * gathered with two shuffles (SSE2, baseline on x86-64). */
    {
        __m128i hi_acc = _mm_setzero_si128();
        for (; k + 8 <= n; k += 8) {
            const __m128 a = _mm_castsi128_ps(_mm_loadu_si128((const __m128i *)(src + 8 * k)));
            const __m128 b = _mm_castsi128_ps(_mm_loadu_si128((const __m128i *)(src + 8 * k + 16)));
            const __m128 c = _mm_castsi128_ps(_mm_loadu_si128((const __m128i *)(src + 8 * k + 32)));
            const __m128 d = _mm_castsi128_ps(_mm_loadu_si128((const __m128i *)(src + 8 * k + 48)));
            _mm_storeu_si128((__m128i *)(dst + 4 * k),
                             _mm_castps_si128(_mm_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))));
            _mm_storeu_si128((__m128i *)(dst + 4 * k + 16),
                             _mm_castps_si128(_mm_shuffle_ps(c, d, _MM_SHUFFLE(2, 0, 2, 0))));
            hi_acc = _mm_or_si128(hi_acc, _mm_or_si128(
                _mm_castps_si128(_mm_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))),
                _mm_castps_si128(_mm_shuffle_ps(c, d, _MM_SHUFFLE(3, 1, 3, 1)))));
        }
        hi_acc = _mm_or_si128(hi_acc, _mm_srli_si128(hi_acc, 8));
        hi_acc = _mm_or_si128(hi_acc, _mm_srli_si128(hi_acc, 4));
        high = (uint64_t)(uint32_t)_mm_cvtsi128_si32(hi_acc);
    }
#endif
    for (; k < n; k++) {
        uint64_t v = XXH_readLE64(src + 8 * k);
        uint32_t w = (uint32_t)v;
        high |= v >> 32;
        if (!XXH_CPU_LITTLE_ENDIAN) {
            w = XXH_swap32(w);
        }
        memcpy(dst + 4 * k, &w, 4);
    }
    return high;
}

/* tokens: n_tokens ids of id_size bytes (4: LE uint32; 8: LE 64-bit, each
 * narrowed to uint32 on the way into its frame).  Returns -1 when a 64-bit
 * id (in any block, or in the trailing partial block) is outside
 * [0, 2**32) -- the keys are then garbage -- else 0. */
static int
kv_chain_xxh3(const unsigned char *seed, const unsigned char *tokens,
              size_t id_size, size_t n_tokens, size_t block_size,
              unsigned char *scratch, unsigned char *out)
{
    const size_t n_blocks = n_tokens / block_size;
    const size_t payload = 4 * block_size;
    const size_t in_block = id_size * block_size;
    uint64_t high = 0;
    const size_t frame_len = KV_KEY_LEN + KV_FRAME_HDR + payload;
    const size_t stride = kv_chain_stride(block_size);
    XXH64_hash_t hi, lo;
    size_t i0, j, nb;

    for (j = 0; j < KV_CHAIN_BATCH; j++) {
        unsigned char *hdr = scratch + j * stride + KV_KEY_LEN;
        hdr[0] = (unsigned char)(KV_TAG_TOKENS & 0xff);
        hdr[1] = (unsigned char)((KV_TAG_TOKENS >> 8) & 0xff);
        hdr[2] = (unsigned char)(payload & 0xff);
        hdr[3] = (unsigned char)((payload >> 8) & 0xff);
        hdr[4] = (unsigned char)((payload >> 16) & 0xff);
        hdr[5] = (unsigned char)((payload >> 24) & 0xff);
    }
    memcpy(&hi, seed, 8);          /* already canonical bytes: stored as is */
    memcpy(&lo, seed + 8, 8);

#define KV_CHAIN_LOOP(HASH)                                                   \
    for (i0 = 0; i0 < n_blocks; i0 += KV_CHAIN_BATCH) {                       \
        nb = n_blocks - i0 < KV_CHAIN_BATCH ? n_blocks - i0 : KV_CHAIN_BATCH; \
        for (j = 0; j < nb; j++) {                                            \
            unsigned char *body = scratch + j * stride + KV_KEY_LEN           \
                                  + KV_FRAME_HDR;                             \
            if (id_size == 4) {                                               \
                memcpy(body, tokens + (i0 + j) * in_block, payload);          \
            } else {                                                          \
                high |= kv_narrow_ids(body, tokens + (i0 + j) * in_block,     \
                                      block_size);                            \
            }                                                                 \
        }                                                                     \
        for (j = 0; j < nb; j++) {                                            \
            unsigned char *f = scratch + j * stride;                          \
            unsigned char *key = out + (i0 + j) * KV_KEY_LEN;                 \
            XXH128_hash_t h;                                                  \
            memcpy(f, &hi, 8);                                                \
            memcpy(f + 8, &lo, 8);                                            \
            h = HASH(f, frame_len);                                           \
            hi = XXH_CPU_LITTLE_ENDIAN ? XXH_swap64(h.high64) : h.high64;     \
            lo = XXH_CPU_LITTLE_ENDIAN ? XXH_swap64(h.low64) : h.low64;       \
            memcpy(key, &hi, 8);                                              \
            memcpy(key + 8, &lo, 8);                                          \
        }                                                                     \
    }

    if (frame_len <= KV_XXH_MIDSIZE_MAX) {
        KV_CHAIN_LOOP(XXH3_128bits)       /* inlined short-input path */
    } else {
        KV_CHAIN_LOOP(KV_XXH3_128)        /* SIMD long-input path */
    }
#undef KV_CHAIN_LOOP
    if (id_size == 8) {              /* the trailing partial block, too */
        for (j = n_blocks * block_size; j < n_tokens; j++) {
            high |= XXH_readLE64(tokens + 8 * j) >> 32;
        }
    }
    return high ? -1 : 0;
}


/* ------------------------------------------------------------------------ */
/* Fused copy + checksum                                                     */
/* ------------------------------------------------------------------------ */
/*
 * XXH3-64 of an input longer than 240 bytes is a loop over 1 KiB blocks
 * (16 stripes of 64 bytes, the default 192-byte secret), each accumulated
 * and then scrambled, plus a last partial block and a final 64-byte stripe.
 * The kernels below run that same loop with the vendored accumulate/scramble
 * functions, but copy each 1 KiB block on its way through:
 *
 *   large copies (>= KV_NT_MIN):  src --load--> 1 KiB L1 bounce buffer,
 *       hash the bounce buffer, stream it to dst with non-temporal stores
 *       (with AVX-512 or AVX2, no bounce buffer: each 64-byte stripe is
 *       hashed in the registers it was loaded into and streamed from them;
 *       kv_stream_hash_avx512, kv_stream_hash_avx2);
 *   smaller copies:               src --memcpy--> dst (stays in cache),
 *       hash from dst while it is in L1.
 *
 * Either way the hashed bytes are exactly the bytes written to dst (never a
 * second read of src, which another process may be rewriting), src is read
 * from RAM once, and a large dst is written once without the read-for-
 * ownership that ordinary stores cost.  A software prefetch KV_PREFETCH bytes
 * ahead keeps memory busy while the core hashes.  (KV_NT_MIN below: the
 * threshold follows the machine's last-level cache.)  Measured on a 2-core AMD
 * EPYC (1 MiB L2): copying 256 MiB in 1 MiB pieces took ~25 ms this way,
 * against ~41 ms for "memcpy a 64 KiB chunk, then stream-hash it from dst"
 * (any chunk size from 16 KiB to 1 MiB), ~35 ms for np.copyto in 1 MiB
 * pieces and ~18 ms for one np.copyto of the whole 256 MiB (no checksum).
 */

#define KV_XXH_SECRET     192          /* sizeof(XXH3_kSecret) */
#define KV_XXH_STRIPE     64
#define KV_XXH_STRIPES    ((KV_XXH_SECRET - KV_XXH_STRIPE) / 8)   /* 16 */
#define KV_XXH_BLOCK      (KV_XXH_STRIPE * KV_XXH_STRIPES)        /* 1024 */
#define KV_XXH_LASTACC    7            /* XXH_SECRET_LASTACC_START */
#define KV_PREFETCH       4096
#define KV_NT_FLOOR       (1024 * 1024)
#define KV_REG_MIN        (4 * KV_XXH_BLOCK)   /* the register kernels' shortest copy */

/* Copies of at least kv_nt_min bytes use non-temporal stores, and so does
 * every block of a batch (copy_checksum_many) of at least kv_nt_min bytes in
 * all: a batch that size does not stay in the cache whatever its stores do.
 * Set at import (kv_select_nt_min): half the last-level cache this CPU
 * shares, at least KV_NT_FLOOR, as glibc's memcpy sizes its own
 * non-temporal threshold from the shared cache.  Measured on the 2-core AMD
 * EPYC of docs/performance.md (32 MiB L3): the fused copy of 64 x 4 MiB
 * took about half as long with non-temporal stores.
 * A block put now is often read back soon (a get of the same prefix, the
 * next request's load); streaming it past a cache that would have held it
 * makes that read come from RAM.  Measured on the 2-core Intel box of
 * docs/performance.md (480 MiB L3): 8 x 1 MiB copied then read back took
 * 959 + 1158 us with non-temporal stores, 874 + 738 us without. */
static size_t kv_nt_min = KV_NT_FLOOR;
#define KV_NT_MIN kv_nt_min

typedef XXH64_hash_t (*kv_fused_fn)(unsigned char *dst, const unsigned char *src,
                                    size_t len, int nontemporal);

/*
 * The copy of one chunk (at most KV_XXH_BLOCK bytes: 1 KiB) inside the
 * kernels below, instead of memcpy.  Each 64 bytes are loaded before the 64
 * bytes before them are stored.  Two things make memcpy slow here:
 * - where dst lies a few bytes ahead of src modulo a page, each load of
 *   memcpy's forward loop shares its low 12 address bits with a store the
 *   loop made just before, and the core holds the load until that store
 *   resolves ("4K aliasing").  That is a get from the slab (page-aligned
 *   slots) into a numpy buffer (malloc puts its data 16 bytes past a page);
 *   glibc steps around it only in larger copies;
 * - a call per 1 KiB, with its size and alignment dispatch.
 * Measured on the 2-core AMD EPYC of docs/performance.md ("the chunk copy"),
 * the fused copy of 8 x 1 MiB, cache-resident, minimum of 40 runs: dst 16
 * bytes past src's page offset 10.0 -> 19.1 GB/s; same page offset 19.0 ->
 * 25.3 GB/s.  The 32-byte moves compile to one AVX register each in the
 * AVX2 kernel it is inlined into, two SSE2 registers in the baseline one.
 */
typedef unsigned char kv_v32 __attribute__((vector_size(32), aligned(1)));

static inline __attribute__((always_inline)) void
kv_chunk_copy(unsigned char *d, const unsigned char *s, size_t n)
{
    if (n >= 128) {   /* each 64 bytes loaded before the 64 before them are stored */
        size_t i;
        kv_v32 a, b, a2, b2;
        memcpy(&a, s, 32);
        memcpy(&b, s + 32, 32);
        for (i = 64; i + 64 <= n; i += 64) {
            memcpy(&a2, s + i, 32);
            memcpy(&b2, s + i + 32, 32);
            memcpy(d + i - 64, &a, 32);
            memcpy(d + i - 32, &b, 32);
            a = a2;
            b = b2;
        }
        memcpy(d + i - 64, &a, 32);
        memcpy(d + i - 32, &b, 32);
        memcpy(d + i, s + i, n - i);
        return;
    }
    memcpy(d, s, n);
}

#if KV_X86_64
/* Copy n bytes with non-temporal (streaming) stores where dst is 16-aligned. */
static inline void
kv_stream_copy(unsigned char *dst, const unsigned char *src, size_t n)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    size_t i = 0;
    if (head > n) {
        head = n;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    for (; i + 16 <= n; i += 16) {
        _mm_stream_si128((__m128i *)(dst + i),
                         _mm_loadu_si128((const __m128i *)(src + i)));
    }
    memcpy(dst + i, src + i, n - i);
}
#  define KV_STREAM_COPY(d, s, n) kv_stream_copy((d), (s), (n))
#  define KV_STORE_FENCE()        _mm_sfence()
#  define KV_PREFETCH_READ(p)     _mm_prefetch((const char *)(p), _MM_HINT_T0)
#else
#  define KV_STREAM_COPY(d, s, n) memcpy((d), (s), (n))
#  define KV_STORE_FENCE()        ((void)0)
#  if defined(__GNUC__) || defined(__clang__)
#    define KV_PREFETCH_READ(p)   __builtin_prefetch((p), 0, 3)
#  else
#    define KV_PREFETCH_READ(p)   ((void)0)
#  endif
#endif

/*
 * One kernel per instruction set, for a block whose bytes go to one place
 * (a copy) or to several (an engine's per-layer KV arrays, with no staging
 * copy).  Each 1 KiB chunk is copied straight to the place that holds it and
 * hashed there while it is in L1 -- or, with nt, loaded into an L1 bounce
 * buffer, hashed there and streamed to its place; a chunk that straddles
 * places goes through the bounce buffer, and its placed parts are copied out
 * of it; a chunk in no place (another rank's shard) is hashed where it lies,
 * with no copy.  The hashed bytes are exactly the bytes placed.  Spans are
 * sorted by source offset and do not overlap.  ACC, ACC512 and SCRAMBLE are
 * the vendored XXH3_accumulate_*, XXH3_accumulate_512_* and
 * XXH3_scrambleAcc_* of that set; TARGET is its function attribute (empty
 * for the baseline).  Requires len > KV_XXH_MIDSIZE_MAX.
 */
typedef struct {
    size_t off, len;
    unsigned char *dst;
} kv_span;

typedef XXH64_hash_t (*kv_scatter_fn)(const unsigned char *src, size_t len,
                                      const kv_span *sp, size_t ns, int nt);

static inline const unsigned char *
kv_place(const unsigned char *src, size_t off, size_t n, const kv_span *sp,
         size_t ns, size_t *cur, unsigned char *bounce, int nt)
{
    size_t k = *cur;
    while (k < ns && sp[k].off + sp[k].len <= off) {
        k++;
    }
    *cur = k;
    if (k < ns && sp[k].off <= off && off + n <= sp[k].off + sp[k].len) {
        unsigned char *d = sp[k].dst + (off - sp[k].off);
        if (nt) {
            kv_chunk_copy(bounce, src + off, n);
            KV_STREAM_COPY(d, bounce, n);
            return bounce;
        }
        kv_chunk_copy(d, src + off, n);
        return d;
    }
    if (k >= ns || sp[k].off >= off + n) {
        return src + off;   /* no place holds it (another rank's shard): hashed where it lies */
    }
    kv_chunk_copy(bounce, src + off, n);
    for (; k < ns && sp[k].off < off + n; k++) {
        size_t a = sp[k].off > off ? sp[k].off : off;
        size_t b = sp[k].off + sp[k].len < off + n ? sp[k].off + sp[k].len : off + n;
        kv_chunk_copy(sp[k].dst + (a - sp[k].off), bounce + (a - off), b - a);
    }
    return bounce;
}

#define KV_DEFINE_SCATTER(NAME, TARGET, ACC, ACC512, SCRAMBLE)                \
static TARGET XXH64_hash_t                                                    \
NAME(const unsigned char *src, size_t len, const kv_span *sp, size_t ns,      \
     int nt)                                                                  \
{                                                                             \
    XXH_ALIGN(64) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;                    \
    XXH_ALIGN(64) unsigned char bounce[KV_XXH_BLOCK];                         \
    XXH_ALIGN(64) unsigned char last[KV_XXH_STRIPE];                          \
    const xxh_u8 *secret = XXH3_kSecret;                                      \
    const size_t nb_blocks = (len - 1) / KV_XXH_BLOCK;                        \
    const unsigned char *blk = NULL;                                          \
    size_t n, off, rem, q, cur = 0;                                           \
                                                                              \
    for (n = 0; n < nb_blocks; n++) {                                         \
        off = n * KV_XXH_BLOCK;                                               \
        if (off + KV_PREFETCH + KV_XXH_BLOCK <= len) {                        \
            for (q = 0; q < KV_XXH_BLOCK; q += 64) {                          \
                KV_PREFETCH_READ(src + off + KV_PREFETCH + q);                \
            }                                                                 \
        }                                                                     \
        blk = kv_place(src, off, KV_XXH_BLOCK, sp, ns, &cur, bounce, nt);     \
        ACC(acc, blk, secret, KV_XXH_STRIPES);                                \
        SCRAMBLE(acc, secret + KV_XXH_SECRET - KV_XXH_STRIPE);                \
    }                                                                         \
    off = nb_blocks * KV_XXH_BLOCK;                                           \
    rem = len - off;                                                          \
    if (rem < KV_XXH_STRIPE) {   /* nb_blocks >= 1 since len > 240 */         \
        memcpy(last, blk + KV_XXH_BLOCK - (KV_XXH_STRIPE - rem),              \
               KV_XXH_STRIPE - rem);                                          \
    }                                                                         \
    blk = kv_place(src, off, rem, sp, ns, &cur, bounce, nt);                  \
    ACC(acc, blk, secret, (rem - 1) / KV_XXH_STRIPE);                         \
    if (rem < KV_XXH_STRIPE) {                                                \
        memcpy(last + KV_XXH_STRIPE - rem, blk, rem);                         \
    } else {                                                                  \
        memcpy(last, blk + rem - KV_XXH_STRIPE, KV_XXH_STRIPE);               \
    }                                                                         \
    ACC512(acc, last,                                                         \
           secret + KV_XXH_SECRET - KV_XXH_STRIPE - KV_XXH_LASTACC);          \
    if (nt) {                                                                 \
        KV_STORE_FENCE();                                                     \
    }                                                                         \
    return XXH3_finalizeLong_64b(acc, secret, (xxh_u64)len);                  \
}

#if KV_X86_64
KV_DEFINE_SCATTER(kv_scatter_sse2, XXH_TARGET_SSE2, XXH3_accumulate_sse2,
                  XXH3_accumulate_512_sse2, XXH3_scrambleAcc_sse2)
#  if XXH_DISPATCH_AVX2
KV_DEFINE_SCATTER(kv_scatter_avx2, XXH_TARGET_AVX2, XXH3_accumulate_avx2,
                  XXH3_accumulate_512_avx2, XXH3_scrambleAcc_avx2)
#  endif
#  if XXH_DISPATCH_AVX512
KV_DEFINE_SCATTER(kv_scatter_avx512, XXH_TARGET_AVX512, XXH3_accumulate_avx512,
                  XXH3_accumulate_512_avx512, XXH3_scrambleAcc_avx512)
#  endif
#else
KV_DEFINE_SCATTER(kv_scatter_default, , XXH3_accumulate, XXH3_accumulate_512,
                  XXH3_scrambleAcc)
#endif

/*
 * The other way round, for saves: a block gathered from its places (an
 * engine's per-layer KV arrays) into one contiguous slot, each 1 KiB of the
 * slot hashed while it is in L1, right after its pieces were copied in.
 * The checksum is that of the slot's bytes.  The spans name source
 * pointers, are sorted by block offset, do not overlap and cover the whole
 * block (the caller checks).  Requires len > KV_XXH_MIDSIZE_MAX.
 */
typedef struct {
    size_t off, len;
    const unsigned char *src;
} kv_gspan;

typedef XXH64_hash_t (*kv_gather_fn)(unsigned char *dst, size_t len, const kv_gspan *sp, size_t ns);

static inline void
kv_fill(unsigned char *dst, size_t off, size_t n, const kv_gspan *sp, size_t ns, size_t *cur)
{
    size_t k = *cur;
    while (k < ns && sp[k].off + sp[k].len <= off) {
        k++;
    }
    *cur = k;
    for (; k < ns && sp[k].off < off + n; k++) {
        size_t a = sp[k].off > off ? sp[k].off : off;
        size_t b = sp[k].off + sp[k].len < off + n ? sp[k].off + sp[k].len : off + n;
        kv_chunk_copy(dst + a, sp[k].src + (a - sp[k].off), b - a);
    }
}

#define KV_DEFINE_GATHER(NAME, TARGET, ACC, ACC512, SCRAMBLE)                 \
static TARGET XXH64_hash_t                                                    \
NAME(unsigned char *dst, size_t len, const kv_gspan *sp, size_t ns)           \
{                                                                             \
    XXH_ALIGN(64) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;                    \
    const xxh_u8 *secret = XXH3_kSecret;                                      \
    const size_t nb_blocks = (len - 1) / KV_XXH_BLOCK;                        \
    size_t n, off, cur = 0;                                                   \
                                                                              \
    for (n = 0; n < nb_blocks; n++) {                                         \
        off = n * KV_XXH_BLOCK;                                               \
        kv_fill(dst, off, KV_XXH_BLOCK, sp, ns, &cur);                        \
        ACC(acc, dst + off, secret, KV_XXH_STRIPES);                          \
        SCRAMBLE(acc, secret + KV_XXH_SECRET - KV_XXH_STRIPE);                \
    }                                                                         \
    off = nb_blocks * KV_XXH_BLOCK;                                           \
    kv_fill(dst, off, len - off, sp, ns, &cur);                               \
    ACC(acc, dst + off, secret, (len - off - 1) / KV_XXH_STRIPE);             \
    ACC512(acc, dst + len - KV_XXH_STRIPE,                                    \
           secret + KV_XXH_SECRET - KV_XXH_STRIPE - KV_XXH_LASTACC);          \
    return XXH3_finalizeLong_64b(acc, secret, (xxh_u64)len);                  \
}

#if KV_X86_64
KV_DEFINE_GATHER(kv_gather_sse2, XXH_TARGET_SSE2, XXH3_accumulate_sse2,
                 XXH3_accumulate_512_sse2, XXH3_scrambleAcc_sse2)
#  if XXH_DISPATCH_AVX2
KV_DEFINE_GATHER(kv_gather_avx2, XXH_TARGET_AVX2, XXH3_accumulate_avx2,
                 XXH3_accumulate_512_avx2, XXH3_scrambleAcc_avx2)
#  endif
#  if XXH_DISPATCH_AVX512
KV_DEFINE_GATHER(kv_gather_avx512, XXH_TARGET_AVX512, XXH3_accumulate_avx512,
                 XXH3_accumulate_512_avx512, XXH3_scrambleAcc_avx512)
#  endif
#else
KV_DEFINE_GATHER(kv_gather_default, , XXH3_accumulate, XXH3_accumulate_512,
                 XXH3_scrambleAcc)
#endif

/* A whole block gathered into dst and hashed on the way (any length). */
static XXH64_hash_t
kv_gather_hash(kv_gather_fn fn, unsigned char *dst, size_t len, const kv_gspan *sp, size_t ns)
{
    if (len <= KV_XXH_MIDSIZE_MAX) {
        size_t cur = 0;
        kv_fill(dst, 0, len, sp, ns, &cur);
        return KV_XXH3_64(dst, len);
    }
    return fn(dst, len, sp, ns);
}


/* A whole block to its places, hashed on the way (any length). */
static XXH64_hash_t
kv_scatter_hash(kv_scatter_fn fn, const unsigned char *src, size_t len,
                const kv_span *sp, size_t ns)
{
    if (len <= KV_XXH_MIDSIZE_MAX) {
        unsigned char small[KV_XXH_MIDSIZE_MAX + 1];
        size_t cur = 0;
        const unsigned char *blk = kv_place(src, 0, len, sp, ns, &cur, small, 0);
        return KV_XXH3_64(blk, len);
    }
    return fn(src, len, sp, ns, 0);
}


/* A plain copy is a scatter to one place. */
#define KV_DEFINE_FUSED(NAME, SCATTER)                                        \
static XXH64_hash_t                                                           \
NAME(unsigned char *dst, const unsigned char *src, size_t len, int nt)        \
{                                                                             \
    kv_span one;                                                              \
    one.off = 0;                                                              \
    one.len = len;                                                            \
    one.dst = dst;                                                            \
    return SCATTER(src, len, &one, 1, nt);                                    \
}

#if KV_X86_64
KV_DEFINE_FUSED(kv_fused_sse2, kv_scatter_sse2)
/* Prefetch the 1 KiB KV_PREFETCH bytes past src + off, where it lies within len. */
static inline void
kv_prefetch_ahead(const unsigned char *src, size_t off, size_t len)
{
    size_t q;
    if (off + KV_PREFETCH + KV_XXH_BLOCK <= len) {
        for (q = 0; q < KV_XXH_BLOCK; q += 64) {
            KV_PREFETCH_READ(src + off + KV_PREFETCH + q);
        }
    }
}

/*
 * The end of a register kernel's copy (kv_stream_hash_avx2/avx512): the
 * last `rest` bytes of the last full stripe (reg), which its aligned stores
 * did not place; the last partial 1 KiB, through a small bounce buffer; the
 * last stripe; then the hash.  acc holds the accumulators after the last
 * full block.  XXH3's accumulate gives the same values with any kernel, so
 * SSE2 serves both (for at most 1 KiB a block).
 */
static XXH64_hash_t
kv_stream_tail(xxh_u64 *acc, unsigned char *dst, const unsigned char *src, size_t len,
               const unsigned char *reg, size_t rest)
{
    XXH_ALIGN(64) unsigned char tail[KV_XXH_BLOCK];
    XXH_ALIGN(64) unsigned char last[KV_XXH_STRIPE];
    const xxh_u8 *secret = XXH3_kSecret;
    const size_t off = (len - 1) / KV_XXH_BLOCK * KV_XXH_BLOCK;
    const size_t rem = len - off;   /* 1..1024 */

    memcpy(dst + off - rest, reg + KV_XXH_STRIPE - rest, rest);
    kv_chunk_copy(tail, src + off, rem);
    memcpy(dst + off, tail, rem);
    XXH3_accumulate_sse2(acc, tail, secret, (rem - 1) / KV_XXH_STRIPE);
    if (rem < KV_XXH_STRIPE) {
        memcpy(last, reg + rem, KV_XXH_STRIPE - rem);
        memcpy(last + KV_XXH_STRIPE - rem, tail, rem);
    } else {
        memcpy(last, tail + rem - KV_XXH_STRIPE, KV_XXH_STRIPE);
    }
    XXH3_accumulate_512_sse2(acc, last, secret + KV_XXH_SECRET - KV_XXH_STRIPE - KV_XXH_LASTACC);
    KV_STORE_FENCE();
    return XXH3_finalizeLong_64b(acc, secret, (xxh_u64)len);
}

/* The fused copy of one block: the register kernel REG where it applies (a
 * streamed copy of KV_REG_MIN bytes or more, dst aligned to ALIGN), else
 * SCATTER's bounce kernel. */
#define KV_DEFINE_FUSED_REG(NAME, SCATTER, REG, ALIGN)                        \
static XXH64_hash_t                                                           \
NAME(unsigned char *dst, const unsigned char *src, size_t len, int nt)        \
{                                                                             \
    kv_span one;                                                              \
    if (nt && len >= KV_REG_MIN && ((uintptr_t)dst & ((ALIGN) - 1)) == 0) {   \
        return REG(dst, src, len);                                            \
    }                                                                         \
    one.off = 0;                                                              \
    one.len = len;                                                            \
    one.dst = dst;                                                            \
    return SCATTER(src, len, &one, 1, nt);                                    \
}

#  if XXH_DISPATCH_AVX2
/*
 * The same with AVX2 (kv_stream_hash_avx512 below tells why): a stripe is
 * two 32-byte registers, each accumulated and streamed from where it was
 * loaded.  The stores are 32 bytes, so dst must be 16-aligned (a page-
 * aligned slab slot, a malloc'd buffer); with dst 16 short of a 32-byte
 * boundary each aligned store is the high half of one register and the low
 * half of the next (vperm2i128).  Else the bounce kernel.
 */
static inline XXH_TARGET_AVX2 __m256i
kv_acc_reg_avx2(__m256i acc, __m256i data, const xxh_u8 *key)   /* half of XXH3_accumulate_512_avx2 */
{
    __m256i const data_key = _mm256_xor_si256(data, _mm256_loadu_si256((const __m256i *)key));
    __m256i const product = _mm256_mul_epu32(data_key, _mm256_srli_epi64(data_key, 32));
    __m256i const swap = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
    return _mm256_add_epi64(product, _mm256_add_epi64(acc, swap));
}

#define KV_AVX2_STEP(Y, P, SRC, OUT, K16)                                     \
    do {                                                                      \
        (P) = (Y);                                                            \
        (Y) = _mm256_loadu_si256((const __m256i *)(SRC));                     \
        _mm256_stream_si256((__m256i *)(OUT),                                 \
                            (K16) ? _mm256_permute2x128_si256((P), (Y), 0x21) \
                                  : (P));                                     \
    } while (0)

static XXH_TARGET_AVX2 XXH64_hash_t
kv_stream_hash_avx2(unsigned char *dst, const unsigned char *src, size_t len)
{
    XXH_ALIGN(64) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;
    XXH_ALIGN(64) unsigned char reg[KV_XXH_STRIPE];
    const xxh_u8 *secret = XXH3_kSecret;
    const size_t nb = (len - 1) / KV_XXH_BLOCK;                    /* >= 3 full blocks */
    const size_t k = (32 - ((uintptr_t)dst & 31)) & 31;            /* 0 or 16: dst + k is 32-aligned */
    const int k16 = k != 0;
    unsigned char *out = dst + k - 32;   /* + 32 u: the aligned store made at half-stripe u */
    __m256i a0 = _mm256_load_si256((const __m256i *)acc), a1 = _mm256_load_si256((const __m256i *)acc + 1);
    __m256i y, p = _mm256_setzero_si256();
    size_t n, s, off;

    y = _mm256_loadu_si256((const __m256i *)src);
    a0 = kv_acc_reg_avx2(a0, y, secret);
    _mm256_store_si256((__m256i *)reg, y);
    memcpy(dst, reg, k);
    KV_AVX2_STEP(y, p, src + 32, out + 32, k16);
    a1 = kv_acc_reg_avx2(a1, y, secret + 32);
    for (n = 0; n < nb; n++) {
        off = n * KV_XXH_BLOCK;
        kv_prefetch_ahead(src, off, len);
        for (s = (n == 0); s < KV_XXH_STRIPES; s++) {
            KV_AVX2_STEP(y, p, src + off + 64 * s, out + off + 64 * s, k16);
            a0 = kv_acc_reg_avx2(a0, y, secret + 8 * s);
            KV_AVX2_STEP(y, p, src + off + 64 * s + 32, out + off + 64 * s + 32, k16);
            a1 = kv_acc_reg_avx2(a1, y, secret + 8 * s + 32);
        }
        _mm256_store_si256((__m256i *)acc, a0);
        _mm256_store_si256((__m256i *)acc + 1, a1);
        XXH3_scrambleAcc_avx2(acc, secret + KV_XXH_SECRET - KV_XXH_STRIPE);
        a0 = _mm256_load_si256((const __m256i *)acc);
        a1 = _mm256_load_si256((const __m256i *)acc + 1);
    }
    _mm256_store_si256((__m256i *)reg, p);   /* the last full stripe */
    _mm256_store_si256((__m256i *)reg + 1, y);
    return kv_stream_tail(acc, dst, src, len, reg, 32 - k);
}

KV_DEFINE_FUSED_REG(kv_fused_avx2, kv_scatter_avx2, kv_stream_hash_avx2, 16)
#  endif
#  if XXH_DISPATCH_AVX512
/*
 * The non-temporal fused copy of one block, AVX-512, with no bounce buffer:
 * each 64-byte stripe is loaded into a register once, accumulated from that
 * register and streamed to dst from it.  The bounce buffer's store and two
 * reloads per stripe are what kept the hash from hiding behind the copy: a
 * core copying out of RAM is itself the bound (two threads copy 1.65 times
 * what one does on the EPYC of docs/performance.md), and the bounce kernel
 * took the plain copy's time plus the hash's, as if in series.  Measured
 * there, 8 x 4 MiB on two threads, medians of 30, three runs each
 * (docs/performance.md, twenty-seventh round): the hashed copy into a slab
 * mapping 1.58-2.53 ms with the bounce kernel, 1.52-1.61 ms with this one;
 * the verified copy out 2.11-2.86 and 1.75-1.77 ms; a plain streamed copy
 * 1.51-1.97 ms.
 *
 * dst need not be 64-aligned.  With dst + k the first 64-byte boundary (k
 * a multiple of 4), the aligned store before stripe g is the last 64 - k
 * bytes of stripe g - 1 and the first k of stripe g (vpermt2d), made once
 * both are hashed; the first k bytes and what follows the last aligned
 * store go with ordinary stores, from the registers or the tail's bounce
 * buffer the hash read.  So the hashed bytes are still exactly the bytes
 * written.  Requires len >= KV_REG_MIN and dst 4-aligned (else the bounce
 * kernel).
 */
static inline XXH_TARGET_AVX512 __m512i
kv_acc_reg(__m512i acc, __m512i data, __m512i key)   /* XXH3_accumulate_512_avx512, data in a register */
{
    __m512i const data_key = _mm512_xor_si512(data, key);
    __m512i const product = _mm512_mul_epu32(data_key, _mm512_srli_epi64(data_key, 32));
    __m512i const swap = _mm512_shuffle_epi32(data, (_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2));
    return _mm512_add_epi64(product, _mm512_add_epi64(acc, swap));
}

static XXH_TARGET_AVX512 XXH64_hash_t
kv_stream_hash_avx512(unsigned char *dst, const unsigned char *src, size_t len)
{
    XXH_ALIGN(64) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;
    XXH_ALIGN(64) unsigned char reg[KV_XXH_STRIPE];
    const xxh_u8 *secret = XXH3_kSecret;
    const size_t nb = (len - 1) / KV_XXH_BLOCK;                    /* >= 3 full blocks */
    const size_t k = (KV_XXH_STRIPE - ((uintptr_t)dst & 63)) & 63;  /* dst + k is 64-aligned */
    const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32((int)(k / 4)));
    unsigned char *out = dst + k - KV_XXH_STRIPE;   /* + 64 g: the aligned store made at stripe g */
    __m512i key[KV_XXH_STRIPES];
    __m512i a = _mm512_load_si512((const void *)acc), v, p;
    size_t n, s, off;

    for (s = 0; s < KV_XXH_STRIPES; s++) {
        key[s] = _mm512_loadu_si512((const void *)(secret + 8 * s));
    }
    v = _mm512_loadu_si512((const void *)src);
    a = kv_acc_reg(a, v, key[0]);
    _mm512_store_si512((void *)reg, v);
    memcpy(dst, reg, k);
    for (n = 0; n < nb; n++) {
        off = n * KV_XXH_BLOCK;
        kv_prefetch_ahead(src, off, len);
        for (s = (n == 0); s < KV_XXH_STRIPES; s++) {
            p = v;
            v = _mm512_loadu_si512((const void *)(src + off + 64 * s));
            _mm512_stream_si512((void *)(out + off + 64 * s), _mm512_permutex2var_epi32(p, idx, v));
            a = kv_acc_reg(a, v, key[s]);
        }
        _mm512_store_si512((void *)acc, a);
        XXH3_scrambleAcc_avx512(acc, secret + KV_XXH_SECRET - KV_XXH_STRIPE);
        a = _mm512_load_si512((const void *)acc);
    }
    _mm512_store_si512((void *)reg, v);   /* the last full stripe */
    return kv_stream_tail(acc, dst, src, len, reg, KV_XXH_STRIPE - k);
}

KV_DEFINE_FUSED_REG(kv_fused_avx512, kv_scatter_avx512, kv_stream_hash_avx512, 4)
#  endif
#else
KV_DEFINE_FUSED(kv_fused_default, kv_scatter_default)
#endif


/* Chosen once at import (kv_select_fused). */
static kv_fused_fn kv_fused = NULL;
static kv_scatter_fn kv_scatter = NULL;
static kv_gather_fn kv_gather = NULL;
static const char *kv_fused_name = "none";

static void
kv_select_fused(void)
{
#if KV_X86_64
    int vec = XXH_featureTest();
    kv_fused = kv_fused_sse2;
    kv_scatter = kv_scatter_sse2;
    kv_gather = kv_gather_sse2;
    kv_fused_name = "sse2";
#  if XXH_DISPATCH_AVX2
    if (vec >= XXH_AVX2) {
        kv_fused = kv_fused_avx2;
        kv_scatter = kv_scatter_avx2;
        kv_gather = kv_gather_avx2;
        kv_fused_name = "avx2";
    }
#  endif
#  if XXH_DISPATCH_AVX512
    if (vec >= XXH_AVX512) {
        kv_fused = kv_fused_avx512;
        kv_scatter = kv_scatter_avx512;
        kv_gather = kv_gather_avx512;
        kv_fused_name = "avx512";
    }
#  endif
    (void)vec;
#else
    kv_fused = kv_fused_default;
    kv_scatter = kv_scatter_default;
    kv_gather = kv_gather_default;
    kv_fused_name = "default";
#endif
}

/* Fused copy + XXH3-64 with an explicit kernel and store policy. */
static XXH64_hash_t
kv_copy_hash_with(kv_fused_fn fn, unsigned char *dst, const unsigned char *src,
                  size_t len, int nontemporal)
{
    if (dst == src) {            /* same memory: nothing to copy */
        return KV_XXH3_64(dst, len);
    }
    if (len <= KV_XXH_MIDSIZE_MAX) {
        memcpy(dst, src, len);
        return KV_XXH3_64(dst, len);
    }
    return fn(dst, src, len, nontemporal);
}


/* ------------------------------------------------------------------------ */
/* Python functions                                                          */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(chain_keys_doc,
"chain_keys(seed, tokens, block_size, algo=0, id_size=4) -> bytes\n"
"\n"
"Chained block keys over a whole prompt, n_blocks * 16 bytes, where\n"
"n_blocks = len(tokens) // block_size (only full blocks are keyed).\n"
"key[i] = XXH3_128(key[i-1] || u16le(0x0100) || u32le(4*block_size) ||\n"
"tokens of block i), key[-1] = seed, each key in canonical big-endian form\n"
"(xxhash.xxh3_128_digest).  seed: a 16-byte buffer; tokens: a C-contiguous\n"
"buffer of little-endian token ids, id_size bytes each (4: uint32; 8: int64\n"
"or uint64, narrowed to uint32 here -- any id outside [0, 2**32), also in a\n"
"trailing partial block, raises ValueError); block_size: 1..65536;\n"
"algo: 0 (XXH3_128) only -- SHA-256 chains are computed in Python.");

static PyObject *
kv_chain_keys(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"seed", "tokens", "block_size", "algo", "id_size",
                             NULL};
    PyObject *seed_obj, *tok_obj, *out = NULL;
    Py_ssize_t block_size;
    int algo = KV_ALGO_XXH3_128, id_size = 4, rc = 0;
    Py_buffer seed = {0}, tok = {0};
    size_t n_tokens, n_blocks;
    XXH_ALIGN(64) unsigned char stack_scratch[KV_STACK_SCRATCH];
    unsigned char *scratch = stack_scratch;
    size_t scratch_len;
    (void)self;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOn|ii:chain_keys", kwlist,
                                     &seed_obj, &tok_obj, &block_size, &algo,
                                     &id_size)) {
        return NULL;
    }
    if (id_size != 4 && id_size != 8) {
        PyErr_Format(PyExc_ValueError,
                     "id_size must be 4 (uint32 ids) or 8 (64-bit ids), got %d",
                     id_size);
        return NULL;
    }
    if (algo != KV_ALGO_XXH3_128) {
        PyErr_Format(PyExc_ValueError,
                     "algo must be 0 (XXH3_128); got %d (SHA-256 chains are "
                     "computed in Python)", algo);
        return NULL;
    }
    if (block_size < 1 || block_size > KV_MAX_BLOCK_SIZE) {
        PyErr_Format(PyExc_ValueError,
                     "block_size must be in [1, %d], got %zd",
                     KV_MAX_BLOCK_SIZE, block_size);
        return NULL;
    }
    if (kv_get_ro(seed_obj, &seed, "seed") < 0) {
        return NULL;
    }
    if (seed.len != KV_KEY_LEN) {
        PyErr_Format(PyExc_ValueError, "seed must be exactly %d bytes, got %zd",
                     KV_KEY_LEN, seed.len);
        goto done;
    }
    if (kv_get_ro(tok_obj, &tok, "tokens") < 0) {
        goto done;
    }
    if (tok.len % id_size != 0) {
        PyErr_Format(PyExc_ValueError,
                     "tokens must be a buffer of %d-byte ids (byte length a "
                     "multiple of %d), got %zd bytes", id_size, id_size, tok.len);
        goto done;
    }
    n_tokens = (size_t)tok.len / (size_t)id_size;
    n_blocks = n_tokens / (size_t)block_size;
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n_blocks * KV_KEY_LEN));
    if (out == NULL) {
        goto done;
    }
    scratch_len = KV_CHAIN_BATCH * kv_chain_stride((size_t)block_size);
    if (scratch_len > sizeof(stack_scratch)) {
        scratch = (unsigned char *)PyMem_RawMalloc(scratch_len);
        if (scratch == NULL) {
            Py_CLEAR(out);
            PyErr_NoMemory();
            goto done;
        }
    }
    if (n_blocks * (size_t)block_size * 4 >= KV_NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        rc = kv_chain_xxh3((const unsigned char *)seed.buf,
                           (const unsigned char *)tok.buf, (size_t)id_size,
                           n_tokens, (size_t)block_size, scratch,
                           (unsigned char *)PyBytes_AS_STRING(out));
        Py_END_ALLOW_THREADS
    } else {
        rc = kv_chain_xxh3((const unsigned char *)seed.buf,
                           (const unsigned char *)tok.buf, (size_t)id_size,
                           n_tokens, (size_t)block_size, scratch,
                           (unsigned char *)PyBytes_AS_STRING(out));
    }
    if (scratch != stack_scratch) {
        PyMem_RawFree(scratch);
    }
    if (rc < 0) {
        Py_CLEAR(out);
        PyErr_SetString(PyExc_ValueError,
                        "tokens: a token id is outside [0, 2**32)");
    }

done:
    if (seed.obj != NULL) {
        PyBuffer_Release(&seed);
    }
    if (tok.obj != NULL) {
        PyBuffer_Release(&tok);
    }
    return out;
}


PyDoc_STRVAR(checksum_doc,
"checksum(buf) -> int\n"
"\n"
"XXH3-64 (seed 0) of a C-contiguous buffer; equal to\n"
"xxhash.xxh3_64_intdigest(buf).");

static PyObject *
kv_checksum(PyObject *self, PyObject *arg)
{
    Py_buffer buf;
    XXH64_hash_t h;
    (void)self;

    if (kv_get_ro(arg, &buf, "buf") < 0) {
        return NULL;
    }
    if (buf.len >= KV_NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        h = KV_XXH3_64(buf.buf, (size_t)buf.len);
        Py_END_ALLOW_THREADS
    } else {
        h = KV_XXH3_64(buf.buf, (size_t)buf.len);
    }
    PyBuffer_Release(&buf);
    return PyLong_FromUnsignedLongLong((unsigned long long)h);
}


/* Shared front half of copy_checksum / copy_verify: views + checks. */
static int
kv_copy_args(PyObject *dst_obj, PyObject *src_obj, Py_buffer *dst,
             Py_buffer *src)
{
    const char *d, *s;

    if (kv_get_rw(dst_obj, dst, "dst") < 0) {
        return -1;
    }
    if (kv_get_ro(src_obj, src, "src") < 0) {
        PyBuffer_Release(dst);
        return -1;
    }
    if (dst->len != src->len) {
        PyErr_Format(PyExc_ValueError,
                     "dst and src must have the same length in bytes, got "
                     "dst=%zd src=%zd", dst->len, src->len);
        goto fail;
    }
    d = (const char *)dst->buf;
    s = (const char *)src->buf;
    if (d != s && d < s + src->len && s < d + dst->len) {
        PyErr_SetString(PyExc_ValueError,
                        "dst and src overlap (only identical or disjoint "
                        "buffers are allowed)");
        goto fail;
    }
    return 0;

fail:
    PyBuffer_Release(dst);
    PyBuffer_Release(src);
    return -1;
}

/* Runs the fused copy (GIL released for large inputs), releases the views. */
static XXH64_hash_t
kv_copy_hash_release(Py_buffer *dst, Py_buffer *src, kv_fused_fn fn, int nt)
{
    XXH64_hash_t h;
    unsigned char *d = (unsigned char *)dst->buf;
    const unsigned char *s = (const unsigned char *)src->buf;
    size_t len = (size_t)dst->len;

    if (nt < 0) {
        nt = len >= KV_NT_MIN;
    }
    if (dst->len >= KV_NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        h = kv_copy_hash_with(fn, d, s, len, nt);
        Py_END_ALLOW_THREADS
    } else {
        h = kv_copy_hash_with(fn, d, s, len, nt);
    }
    PyBuffer_Release(dst);
    PyBuffer_Release(src);
    return h;
}


PyDoc_STRVAR(copy_checksum_doc,
"copy_checksum(dst, src) -> int\n"
"\n"
"Copy src into dst (same byte length, dst writable, both C-contiguous,\n"
"identical or disjoint) and return XXH3-64 of the bytes written, in one\n"
"pass: each 1 KiB block is hashed on its way from src to dst, and copies of\n"
"NONTEMPORAL_MIN bytes or more (half the last-level cache, at least 1 MiB)\n"
"use non-temporal stores.");

static PyObject *
kv_copy_checksum(PyObject *self, PyObject *args)
{
    PyObject *dst_obj, *src_obj;
    Py_buffer dst, src;
    XXH64_hash_t h;
    (void)self;

    if (!PyArg_ParseTuple(args, "OO:copy_checksum", &dst_obj, &src_obj)) {
        return NULL;
    }
    if (kv_copy_args(dst_obj, src_obj, &dst, &src) < 0) {
        return NULL;
    }
    h = kv_copy_hash_release(&dst, &src, kv_fused, -1);
    return PyLong_FromUnsignedLongLong((unsigned long long)h);
}


PyDoc_STRVAR(copy_verify_doc,
"copy_verify(dst, src, expected) -> bool\n"
"\n"
"The fused copy of copy_checksum; returns whether the XXH3-64 of the bytes\n"
"equals expected (an int in [0, 2**64)).  dst is written either way.");

static PyObject *
kv_copy_verify(PyObject *self, PyObject *args)
{
    PyObject *dst_obj, *src_obj, *exp_obj;
    unsigned long long expected;
    Py_buffer dst, src;
    XXH64_hash_t h;
    (void)self;

    if (!PyArg_ParseTuple(args, "OOO:copy_verify", &dst_obj, &src_obj,
                          &exp_obj)) {
        return NULL;
    }
    if (!PyLong_Check(exp_obj)) {
        PyErr_Format(PyExc_TypeError,
                     "expected must be an int checksum, not %.100s",
                     Py_TYPE(exp_obj)->tp_name);
        return NULL;
    }
    expected = PyLong_AsUnsignedLongLong(exp_obj);
    if (expected == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError,
                        "expected must be an XXH3-64 checksum in [0, 2**64)");
        return NULL;
    }
    if (kv_copy_args(dst_obj, src_obj, &dst, &src) < 0) {
        return NULL;
    }
    h = kv_copy_hash_release(&dst, &src, kv_fused, -1);
    return PyBool_FromLong((unsigned long long)h == expected);
}


/* The fused copies of a batch: views holds (dst, src) pairs; no Python calls. */
static void
kv_copy_many_run(Py_buffer *views, Py_ssize_t n, unsigned long long *out, int nt)
{
    Py_ssize_t i;

    if (out == NULL) {  /* plain copies: no checksum */
        for (i = 0; i < n; i++) {
            size_t len = (size_t)views[2 * i].len;
            if (nt || len >= KV_NT_MIN) {
                KV_STREAM_COPY((unsigned char *)views[2 * i].buf, (const unsigned char *)views[2 * i + 1].buf, len);
            } else {
                memcpy(views[2 * i].buf, views[2 * i + 1].buf, len);
            }
        }
        KV_STORE_FENCE();
        return;
    }
    for (i = 0; i < n; i++) {
        size_t len = (size_t)views[2 * i].len;
        out[i] = (unsigned long long)kv_copy_hash_with(kv_fused, (unsigned char *)views[2 * i].buf,
                                                       (const unsigned char *)views[2 * i + 1].buf, len,
                                                       nt || len >= KV_NT_MIN);
    }
}


PyDoc_STRVAR(copy_checksum_many_doc,
"copy_checksum_many(dsts, srcs, sums, batch_bytes=0) -> None\n"
"\n"
"copy_checksum over a batch: dsts[i] <- srcs[i] for every i, with the\n"
"XXH3-64 of each block written to sums[i] (a writable buffer of n uint64).\n"
"Non-temporal stores for every block when the batch (or batch_bytes, the\n"
"whole batch of which this call copies a part) is NONTEMPORAL_MIN bytes or\n"
"more.\n"
"sums=None: the same copies with no checksum (a read of bytes that need no\n"
"check, such as a client's own staged put).\n"
"Every pair is checked as copy_checksum checks it before anything is\n"
"copied; the GIL is released once for the whole batch (not once per\n"
"block, which makes two threads copying small blocks queue on it).");

static PyObject *
kv_copy_checksum_many(PyObject *self, PyObject *args)
{
    PyObject *dst_seq, *src_seq, *sums_obj, *dsts = NULL, *srcs = NULL;
    Py_buffer sums, *views = NULL;
    Py_ssize_t n, got = 0, i;
    size_t total = 0;
    unsigned long long *out;
    Py_ssize_t batch_bytes = 0;
    (void)self;

    if (!PyArg_ParseTuple(args, "OOO|n:copy_checksum_many", &dst_seq, &src_seq,
                          &sums_obj, &batch_bytes)) {
        return NULL;
    }
    if (batch_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "batch_bytes must be >= 0");
        return NULL;
    }
    if (sums_obj == Py_None) {
        memset(&sums, 0, sizeof(sums));  /* (PyBuffer_Release of a view with no obj does nothing) */
    } else if (kv_get_rw(sums_obj, &sums, "sums") < 0) {
        return NULL;
    }
    dsts = PySequence_Fast(dst_seq, "dsts must be a sequence");
    srcs = dsts ? PySequence_Fast(src_seq, "srcs must be a sequence") : NULL;
    if (srcs == NULL) {
        goto done;
    }
    n = PySequence_Fast_GET_SIZE(dsts);
    if (PySequence_Fast_GET_SIZE(srcs) != n || (sums_obj != Py_None && sums.len != n * 8)) {
        PyErr_Format(PyExc_ValueError,
                     "%zd dsts, %zd srcs and %zd bytes of sums (8 per block)",
                     n, PySequence_Fast_GET_SIZE(srcs), sums.len);
        goto done;
    }
    views = PyMem_Malloc(sizeof(Py_buffer) * 2 * (size_t)(n ? n : 1));
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (got = 0; got < n; got++) {
        if (kv_copy_args(PySequence_Fast_GET_ITEM(dsts, got),
                         PySequence_Fast_GET_ITEM(srcs, got),
                         &views[2 * got], &views[2 * got + 1]) < 0) {
            break;
        }
        total += (size_t)views[2 * got].len;
    }
    if (got == n) {
        out = sums_obj == Py_None ? NULL : (unsigned long long *)sums.buf;
        int nt = total >= KV_NT_MIN || (size_t)batch_bytes >= KV_NT_MIN;
        if (total >= KV_NOGIL_MIN) {
            Py_BEGIN_ALLOW_THREADS
            kv_copy_many_run(views, n, out, nt);
            Py_END_ALLOW_THREADS
        } else {
            kv_copy_many_run(views, n, out, nt);
        }
    }
    for (i = 0; i < got; i++) {
        PyBuffer_Release(&views[2 * i]);
        PyBuffer_Release(&views[2 * i + 1]);
    }

done:
    PyMem_Free(views);
    Py_XDECREF(dsts);
    Py_XDECREF(srcs);
    PyBuffer_Release(&sums);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_NONE;
}


PyDoc_STRVAR(copy_checksum_with_doc,
"_copy_checksum_with(dst, src, kernel, nontemporal) -> int\n"
"\n"
"copy_checksum with an explicit kernel (one of kernels()) and store policy\n"
"(True: non-temporal stores, False: ordinary stores).  For tests and\n"
"benchmarks; the public functions choose both automatically.");

static PyObject *
kv_copy_checksum_with(PyObject *self, PyObject *args)
{
    PyObject *dst_obj, *src_obj;
    const char *kernel;
    int nt;
    kv_fused_fn fn = NULL;
    Py_buffer dst, src;
    XXH64_hash_t h;
    (void)self;

    if (!PyArg_ParseTuple(args, "OOsp:_copy_checksum_with", &dst_obj, &src_obj,
                          &kernel, &nt)) {
        return NULL;
    }
#if KV_X86_64
    if (strcmp(kernel, "sse2") == 0) {
        fn = kv_fused_sse2;
    }
#  if XXH_DISPATCH_AVX2
    if (strcmp(kernel, "avx2") == 0 && XXH_featureTest() >= XXH_AVX2) {
        fn = kv_fused_avx2;
    }
#  endif
#  if XXH_DISPATCH_AVX512
    if (strcmp(kernel, "avx512") == 0 && XXH_featureTest() >= XXH_AVX512) {
        fn = kv_fused_avx512;
    }
#  endif
#else
    if (strcmp(kernel, "default") == 0) {
        fn = kv_fused_default;
    }
#endif
    if (fn == NULL) {
        PyErr_Format(PyExc_ValueError,
                     "kernel %R is not available here (see kernels())",
                     PyTuple_GET_ITEM(args, 2));
        return NULL;
    }
    if (kv_copy_args(dst_obj, src_obj, &dst, &src) < 0) {
        return NULL;
    }
    h = kv_copy_hash_release(&dst, &src, fn, nt);
    return PyLong_FromUnsignedLongLong((unsigned long long)h);
}


PyDoc_STRVAR(kernels_doc,
"kernels() -> tuple[str, ...]\n"
"\n"
"The fused copy+checksum kernels this CPU can run; the last one is the one\n"
"copy_checksum uses.");

static PyObject *
kv_kernels(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
#if KV_X86_64
    {
        int vec = XXH_featureTest();
        (void)vec;
#  if XXH_DISPATCH_AVX512
        if (vec >= XXH_AVX512) {
            return Py_BuildValue("(sss)", "sse2", "avx2", "avx512");
        }
#  endif
#  if XXH_DISPATCH_AVX2
        if (vec >= XXH_AVX2) {
            return Py_BuildValue("(ss)", "sse2", "avx2");
        }
#  endif
        return Py_BuildValue("(s)", "sse2");
    }
#else
    return Py_BuildValue("(s)", "default");
#endif
}


PyDoc_STRVAR(simd_target_doc,
"simd_target() -> str\n"
"\n"
"The XXH3 long-input kernel in use: \"avx512\", \"avx2\" or \"sse2\" (chosen\n"
"at load time by CPUID on x86-64), else the compile-time target (\"neon\",\n"
"\"scalar\", ...).");

static PyObject *
kv_simd_target(PyObject *self, PyObject *unused)
{
    int vec;
    (void)self;
    (void)unused;
#if KV_X86_64
    vec = XXH_featureTest();
#else
    vec = XXH_VECTOR;
#endif
    switch (vec) {
    case XXH_SCALAR: return PyUnicode_FromString("scalar");
    case XXH_SSE2:   return PyUnicode_FromString("sse2");
    case XXH_AVX2:   return PyUnicode_FromString("avx2");
    case XXH_AVX512: return PyUnicode_FromString("avx512");
    case XXH_NEON:   return PyUnicode_FromString("neon");
    case XXH_VSX:    return PyUnicode_FromString("vsx");
    case XXH_SVE:    return PyUnicode_FromString("sve");
    default:         return PyUnicode_FromFormat("vector-%d", vec);
    }
}


/* ------------------------------------------------------------------------
 * The shared index (kvstore/wire/shared_index.py): the daemon publishes the
 * columns a prefix lookup reads (key table, k0, k1, ns, state, tier) in
 * shared memory; same-host clients probe them without a round trip.
 *
 * Header: u64 seq (odd while the daemon changes the index), u64 gen (which
 * files hold the arrays). The writer bumps seq around every change with a
 * full fence; a reader takes seq (acquire), checks gen, probes, fences and
 * takes seq again: the answer stands only when both reads agree and are
 * even. Whatever a torn read sees, every row it follows is bounds-checked,
 * every probe sequence is bounded by the table size, and the probe only
 * reads: a race gives None (the caller asks the daemon), never a crash.
 * ------------------------------------------------------------------------ */

#define SI_EMPTY (-1)
#define SI_MIX 0x9E3779B97F4A7C15ULL

/* The row of key (a, b) in namespace ns32, or -1; -2 when a slot names a
 * row past ``nrows`` (a torn read: the caller gives up). */
static inline int64_t
si_probe(const int32_t *table, Py_ssize_t tsize, const uint64_t *k0, const uint64_t *k1,
         const uint32_t *nscol, Py_ssize_t nrows, uint64_t a, uint64_t b, uint32_t ns32)
{
    uint64_t mask = (uint64_t)tsize - 1;
    uint64_t pos = (((a ^ ((uint64_t)ns32 * SI_MIX)) * SI_MIX) >> 29) & mask;
    Py_ssize_t probes;
    for (probes = 0; probes < tsize; probes++) {
        int32_t r = __atomic_load_n(&table[pos], __ATOMIC_RELAXED);
        if (r == SI_EMPTY) {
            return -1;
        }
        if (r >= 0) {
            if (r >= nrows) {
                return -2;
            }
            if (k0[r] == a && k1[r] == b && nscol[r] == ns32) {
                return r;
            }
        }
        pos = (pos + 1) & mask;
    }
    return -1;
}

static int
si_header(PyObject *obj, Py_buffer *v, int writable)
{
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        return -1;
    }
    if (v->len < 16 || ((uintptr_t)v->buf & 7)) {
        PyErr_SetString(PyExc_ValueError, "header must be at least 16 bytes, 8-byte aligned");
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(seq_begin_doc,
"seq_begin(header) -> None\n"
"\n"
"Make the sequence (first u64 of header) odd, then a full fence: readers\n"
"ignore what they see from here to seq_end.");

static PyObject *
kv_seq_begin(PyObject *self, PyObject *arg)
{
    Py_buffer v;
    uint64_t *seq;
    (void)self;
    if (si_header(arg, &v, 1) < 0) {
        return NULL;
    }
    seq = (uint64_t *)v.buf;
    __atomic_store_n(seq, (__atomic_load_n(seq, __ATOMIC_RELAXED) | 1), __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(seq_end_doc,
"seq_end(header) -> None\n"
"\n"
"Publish: the next even sequence, stored with release order after every\n"
"change made since seq_begin.");

static PyObject *
kv_seq_end(PyObject *self, PyObject *arg)
{
    Py_buffer v;
    uint64_t *seq, s;
    (void)self;
    if (si_header(arg, &v, 1) < 0) {
        return NULL;
    }
    seq = (uint64_t *)v.buf;
    s = __atomic_load_n(seq, __ATOMIC_RELAXED);
    __atomic_store_n(seq, (s | 1) + 1, __ATOMIC_RELEASE);
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(shared_lookup_doc,
"shared_lookup(header, gen, table, k0, k1, nscol, state, tier, keys, ns, committed)\n"
"    -> (hit, tiers) | None\n"
"\n"
"The leading keys of ``keys`` (n x 16 bytes) present in namespace ``ns``\n"
"with state ``committed``: their count and one byte per hit (tier + 1, the\n"
"wire Tier value). None when the index changed meanwhile, ``gen`` is not\n"
"the header's, or the arrays disagree (ask the daemon instead).");

static PyObject *
kv_shared_lookup(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer hb, tb, k0b, k1b, nsb, stb, tib, qb;
    unsigned long long gen;
    long long ns, committed;
    PyObject *result = NULL;
    (void)self;

    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "shared_lookup takes 11 arguments");
        return NULL;
    }
    gen = PyLong_AsUnsignedLongLong(args[1]);
    ns = PyLong_AsLongLong(args[9]);
    committed = PyLong_AsLongLong(args[10]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (si_header(args[0], &hb, 0) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[2], &tb, PyBUF_C_CONTIGUOUS) < 0) goto h0;
    if (PyObject_GetBuffer(args[3], &k0b, PyBUF_C_CONTIGUOUS) < 0) goto h1;
    if (PyObject_GetBuffer(args[4], &k1b, PyBUF_C_CONTIGUOUS) < 0) goto h2;
    if (PyObject_GetBuffer(args[5], &nsb, PyBUF_C_CONTIGUOUS) < 0) goto h3;
    if (PyObject_GetBuffer(args[6], &stb, PyBUF_C_CONTIGUOUS) < 0) goto h4;
    if (PyObject_GetBuffer(args[7], &tib, PyBUF_C_CONTIGUOUS) < 0) goto h5;
    if (PyObject_GetBuffer(args[8], &qb, PyBUF_C_CONTIGUOUS) < 0) goto h6;
    {
        const uint64_t *hdr = (const uint64_t *)hb.buf;
        const int32_t *table = (const int32_t *)tb.buf;
        const uint64_t *k0 = (const uint64_t *)k0b.buf, *k1 = (const uint64_t *)k1b.buf;
        const uint32_t *nscol = (const uint32_t *)nsb.buf;
        const uint8_t *state = (const uint8_t *)stb.buf, *tier = (const uint8_t *)tib.buf;
        const unsigned char *q = (const unsigned char *)qb.buf;
        Py_ssize_t tsize = tb.len / 4, nrows = k0b.len / 8, n = qb.len / 16, i, hit = 0;
        uint64_t s1, s2;
        uint32_t ns32 = (uint32_t)ns;
        unsigned char small[256], *out = small;
        PyObject *tiers;

        if (k1b.len / 8 < nrows) nrows = k1b.len / 8;
        if (nsb.len / 4 < nrows) nrows = nsb.len / 4;
        if (stb.len < nrows) nrows = stb.len;
        if (tib.len < nrows) nrows = tib.len;
        if (qb.len % 16 || tsize == 0 || (tsize & (tsize - 1))
                || ((uintptr_t)table & 3) || ((uintptr_t)k0 & 7) || ((uintptr_t)k1 & 7) || ((uintptr_t)nscol & 3)) {
            PyErr_SetString(PyExc_ValueError, "shared_lookup: bad arrays");
            goto h7;
        }
        if (n > (Py_ssize_t)sizeof(small)) {
            out = (unsigned char *)PyMem_Malloc((size_t)n);
            if (out == NULL) {
                PyErr_NoMemory();
                goto h7;
            }
        }
        s1 = __atomic_load_n(&hdr[0], __ATOMIC_ACQUIRE);
        if ((s1 & 1) || __atomic_load_n(&hdr[1], __ATOMIC_ACQUIRE) != (uint64_t)gen) {
            goto raced;
        }
        for (i = 0; i < n; i++) {
            uint64_t a, b;
            int64_t found;
            memcpy(&a, q + 16 * i, 8);
            memcpy(&b, q + 16 * i + 8, 8);
            found = si_probe(table, tsize, k0, k1, nscol, nrows, a, b, ns32);
            if (found == -2) {
                goto raced;  /* a torn read: the row is past what we mapped */
            }
            if (found < 0 || state[found] != (uint8_t)committed) {
                break;
            }
            out[hit++] = (unsigned char)(tier[found] + 1);
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        s2 = __atomic_load_n(&hdr[0], __ATOMIC_RELAXED);
        if (s1 != s2) {
            goto raced;
        }
        tiers = PyBytes_FromStringAndSize((const char *)out, hit);
        if (tiers != NULL) {
            result = Py_BuildValue("(nN)", hit, tiers);
        }
        if (out != small) PyMem_Free(out);
        goto h7;
    raced:
        if (out != small) PyMem_Free(out);
        Py_INCREF(Py_None);
        result = Py_None;
    }
h7: PyBuffer_Release(&qb);
h6: PyBuffer_Release(&tib);
h5: PyBuffer_Release(&stb);
h4: PyBuffer_Release(&nsb);
h3: PyBuffer_Release(&k1b);
h2: PyBuffer_Release(&k0b);
h1: PyBuffer_Release(&tb);
h0: PyBuffer_Release(&hb);
    return result;
}


/* The index keeps a DRAM slot's byte offset over its 4 KiB unit, in 32 bits
 * (kvstore/core/index.py LOC_SHIFT; kvstore/wire/shared_index.py checks the
 * module's LOC_SHIFT against its own before it calls shared_slots). */
#define KV_LOC_SHIFT 12

PyDoc_STRVAR(shared_slots_doc,
"shared_slots(header, gen, table, k0, k1, nscol, state, tier, loc, size, csum, keys, ns,\n"
"             committed, dram) -> (hit, clean, slots) | None\n"
"\n"
"Like shared_lookup, for a read: the leading keys committed in namespace\n"
"``ns`` with tier ``dram``. ``slots`` is ``hit`` records of four int64\n"
"(row, offset, size, checksum as its uint64 bits; the offset is the int32\n"
"``loc`` times 2**LOC_SHIFT, its slot's unit); ``clean`` is False when\n"
"the scan stopped at a block that is present but not in DRAM (only the\n"
"daemon can serve it). None when the index changed meanwhile or ``gen``\n"
"is not the header's.");

static PyObject *
kv_shared_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer b[12];
    static const Py_ssize_t item[12] = {8, 4, 8, 8, 4, 1, 1, 4, 4, 8, 1, 0};
    unsigned long long gen;
    long long ns, committed, dram;
    PyObject *result = NULL;
    int got = 0, k;
    (void)self;

    if (nargs != 15) {
        PyErr_SetString(PyExc_TypeError, "shared_slots takes 15 arguments");
        return NULL;
    }
    gen = PyLong_AsUnsignedLongLong(args[1]);
    ns = PyLong_AsLongLong(args[12]);
    committed = PyLong_AsLongLong(args[13]);
    dram = PyLong_AsLongLong(args[14]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    /* header, table, k0, k1, nscol, state, tier, loc, size, csum, keys */
    for (k = 0; k < 11; k++) {
        PyObject *o = args[k == 0 ? 0 : k + 1];
        if (PyObject_GetBuffer(o, &b[k], PyBUF_C_CONTIGUOUS) < 0) {
            goto done;
        }
        got = k + 1;
        if (k < 10 && (((uintptr_t)b[k].buf) % (uintptr_t)item[k])) {
            PyErr_SetString(PyExc_ValueError, "shared_slots: misaligned array");
            goto done;
        }
    }
    {
        const uint64_t *hdr = (const uint64_t *)b[0].buf;
        const int32_t *table = (const int32_t *)b[1].buf;
        const uint64_t *k0 = (const uint64_t *)b[2].buf, *k1 = (const uint64_t *)b[3].buf;
        const uint32_t *nscol = (const uint32_t *)b[4].buf;
        const uint8_t *state = (const uint8_t *)b[5].buf, *tier = (const uint8_t *)b[6].buf;
        const int32_t *loc = (const int32_t *)b[7].buf;
        const uint32_t *size = (const uint32_t *)b[8].buf;
        const uint64_t *csum = (const uint64_t *)b[9].buf;
        const unsigned char *q = (const unsigned char *)b[10].buf;
        Py_ssize_t tsize = b[1].len / 4, nrows = b[2].len / 8, n = b[10].len / 16, i, hit = 0;
        uint64_t s1, s2;
        uint32_t ns32 = (uint32_t)ns;
        int clean = 1;
        PyObject *slots;
        int64_t *out;

        if (b[3].len / 8 < nrows) nrows = b[3].len / 8;
        if (b[4].len / 4 < nrows) nrows = b[4].len / 4;
        if (b[5].len < nrows) nrows = b[5].len;
        if (b[6].len < nrows) nrows = b[6].len;
        if (b[7].len / 4 < nrows) nrows = b[7].len / 4;
        if (b[8].len / 4 < nrows) nrows = b[8].len / 4;
        if (b[9].len / 8 < nrows) nrows = b[9].len / 8;
        if (b[0].len < 16 || b[10].len % 16 || tsize == 0 || (tsize & (tsize - 1))) {
            PyErr_SetString(PyExc_ValueError, "shared_slots: bad arrays");
            goto done;
        }
        slots = PyBytes_FromStringAndSize(NULL, n * 32);
        if (slots == NULL) {
            goto done;
        }
        out = (int64_t *)PyBytes_AS_STRING(slots);
        s1 = __atomic_load_n(&hdr[0], __ATOMIC_ACQUIRE);
        if ((s1 & 1) || __atomic_load_n(&hdr[1], __ATOMIC_ACQUIRE) != (uint64_t)gen) {
            Py_DECREF(slots);
            goto raced;
        }
        for (i = 0; i < n; i++) {
            uint64_t a, bb;
            int64_t found;
            memcpy(&a, q + 16 * i, 8);
            memcpy(&bb, q + 16 * i + 8, 8);
            found = si_probe(table, tsize, k0, k1, nscol, nrows, a, bb, ns32);
            if (found == -2) {
                Py_DECREF(slots);
                goto raced;
            }
            if (found < 0 || state[found] != (uint8_t)committed) {
                break;
            }
            if (tier[found] != (uint8_t)dram) {
                clean = 0;
                break;
            }
            out[4 * hit] = found;
            out[4 * hit + 1] = (int64_t)loc[found] * ((int64_t)1 << KV_LOC_SHIFT);
            out[4 * hit + 2] = (int64_t)size[found];
            memcpy(&out[4 * hit + 3], &csum[found], 8);
            hit++;
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        s2 = __atomic_load_n(&hdr[0], __ATOMIC_RELAXED);
        if (s1 != s2) {
            Py_DECREF(slots);
            goto raced;
        }
        if (_PyBytes_Resize(&slots, hit * 32) < 0) {
            goto done;
        }
        result = Py_BuildValue("(nON)", hit, clean ? Py_True : Py_False, slots);
        goto done;
    }
raced:
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (k = 0; k < got; k++) {
        PyBuffer_Release(&b[k]);
    }
    return result;
}


/* ------------------------------------------------------------------------ */
/* Verified scatter of one block into an engine's per-layer arrays           */
/* ------------------------------------------------------------------------ */

#define KV_SCATTER_MAX_DSTS 4096

/* A private copy of the first len bytes of an int64 table (pieces, indices,
 * slots) that a call checks and then reads again with the GIL released: a
 * destination that aliases it, or another thread writing it meanwhile, must
 * not change what was checked before it is used.  NULL with MemoryError. */
static int64_t *
kv_snapshot(const Py_buffer *b, Py_ssize_t len)
{
    int64_t *p = PyMem_Malloc(len > 0 ? (size_t)len : 1);
    if (p == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    if (len > 0) {
        memcpy(p, b->buf, (size_t)len);
    }
    return p;
}

/* A sealed block's seal (kvstore/client/shards.py) at seal: 1 and *own =
 * shard rank's checksum when it holds the magic, shard_bytes and key; else 0. */
static int
kv_seal_own(const unsigned char *seal, uint64_t shard_bytes, size_t rank, const unsigned char *key,
            uint64_t *own)
{
    uint64_t got_shard, sum;
    memcpy(&got_shard, seal + 8, 8);             /* the seal is little-endian */
    memcpy(&sum, seal + 32 + 8 * rank, 8);
    if (!XXH_CPU_LITTLE_ENDIAN) {
        got_shard = XXH_swap64(got_shard);
        sum = XXH_swap64(sum);
    }
    if (memcmp(seal, "KVSEAL01", 8) != 0 || got_shard != shard_bytes || memcmp(seal + 16, key, 16) != 0) {
        return 0;
    }
    *own = sum;
    return 1;
}

/* Every piece (rows of 5 int64: src offset, length, dst, base, stride) fits
 * its destination dsts[dst] at engine block index hi_i (the highest of a
 * batch), hence at every index from 0 to it (base and stride are >= 0).
 * 0 or -1 with ValueError. */
static int
kv_pieces_fit(const int64_t *pc, Py_ssize_t np_, const Py_buffer *db, Py_ssize_t nd, int64_t hi_i)
{
    Py_ssize_t r;
    for (r = 0; r < np_; r++) {
        int64_t len = pc[5 * r + 1], d = pc[5 * r + 2], base = pc[5 * r + 3], stride = pc[5 * r + 4];
        if (d < 0 || d >= nd || base < 0 || stride < 0 || len < 0 || base > db[d].len ||
            len > db[d].len - base || (hi_i > 0 && stride > (db[d].len - base - len) / hi_i)) {
            PyErr_Format(PyExc_ValueError, "piece %zd does not fit its destination", r);
            return -1;
        }
    }
    return 0;
}

/* The non-empty pieces in block order for a direct scatter: ord[k] is the
 * row of the k-th, sp[k] its offset and length (dst filled per block);
 * ValueError when two overlap.  The caller frees *sp and *ord (also on
 * error). */
static int
kv_pieces_sorted(const int64_t *pc, Py_ssize_t np_, kv_span **sp, Py_ssize_t **ord, Py_ssize_t *nsp)
{
    Py_ssize_t r, k, m = 0;
    Py_ssize_t *o;
    *sp = PyMem_Calloc((size_t)(np_ ? np_ : 1), sizeof(kv_span));
    *ord = o = PyMem_Calloc((size_t)(np_ ? np_ : 1), sizeof(Py_ssize_t));
    if (*sp == NULL || o == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (r = 0; r < np_; r++) {
        if (pc[5 * r + 1] == 0) {
            continue;
        }
        for (k = m; k > 0 && pc[5 * o[k - 1]] > pc[5 * r]; k--) {
            o[k] = o[k - 1];
        }
        o[k] = r;
        m++;
    }
    for (r = 0; r + 1 < m; r++) {
        if (pc[5 * o[r]] + pc[5 * o[r] + 1] > pc[5 * o[r + 1]]) {
            PyErr_SetString(PyExc_ValueError, "pieces overlap in the block: pass a scratch buffer");
            return -1;
        }
    }
    for (r = 0; r < m; r++) {
        (*sp)[r].off = (size_t)pc[5 * o[r]];
        (*sp)[r].len = (size_t)pc[5 * o[r] + 1];
    }
    *nsp = m;
    return 0;
}

PyDoc_STRVAR(verify_scatter_many_doc,
"verify_scatter_many(srcs, expected, scratch, pieces, dsts, indices, ok) -> None\n"
"\n"
"For each block srcs[i] (checksum expected[i], a buffer of uint64): copy it\n"
"into scratch (private, at least as long) with the fused copy+XXH3-64 of\n"
"copy_verify; only when that equals expected[i], copy pieces of the checked\n"
"bytes in scratch to their places at engine block indices[i] (a buffer of\n"
"int64 >= 0): pieces is a C-contiguous int64 buffer of rows (src_offset,\n"
"length, dst, base, stride), and row r writes scratch[src_offset :\n"
"src_offset + length] to dsts[dst] (a tuple of writable buffers) at byte\n"
"base + index * stride.  ok[i] (a writable buffer of uint8) says whether\n"
"block i matched.  Every place of every block is bounds-checked (ValueError)\n"
"before anything is written; a block that does not match writes nothing\n"
"but scratch.  scratch None: no staging copy -- each block's bytes go\n"
"straight to their places and are hashed there (pieces must not overlap in\n"
"the block), so a block that does not match HAS written its places, and\n"
"the caller must treat them as garbage.  Either way the bytes that reach\n"
"dsts are the bytes hashed, even if another process rewrites src.  The\n"
"destinations' buffers are taken once for the batch, and the GIL is\n"
"released once for all of it.");

static PyObject *
kv_verify_scatter_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer exp, scr, pcs, idx, okb;
    Py_buffer *db = NULL, *sb = NULL;
    PyObject *dsts, *srcs = NULL;
    Py_ssize_t nd = 0, n, got = 0, gots = 0, np_, r, i;
    int64_t *pc = NULL, *ix = NULL;
    const unsigned long long *ev;
    unsigned char *okp;
    int64_t lo_i = 0, hi_i = 0;
    Py_ssize_t maxlen = 0;
    int fail = 1, direct;
    kv_span *sp = NULL;
    Py_ssize_t *ord = NULL, nsp = 0;
    (void)self;

    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "verify_scatter_many takes 7 arguments");
        return NULL;
    }
    dsts = args[4];
    if (!PyTuple_Check(dsts) || PyTuple_GET_SIZE(dsts) > KV_SCATTER_MAX_DSTS) {
        PyErr_SetString(PyExc_TypeError, "dsts must be a tuple of at most 4096 writable buffers");
        return NULL;
    }
    if (kv_get_ro(args[1], &exp, "expected") < 0) {
        return NULL;
    }
    direct = args[2] == Py_None;
    if (direct) {
        memset(&scr, 0, sizeof scr);
    } else if (kv_get_rw(args[2], &scr, "scratch") < 0) {
        goto e0;
    }
    if (kv_get_ro(args[3], &pcs, "pieces") < 0) {
        goto e1;
    }
    if (kv_get_ro(args[5], &idx, "indices") < 0) {
        goto e2;
    }
    if (kv_get_rw(args[6], &okb, "ok") < 0) {
        goto e3;
    }
    srcs = PySequence_Fast(args[0], "srcs must be a sequence");
    if (srcs == NULL) {
        goto e4;
    }
    n = PySequence_Fast_GET_SIZE(srcs);
    if (exp.len != n * 8 || idx.len != n * 8 || okb.len != n) {
        PyErr_Format(PyExc_ValueError, "%zd blocks: expected, indices and ok must hold 8, 8 and 1 "
                     "bytes per block", n);
        goto e5;
    }
    if (pcs.len % (5 * 8)) {
        PyErr_SetString(PyExc_ValueError, "pieces must be rows of 5 int64");
        goto e5;
    }
    ix = kv_snapshot(&idx, idx.len);
    pc = kv_snapshot(&pcs, pcs.len);
    if (ix == NULL || pc == NULL) {
        goto e6;
    }
    for (i = 0; i < n; i++) {
        if (ix[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "indices must be >= 0");
            goto e6;
        }
        if (i == 0 || ix[i] < lo_i) {
            lo_i = ix[i];
        }
        if (i == 0 || ix[i] > hi_i) {
            hi_i = ix[i];
        }
    }
    sb = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    nd = PyTuple_GET_SIZE(dsts);
    db = PyMem_Calloc((size_t)(nd ? nd : 1), sizeof(Py_buffer));
    if (sb == NULL || db == NULL) {
        PyErr_NoMemory();
        goto e6;
    }
    for (gots = 0; gots < n; gots++) {
        if (kv_get_ro(PySequence_Fast_GET_ITEM(srcs, gots), &sb[gots], "srcs[i]") < 0) {
            goto e6;
        }
        if (sb[gots].len > maxlen) {
            maxlen = sb[gots].len;
        }
        if (!direct && (const char *)scr.buf < (const char *)sb[gots].buf + sb[gots].len &&
            (const char *)sb[gots].buf < (const char *)scr.buf + sb[gots].len) {
            PyErr_SetString(PyExc_ValueError, "scratch overlaps a src");
            gots++;
            goto e6;
        }
    }
    if (!direct && scr.len < maxlen) {
        PyErr_Format(PyExc_ValueError, "scratch of %zd bytes for a block of %zd", scr.len, maxlen);
        goto e6;
    }
    for (got = 0; got < nd; got++) {
        if (kv_get_rw(PyTuple_GET_ITEM(dsts, got), &db[got], "dsts[i]") < 0) {
            goto e6;
        }
    }
    np_ = pcs.len / (5 * 8);
    for (i = 0; i < n; i++) {  /* every piece of every block fits its source */
        for (r = 0; r < np_; r++) {
            int64_t off = pc[5 * r], len = pc[5 * r + 1];
            if (off < 0 || len < 0 || off > sb[i].len || len > sb[i].len - off) {
                PyErr_Format(PyExc_ValueError, "piece %zd does not fit block %zd", r, i);
                goto e6;
            }
        }
    }
    if (kv_pieces_fit(pc, np_, db, nd, hi_i) < 0) {  /* ... and its destination at every index */
        goto e6;
    }
    for (r = 0; !direct && r < np_; r++) {
        const char *lo = (const char *)db[pc[5 * r + 2]].buf + pc[5 * r + 3] + lo_i * pc[5 * r + 4];
        const char *hi = (const char *)db[pc[5 * r + 2]].buf + pc[5 * r + 3] + hi_i * pc[5 * r + 4] + pc[5 * r + 1];
        if (lo < (const char *)scr.buf + maxlen && (const char *)scr.buf < hi) {
            PyErr_SetString(PyExc_ValueError, "a destination overlaps scratch");
            goto e6;
        }
    }
    if (direct && kv_pieces_sorted(pc, np_, &sp, &ord, &nsp) < 0) {  /* in block order, not overlapping */
        goto e6;
    }
    ev = (const unsigned long long *)exp.buf;
    okp = (unsigned char *)okb.buf;
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; direct && i < n; i++) {
        for (r = 0; r < nsp; r++) {
            const int64_t *row = pc + 5 * ord[r];
            sp[r].dst = (unsigned char *)db[row[2]].buf + row[3] + ix[i] * row[4];
        }
        okp[i] = (unsigned long long)kv_scatter_hash(kv_scatter, (const unsigned char *)sb[i].buf,
                                                     (size_t)sb[i].len, sp, (size_t)nsp) == ev[i];
    }
    for (i = 0; !direct && i < n; i++) {
        XXH64_hash_t h = kv_copy_hash_with(kv_fused, (unsigned char *)scr.buf,
                                           (const unsigned char *)sb[i].buf, (size_t)sb[i].len, 0);
        okp[i] = (unsigned long long)h == ev[i];
        if (okp[i]) {
            for (r = 0; r < np_; r++) {
                memcpy((char *)db[pc[5 * r + 2]].buf + pc[5 * r + 3] + ix[i] * pc[5 * r + 4],
                       (const char *)scr.buf + pc[5 * r], (size_t)pc[5 * r + 1]);
            }
        }
    }
    Py_END_ALLOW_THREADS
    fail = 0;
e6:
    for (r = 0; r < got; r++) {
        PyBuffer_Release(&db[r]);
    }
    for (r = 0; r < gots; r++) {
        PyBuffer_Release(&sb[r]);
    }
    PyMem_Free(db);
    PyMem_Free(sb);
    PyMem_Free(sp);
    PyMem_Free(ord);
    PyMem_Free(pc);
    PyMem_Free(ix);
e5:
    Py_DECREF(srcs);
e4:
    PyBuffer_Release(&okb);
e3:
    PyBuffer_Release(&idx);
e2:
    PyBuffer_Release(&pcs);
e1:
    if (!direct) {
        PyBuffer_Release(&scr);
    }
e0:
    PyBuffer_Release(&exp);
    if (fail) {
        return NULL;
    }
    Py_RETURN_NONE;
}


/* ------------------------------------------------------------------------ */
/* A read straight from the slab: the shared index's slots to an engine      */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(scatter_slots_doc,
"scatter_slots(slab, slots, block_bytes, pieces, dsts, indices, seal=None) -> int\n"
"\n"
"A read of blocks straight out of the daemon's slab into an engine's\n"
"arrays, in one call: slots are int64 rows (row, offset, length, checksum)\n"
"as shared_slots answers them; block i is slab[offset : offset + length]\n"
"and goes to engine block indices[i] (int64 >= 0, at least one per slot)\n"
"as verify_scatter_many's direct scatter places it (no scratch; pieces must\n"
"not overlap in the block).  seal None: the whole block is hashed against\n"
"the slot's checksum.  seal (keys, tp, rank, shard_bytes): sealed blocks\n"
"(kvstore/client/shards.py) of block_bytes = tp * shard_bytes +\n"
"seal_bytes(tp); block i's seal must hold KVSEAL01, shard_bytes and\n"
"keys[16 i : 16 i + 16], and this rank's shard (the pieces' offsets are\n"
"relative to it) is hashed against the seal's entry.  Returns -1, having\n"
"written nothing, when a slot is not block_bytes long or lies outside\n"
"slab; else how many leading blocks matched (it stops at the first that\n"
"does not, whose places are then garbage).  ValueError for pieces that do\n"
"not fit the block or a destination, or overlap.  The GIL is released\n"
"once for the batch.");

static PyObject *
kv_scatter_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer slab, slots, pcs, idx, keys;
    Py_buffer *db = NULL;
    PyObject *dsts, *seal;
    Py_ssize_t nd = 0, n, np_, r, i, got = 0, nsp = 0, done = -1;
    long long block, tp = 1, rank = 0, shard = 0;
    int64_t *sl = NULL, *pc = NULL, *ix = NULL;
    int64_t hi_i = 0;
    size_t at = 0, part;
    kv_span *sp = NULL;
    Py_ssize_t *ord = NULL;
    int sealed, fail = 1;
    (void)self;

    if (nargs != 6 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "scatter_slots takes 6 or 7 arguments");
        return NULL;
    }
    dsts = args[4];
    if (!PyTuple_Check(dsts) || PyTuple_GET_SIZE(dsts) > KV_SCATTER_MAX_DSTS) {
        PyErr_SetString(PyExc_TypeError, "dsts must be a tuple of at most 4096 writable buffers");
        return NULL;
    }
    block = PyLong_AsLongLong(args[2]);
    if (block == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (block <= 0 || block > ((long long)1 << 40)) {
        PyErr_SetString(PyExc_ValueError, "scatter_slots: 0 < block_bytes <= 2**40");
        return NULL;
    }
    seal = nargs == 7 ? args[6] : Py_None;
    sealed = seal != Py_None;
    part = (size_t)block;
    memset(&keys, 0, sizeof keys);
    if (sealed) {
        if (!PyTuple_Check(seal) || PyTuple_GET_SIZE(seal) != 4) {
            PyErr_SetString(PyExc_TypeError, "seal must be (keys, tp, rank, shard_bytes)");
            return NULL;
        }
        tp = PyLong_AsLongLong(PyTuple_GET_ITEM(seal, 1));
        rank = PyLong_AsLongLong(PyTuple_GET_ITEM(seal, 2));
        shard = PyLong_AsLongLong(PyTuple_GET_ITEM(seal, 3));
        if (PyErr_Occurred()) {
            return NULL;
        }
        if (tp < 1 || tp > 4096 || rank < 0 || rank >= tp || shard <= 0 || shard > ((long long)1 << 40)) {
            PyErr_SetString(PyExc_ValueError, "scatter_slots: 1 <= tp <= 4096, 0 <= rank < tp, "
                            "0 < shard_bytes <= 2**40");
            return NULL;
        }
        at = (size_t)tp * (size_t)shard;
        if ((size_t)block != at + (((size_t)32 + 8 * (size_t)tp + 63) / 64) * 64) {
            PyErr_SetString(PyExc_ValueError, "block_bytes is not a sealed block of tp shards of shard_bytes");
            return NULL;
        }
        part = (size_t)shard;
        if (kv_get_ro(PyTuple_GET_ITEM(seal, 0), &keys, "keys") < 0) {
            return NULL;
        }
    }
    if (kv_get_ro(args[0], &slab, "slab") < 0) {
        goto e0;
    }
    if (kv_get_ro(args[1], &slots, "slots") < 0) {
        goto e1;
    }
    if (kv_get_ro(args[3], &pcs, "pieces") < 0) {
        goto e2;
    }
    if (kv_get_ro(args[5], &idx, "indices") < 0) {
        goto e3;
    }
    n = slots.len / 32;
    if (slots.len % 32 || pcs.len % 40 || idx.len % 8 || idx.len < n * 8 || (sealed && keys.len != n * 16)) {
        PyErr_Format(PyExc_ValueError, "%zd slots: slots must be rows of 4 int64, pieces rows of 5, indices "
                     "at least one int64 per slot%s", n, sealed ? ", keys 16 bytes per slot" : "");
        goto e4;
    }
    sl = kv_snapshot(&slots, slots.len);
    pc = kv_snapshot(&pcs, pcs.len);
    ix = kv_snapshot(&idx, n * 8);
    if (sl == NULL || pc == NULL || ix == NULL) {
        goto e5;
    }
    np_ = pcs.len / 40;
    for (i = 0; i < n; i++) {
        if (ix[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "indices must be >= 0");
            goto e5;
        }
        if (ix[i] > hi_i) {
            hi_i = ix[i];
        }
    }
    for (r = 0; r < np_; r++) {
        int64_t off = pc[5 * r], len = pc[5 * r + 1];
        if (off < 0 || len < 0 || (size_t)off > part || (size_t)len > part - (size_t)off) {
            PyErr_Format(PyExc_ValueError, "piece %zd does not fit the block", r);
            goto e5;
        }
    }
    for (i = 0; i < n; i++) {  /* a slot of another size, or outside the slab: not read here */
        int64_t off = sl[4 * i + 1], len = sl[4 * i + 2];
        if (len != block || off < 0 || off > (int64_t)slab.len - block) {
            fail = 0;
            goto e5;
        }
    }
    nd = PyTuple_GET_SIZE(dsts);
    db = PyMem_Calloc((size_t)(nd ? nd : 1), sizeof(Py_buffer));
    if (db == NULL) {
        PyErr_NoMemory();
        goto e5;
    }
    for (got = 0; got < nd; got++) {
        if (kv_get_rw(PyTuple_GET_ITEM(dsts, got), &db[got], "dsts[i]") < 0) {
            goto e5;
        }
    }
    if (kv_pieces_fit(pc, np_, db, nd, hi_i) < 0 || kv_pieces_sorted(pc, np_, &sp, &ord, &nsp) < 0) {
        goto e5;
    }
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n; i++) {
        const unsigned char *src = (const unsigned char *)slab.buf + sl[4 * i + 1];
        uint64_t want = (uint64_t)sl[4 * i + 3];
        if (sealed) {
            if (!kv_seal_own(src + at, (uint64_t)shard, (size_t)rank, (const unsigned char *)keys.buf + 16 * i,
                             &want)) {
                break;
            }
            src += (size_t)rank * (size_t)shard;
        }
        for (r = 0; r < nsp; r++) {
            const int64_t *row = pc + 5 * ord[r];
            sp[r].dst = (unsigned char *)db[row[2]].buf + row[3] + ix[i] * row[4];
        }
        if ((uint64_t)kv_scatter_hash(kv_scatter, src, part, sp, (size_t)nsp) != want) {
            break;
        }
    }
    done = i;
    Py_END_ALLOW_THREADS
    fail = 0;
e5:
    for (r = 0; r < got; r++) {
        PyBuffer_Release(&db[r]);
    }
    PyMem_Free(db);
    PyMem_Free(sp);
    PyMem_Free(ord);
    PyMem_Free(sl);
    PyMem_Free(pc);
    PyMem_Free(ix);
e4:
    PyBuffer_Release(&idx);
e3:
    PyBuffer_Release(&pcs);
e2:
    PyBuffer_Release(&slots);
e1:
    PyBuffer_Release(&slab);
e0:
    if (sealed) {
        PyBuffer_Release(&keys);
    }
    if (fail) {
        return NULL;
    }
    return PyLong_FromSsize_t(done);
}


/* ------------------------------------------------------------------------ */
/* Gathered save of blocks from an engine's per-layer arrays                 */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(gather_many_doc,
"gather_many(dsts, pieces, srcs, indices, out) -> None\n"
"\n"
"The reverse of verify_scatter_many, for saves: block i is gathered into\n"
"dsts[i] (a writable buffer, e.g. a reserved slot) from engine block\n"
"indices[i] (a buffer of int64 >= 0): row (dst_offset, length, src, base,\n"
"stride) of pieces (C-contiguous int64) copies srcs[src] (a tuple of\n"
"buffers) at byte base + index * stride to dsts[i][dst_offset :\n"
"dst_offset + length].  Non-empty pieces must not overlap in the block.\n"
"out (a writable buffer of uint64, one per block) receives the XXH3-64 of\n"
"each block's bytes, hashed 1 KiB at a time while in L1 right after they\n"
"were gathered; the pieces must then cover every byte of every dsts[i].\n"
"out None: copy only (e.g. one rank's shard of a slot).  Everything is\n"
"bounds-checked (ValueError) before anything is written; the GIL is\n"
"released once for the batch.");

static PyObject *
kv_gather_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer pcs, idx, outb;
    Py_buffer *db = NULL, *sb = NULL;
    PyObject *dsts = NULL, *srcs;
    Py_ssize_t ns = 0, n, got = 0, gots = 0, np_, r, i, k;
    int64_t *pc = NULL, *ix = NULL;
    int64_t lo_i = 0, hi_i = 0;
    int fail = 1, want;
    size_t end = 0;
    kv_gspan *sp = NULL;
    Py_ssize_t *ord = NULL, nsp = 0;
    const char **lo = NULL, **hi = NULL;
    (void)self;

    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "gather_many takes 5 arguments");
        return NULL;
    }
    srcs = args[2];
    if (!PyTuple_Check(srcs) || PyTuple_GET_SIZE(srcs) > KV_SCATTER_MAX_DSTS) {
        PyErr_SetString(PyExc_TypeError, "srcs must be a tuple of at most 4096 buffers");
        return NULL;
    }
    want = args[4] != Py_None;
    memset(&outb, 0, sizeof outb);
    if (kv_get_ro(args[1], &pcs, "pieces") < 0) {
        return NULL;
    }
    if (kv_get_ro(args[3], &idx, "indices") < 0) {
        goto e1;
    }
    if (want && kv_get_rw(args[4], &outb, "out") < 0) {
        goto e2;
    }
    dsts = PySequence_Fast(args[0], "dsts must be a sequence");
    if (dsts == NULL) {
        goto e3;
    }
    n = PySequence_Fast_GET_SIZE(dsts);
    if (idx.len != n * 8 || (want && outb.len != n * 8)) {
        PyErr_Format(PyExc_ValueError, "%zd blocks: indices and out must hold 8 bytes per block", n);
        goto e4;
    }
    if (pcs.len % (5 * 8)) {
        PyErr_SetString(PyExc_ValueError, "pieces must be rows of 5 int64");
        goto e4;
    }
    ix = kv_snapshot(&idx, idx.len);
    pc = kv_snapshot(&pcs, pcs.len);
    if (ix == NULL || pc == NULL) {
        goto e5;
    }
    for (i = 0; i < n; i++) {
        if (ix[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "indices must be >= 0");
            goto e5;
        }
        if (i == 0 || ix[i] < lo_i) {
            lo_i = ix[i];
        }
        if (i == 0 || ix[i] > hi_i) {
            hi_i = ix[i];
        }
    }
    np_ = pcs.len / (5 * 8);
    db = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    ns = PyTuple_GET_SIZE(srcs);
    sb = PyMem_Calloc((size_t)(ns ? ns : 1), sizeof(Py_buffer));
    sp = PyMem_Calloc((size_t)(np_ ? np_ : 1), sizeof(kv_gspan));
    ord = PyMem_Calloc((size_t)(np_ ? np_ : 1), sizeof(Py_ssize_t));
    lo = PyMem_Calloc((size_t)(np_ ? np_ : 1), sizeof(char *));
    hi = PyMem_Calloc((size_t)(np_ ? np_ : 1), sizeof(char *));
    if (db == NULL || sb == NULL || sp == NULL || ord == NULL || lo == NULL || hi == NULL) {
        PyErr_NoMemory();
        goto e5;
    }
    for (got = 0; got < ns; got++) {
        if (kv_get_ro(PyTuple_GET_ITEM(srcs, got), &sb[got], "srcs[i]") < 0) {
            goto e5;
        }
    }
    for (r = 0; r < np_; r++) {  /* every piece fits its source at the lowest and highest index */
        int64_t off = pc[5 * r], len = pc[5 * r + 1], d = pc[5 * r + 2], base = pc[5 * r + 3];
        int64_t stride = pc[5 * r + 4];
        if (off < 0 || len < 0 || d < 0 || d >= ns || base < 0 || stride < 0 || base > sb[d].len ||
            len > sb[d].len - base || (hi_i > 0 && stride > (sb[d].len - base - len) / hi_i)) {
            PyErr_Format(PyExc_ValueError, "piece %zd does not fit its source", r);
            goto e5;
        }
        lo[r] = (const char *)sb[d].buf + base + lo_i * stride;
        hi[r] = (const char *)sb[d].buf + base + hi_i * stride + len;
        if (len == 0) {
            continue;
        }
        for (k = nsp; k > 0 && pc[5 * ord[k - 1]] > off; k--) {
            ord[k] = ord[k - 1];
        }
        ord[k] = r;
        nsp++;
    }
    for (r = 0; r < nsp; r++) {  /* in block order: no overlap; with hashing, no gap either */
        int64_t off = pc[5 * ord[r]], len = pc[5 * ord[r] + 1];
        if ((size_t)off < end || (want && (size_t)off != end)) {
            PyErr_SetString(PyExc_ValueError, want ? "the pieces must cover the block once, with no gap "
                            "and no overlap" : "pieces overlap in the block");
            goto e5;
        }
        end = (size_t)off + (size_t)len;  /* (unsigned: no signed overflow near 2**63) */
        sp[r].off = (size_t)off;
        sp[r].len = (size_t)len;
    }
    for (gots = 0; gots < n; gots++) {
        const char *a, *b;
        if (kv_get_rw(PySequence_Fast_GET_ITEM(dsts, gots), &db[gots], "dsts[i]") < 0) {
            goto e5;
        }
        if ((size_t)db[gots].len < end || (want && (size_t)db[gots].len != end)) {
            PyErr_Format(PyExc_ValueError, "dsts[%zd] has %zd bytes; the pieces %s %zu", gots, db[gots].len,
                         want ? "cover" : "reach", end);
            gots++;
            goto e5;
        }
        a = (const char *)db[gots].buf;
        b = a + db[gots].len;
        for (r = 0; r < np_; r++) {
            if (pc[5 * r + 1] > 0 && a < hi[r] && lo[r] < b) {
                PyErr_Format(PyExc_ValueError, "dsts[%zd] overlaps a source", gots);
                gots++;
                goto e5;
            }
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n; i++) {
        unsigned char *d = (unsigned char *)db[i].buf;
        for (r = 0; r < nsp; r++) {
            const int64_t *row = pc + 5 * ord[r];
            sp[r].src = (const unsigned char *)sb[row[2]].buf + row[3] + ix[i] * row[4];
        }
        if (want) {
            ((unsigned long long *)outb.buf)[i] =
                (unsigned long long)kv_gather_hash(kv_gather, d, (size_t)db[i].len, sp, (size_t)nsp);
        } else {
            for (r = 0; r < nsp; r++) {
                memcpy(d + sp[r].off, sp[r].src, sp[r].len);
            }
        }
    }
    Py_END_ALLOW_THREADS
    fail = 0;
e5:
    for (r = 0; r < gots; r++) {
        PyBuffer_Release(&db[r]);
    }
    for (r = 0; r < got; r++) {
        PyBuffer_Release(&sb[r]);
    }
    PyMem_Free(db);
    PyMem_Free(sb);
    PyMem_Free(sp);
    PyMem_Free(ord);
    PyMem_Free((void *)lo);
    PyMem_Free((void *)hi);
    PyMem_Free(pc);
    PyMem_Free(ix);
e4:
    Py_DECREF(dsts);
e3:
    if (want) {
        PyBuffer_Release(&outb);
    }
e2:
    PyBuffer_Release(&idx);
e1:
    PyBuffer_Release(&pcs);
    if (fail) {
        return NULL;
    }
    Py_RETURN_NONE;
}


/* ------------------------------------------------------------------------ */
/* Page tables for the resident part of a shared mapping                     */
/* ------------------------------------------------------------------------ */

#ifndef MADV_POPULATE_READ
#  define MADV_POPULATE_READ 22
#endif
#define KV_MINCORE_CHUNK ((size_t)1 << 14)   /* pages per mincore call */

PyDoc_STRVAR(populate_resident_doc,
"populate_resident(buffer) -> int\n"
"\n"
"Map, in this process's page tables, every page of buffer (a shared file\n"
"mapping) that the file already holds in memory (mincore), with\n"
"madvise(MADV_POPULATE_READ) on each run of such pages (Linux 5.14;\n"
"before it, one read per page).  Pages the file does not hold are left\n"
"alone: a sparse slab is never filled in.  Later reads of those bytes take\n"
"no page fault.  Returns the pages populated; 0 where mincore is refused.\n"
"The GIL is released throughout.");

static size_t
kv_populate_run(unsigned char *p, size_t len, size_t page)
{
    size_t q;
    if (madvise(p, len, MADV_POPULATE_READ) == 0) {
        return len / page;
    }
    if (errno != EINVAL) {    /* e.g. EFAULT: the file shrank; stop quietly */
        return 0;
    }
    for (q = 0; q < len; q += page) {   /* an older kernel: fault each page in */
        (void)*(volatile unsigned char *)(p + q);
    }
    return len / page;
}

static PyObject *
kv_populate_resident(PyObject *self, PyObject *arg)
{
    Py_buffer b;
    size_t page = (size_t)sysconf(_SC_PAGESIZE), done = 0;
    (void)self;
    if (kv_get_ro(arg, &b, "buffer") < 0) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    {
        uintptr_t lo = ((uintptr_t)b.buf + page - 1) & ~(uintptr_t)(page - 1);
        uintptr_t hi = ((uintptr_t)b.buf + (size_t)b.len) & ~(uintptr_t)(page - 1);
        size_t npages = hi > lo ? (hi - lo) / page : 0, at = 0;
        unsigned char vec[KV_MINCORE_CHUNK];
        while (at < npages) {
            size_t n = npages - at < KV_MINCORE_CHUNK ? npages - at : KV_MINCORE_CHUNK, k = 0;
            unsigned char *base = (unsigned char *)lo + at * page;
            if (mincore(base, n * page, vec) != 0) {
                break;
            }
            while (k < n) {
                size_t start;
                while (k < n && !(vec[k] & 1)) {
                    k++;
                }
                start = k;
                while (k < n && (vec[k] & 1)) {
                    k++;
                }
                if (k > start) {
                    done += kv_populate_run(base + start * page, (k - start) * page, page);
                }
            }
            at += n;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromSize_t(done);
}

/* ------------------------------------------------------------------------ */
/* Seals of sharded blocks (kvstore/client/shards.py)                        */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(seal_check_doc,
"seal_check(srcs, keys, tp, rank, shard_bytes, sums, ok) -> None\n"
"\n"
"The seals of sealed blocks (kvstore/client/shards.py), read by rank\n"
"rank of tp: ok[i] (a writable buffer of uint8) is 1 when srcs[i] is\n"
"tp * shard_bytes + seal_bytes(tp) bytes long and its seal holds the magic\n"
"KVSEAL01, shard_bytes and keys[16 i : 16 i + 16]; then sums[i] (a writable\n"
"buffer of uint64) is the seal's checksum of shard rank (else 0).  keys: 16\n"
"bytes per block.  Only the seals are read (40 bytes of each block).");

static PyObject *
kv_seal_check(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer keys, sums, okb;
    PyObject *srcs;
    Py_ssize_t n, i;
    long long tp, rank, shard;
    size_t at, whole;
    unsigned char *okp;
    unsigned long long *sp;
    int fail = 1;
    (void)self;

    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "seal_check takes 7 arguments");
        return NULL;
    }
    tp = PyLong_AsLongLong(args[2]);
    rank = PyLong_AsLongLong(args[3]);
    shard = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (tp < 1 || tp > 4096 || rank < 0 || rank >= tp || shard < 0 || shard > ((long long)1 << 40)) {
        PyErr_SetString(PyExc_ValueError, "seal_check: 1 <= tp <= 4096, 0 <= rank < tp, 0 <= shard_bytes <= 2**40");
        return NULL;
    }
    at = (size_t)tp * (size_t)shard;
    whole = at + (((size_t)32 + 8 * (size_t)tp + 63) / 64) * 64;
    srcs = PySequence_Fast(args[0], "srcs must be a sequence");
    if (srcs == NULL) {
        return NULL;
    }
    if (kv_get_ro(args[1], &keys, "keys") < 0) {
        goto e0;
    }
    if (kv_get_rw(args[5], &sums, "sums") < 0) {
        goto e1;
    }
    if (kv_get_rw(args[6], &okb, "ok") < 0) {
        goto e2;
    }
    n = PySequence_Fast_GET_SIZE(srcs);
    if (keys.len != n * 16 || sums.len != n * 8 || okb.len != n) {
        PyErr_Format(PyExc_ValueError, "%zd blocks: keys, sums and ok must hold 16, 8 and 1 bytes per block", n);
        goto e3;
    }
    okp = (unsigned char *)okb.buf;
    sp = (unsigned long long *)sums.buf;
    for (i = 0; i < n; i++) {
        Py_buffer b;
        uint64_t own;
        if (kv_get_ro(PySequence_Fast_GET_ITEM(srcs, i), &b, "srcs[i]") < 0) {
            goto e3;
        }
        okp[i] = 0;
        sp[i] = 0;
        if ((size_t)b.len == whole && kv_seal_own((const unsigned char *)b.buf + at, (uint64_t)shard, (size_t)rank,
                                                  (const unsigned char *)keys.buf + 16 * i, &own)) {
            okp[i] = 1;
            sp[i] = own;
        }
        PyBuffer_Release(&b);
    }
    fail = 0;
e3:
    PyBuffer_Release(&okb);
e2:
    PyBuffer_Release(&sums);
e1:
    PyBuffer_Release(&keys);
e0:
    Py_DECREF(srcs);
    if (fail) {
        return NULL;
    }
    Py_RETURN_NONE;
}


static PyMethodDef kv_methods[] = {
    {"chain_keys", (PyCFunction)(void (*)(void))kv_chain_keys,
     METH_VARARGS | METH_KEYWORDS, chain_keys_doc},
    {"checksum", (PyCFunction)kv_checksum, METH_O, checksum_doc},
    {"copy_checksum", (PyCFunction)kv_copy_checksum, METH_VARARGS,
     copy_checksum_doc},
    {"copy_verify", (PyCFunction)kv_copy_verify, METH_VARARGS,
     copy_verify_doc},
    {"copy_checksum_many", (PyCFunction)kv_copy_checksum_many, METH_VARARGS,
     copy_checksum_many_doc},
    {"_copy_checksum_with", (PyCFunction)kv_copy_checksum_with, METH_VARARGS,
     copy_checksum_with_doc},
    {"kernels", (PyCFunction)kv_kernels, METH_NOARGS, kernels_doc},
    {"simd_target", (PyCFunction)kv_simd_target, METH_NOARGS, simd_target_doc},
    {"seq_begin", (PyCFunction)kv_seq_begin, METH_O, seq_begin_doc},
    {"seq_end", (PyCFunction)kv_seq_end, METH_O, seq_end_doc},
    {"shared_lookup", (PyCFunction)(void (*)(void))kv_shared_lookup, METH_FASTCALL,
     shared_lookup_doc},
    {"shared_slots", (PyCFunction)(void (*)(void))kv_shared_slots, METH_FASTCALL,
     shared_slots_doc},
    {"verify_scatter_many", (PyCFunction)(void (*)(void))kv_verify_scatter_many, METH_FASTCALL,
     verify_scatter_many_doc},
    {"gather_many", (PyCFunction)(void (*)(void))kv_gather_many, METH_FASTCALL, gather_many_doc},
    {"populate_resident", (PyCFunction)kv_populate_resident, METH_O, populate_resident_doc},
    {"seal_check", (PyCFunction)(void (*)(void))kv_seal_check, METH_FASTCALL, seal_check_doc},
    {"scatter_slots", (PyCFunction)(void (*)(void))kv_scatter_slots, METH_FASTCALL, scatter_slots_doc},
    {NULL, NULL, 0, NULL}
};

PyDoc_STRVAR(module_doc,
"Native helpers for kvstore: chained XXH3-128 block keys and fused\n"
"copy+XXH3-64 checksums.  Optional: kvstore.keys and kvstore.checksum fall\n"
"back to pure Python (same results) when this module is not built.");

static struct PyModuleDef kv_module = {
    PyModuleDef_HEAD_INIT,
    "kvstore._native",
    module_doc,
    -1,
    kv_methods,
    NULL, NULL, NULL, NULL
};

/* The last-level cache this CPU shares, in bytes, as Linux's sysfs names it
 * ("32768K"), or -1.  On a VM, sysconf's figure (from CPUID) can be a whole
 * socket's: 256 MiB on the 2-core AMD EPYC of docs/performance.md, whose
 * cores share 32 MiB. */
static long
kv_sysfs_llc(void)
{
    char text[32];
    size_t got;
    long size = -1;
    char unit = 0;
    FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
    if (f == NULL) {
        return -1;
    }
    got = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[got] = 0;
    if (sscanf(text, "%ld%c", &size, &unit) < 1 || size <= 0) {
        return -1;
    }
    if (unit == 'K') {
        size *= 1024;
    } else if (unit == 'M') {
        size *= 1024 * 1024;
    }
    return size;
}

static void
kv_select_nt_min(void)
{
    long llc = kv_sysfs_llc();
#ifdef _SC_LEVEL3_CACHE_SIZE
    if (llc <= 0) {
        llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
    }
#endif
#ifdef _SC_LEVEL2_CACHE_SIZE
    if (llc <= 0) {
        llc = sysconf(_SC_LEVEL2_CACHE_SIZE);
    }
#endif
    if (llc > 0 && (size_t)llc / 2 > KV_NT_FLOOR) {
        kv_nt_min = (size_t)llc / 2;
    }
}

PyMODINIT_FUNC
PyInit__native(void)
{
    PyObject *m;

    kv_select_fused();
    kv_select_nt_min();
    m = PyModule_Create(&kv_module);
    if (m == NULL) {
        return NULL;
    }
#ifdef Py_GIL_DISABLED
    PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED);
#endif
    if (PyModule_AddIntConstant(m, "XXH_VERSION", XXH_VERSION_NUMBER) < 0 ||
        PyModule_AddIntConstant(m, "MAX_BLOCK_SIZE", KV_MAX_BLOCK_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "LOC_SHIFT", KV_LOC_SHIFT) < 0 ||
        PyModule_AddIntConstant(m, "NONTEMPORAL_MIN", (long)kv_nt_min) < 0 ||
        PyModule_AddStringConstant(m, "COPY_KERNEL", kv_fused_name) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
