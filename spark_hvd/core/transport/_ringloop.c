/* The ring's pipelined exchange loop, compiled: the same frames, tags and rules as spark_hvd.core.transport.tcp's
 * RingExchange running a ring of spark_hvd.core.backends.ring (see spark_hvd/core/transport/ringloop.py, its only caller).
 *
 * One call runs a ring's steps on one buffer between two TCP sockets (to the right neighbour, from the left one;
 * the same socket at two ranks), or on several arrays that stand for one (a segment table: a fused allreduce reduces
 * each where it lies; a frame across two of them is gathered into one frame to send, or received into the scratch
 * frame and reduced or copied piece by piece into them): it sends the first chunk's frames, receives every planned
 * frame, checks its GMAC tag, reduces it into place (reduce-scatter steps, from one scratch frame) or receives it in
 * place (allgather steps), and queues it for the next step. At a few microseconds a frame (the Python loop's is
 * ~20-30 us) frames can be 512 KiB, where the Python loop needs 4 MiB; 512 KiB took the least CPU of 256 KiB to
 * 2 MiB (ringloop.py).
 *
 * Tags, two ways to the same AES-256-GCM tag:
 * - the caller's MAC function, ``cryptography``'s ``AESGCM.encrypt`` (its bundled OpenSSL hashes with the widest
 *   carry-less multiply the CPU has: ~22 GB/s here), called once a frame with the GIL taken for the call;
 * - the system's libcrypto (dlopen'ed, no build dependency: Python's own ssl module links it), without the GIL
 *   (OpenSSL 3.0's GHASH ran at ~8.7 GB/s here).
 * The first is the default; a wait of more than GIL_WAIT_NS for the GIL (another thread of the process runs Python:
 * it would hand the GIL back only after its switch interval, 5 ms, per frame) switches the process to the second
 * for GIL_FREE_NS, after which the GIL is tried again. Without libcrypto the GIL is always taken.
 *
 * Wire format (spark_hvd.core.transport.wire): length (8 bytes, big-endian, payload + 1) | tag (16) | type byte | payload.
 * A DATA frame's tag is AES-256-GCM's tag under the direction's data key, nonce = 4 zero bytes | the direction's
 * 64-bit frame counter (big-endian), associated data = the payload, plaintext = length | type byte (ciphertext
 * dropped). Nothing received is used (reduced, forwarded, handed back) before its tag checked out.
 *
 * Encrypted frames (``encrypt``, SPARK_HVD_ENCRYPT): the same cipher, key (the direction's frame key) and nonce, but
 * associated data = length | type byte and plaintext = the payload, whose ciphertext is sent in its place. A frame
 * to send is sealed from the buffer into ``out_stage`` (ciphertext | tag) when it would be tagged, and sent from
 * there; a frame received is read into ``in_stage``, its tag put after it, and decrypted from there into the scratch
 * frame or its place in the buffer, then used only if the tag checked out (the same two ways: the caller's
 * ``seal_into`` / ``open_into``, or libcrypto's EVP_Encrypt* / EVP_Decrypt* without the GIL).
 *
 * Errors come back as a status (the caller raises the library's exceptions, naming the peer): nothing here
 * allocates Python objects while the GIL is released.
 *
 * The module also holds shared memory's small allreduce and barrier release (shm_small, shm_release) and the
 * cross-memory pair's reduce-scatter (cma_reduce): the sections before the module table, which share the reductions.
 *
 * Over 600 lines on purpose: the loop, its two ways to a tag and the module's argument checks share the frame
 * layout, the statuses and the Ring state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define HEAD_SIZE 25 /* length 8 + tag 16 + type 1 */
#define TAG_SIZE 16
#define DATA_KIND 0

enum status {
    ST_OK = 0,
    ST_TIMEOUT = 1,   /* detail: 0 waiting to receive, 1 waiting to send */
    ST_RECV_ERR = 2,  /* detail: errno, 0 for end of stream */
    ST_SEND_ERR = 3,  /* detail: errno */
    ST_AUTH = 4,      /* a frame's tag did not check out */
    ST_CONTROL = 5,   /* a frame of another type than DATA: its header is returned, its payload not read */
    ST_SIZE = 6,      /* detail: the payload size the peer announced (another was expected) */
    ST_EMPTY = 7,     /* a frame announcing no type byte */
    ST_NOMEM = 8,     /* no memory for the send queue */
    ST_RAISED = 9,    /* a signal handler or the MAC function raised (the exception is set) */
    ST_CRYPTO = 10,   /* libcrypto failed */
};

enum dtype {
    DT_F32 = 0, DT_F64 = 1, DT_I32 = 2, DT_I64 = 3, DT_BYTES = 4, DT_U32 = 5, DT_U64 = 6, DT_F16 = 7, DT_BF16 = 8,
    DT_I8 = 9, DT_U8 = 10, DT_I16 = 11, DT_U16 = 12, DT_COUNT = 13
};
enum reduce_op { OP_SUM = 0, OP_AVERAGE = 1, OP_MIN = 2, OP_MAX = 3, OP_PRODUCT = 4, OP_COUNT = 5 };

/* -- reductions: acc = op(acc, x), element by element, the same bits as the Python loop's numpy ufuncs ----------
 * (spark_hvd.core.reduce.reduce_into): IEEE, no fast-math; integer sums and products wrap as numpy's do (computed
 * in the unsigned type of the width: the same bits, no signed overflow); MIN / MAX as numpy's scalar loops, a NaN
 * in acc kept, a NaN in x taken; float16 and bfloat16 widened to float32 (exact), reduced there, and rounded back
 * once (float16 as numpy's half loops: round to nearest even; bfloat16 as reduce.f32_to_bf16, NaN to 0x7FC0 with
 * its sign). AVERAGE sums; ``divide`` turns the last step's sums into averages as reduce.divide_average does.
 * Vectorised (-O3 for these loops), with an AVX2 clone chosen at load time where the CPU has it (as numpy's own
 * loops are): the same operations, element by element, in wider registers. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("O3")
#endif
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define WIDE __attribute__((target_clones("avx2", "default")))
#else
#define WIDE
#endif

#define MIN_(a, b) (((a) <= (b) || (a) != (a)) ? (a) : (b))
#define MAX_(a, b) (((a) >= (b) || (a) != (a)) ? (a) : (b))

/* SUM (and AVERAGE's sums), PRODUCT, MIN, MAX of one element type T; sums and products in U (unsigned for integers) */
#define KERNELS(NAME, T, U)                                                                                     \
    WIDE static void NAME##_sum(T *restrict acc, const T *restrict x, size_t n) {                              \
        for (size_t i = 0; i < n; i++) acc[i] = (T)(U)((U)acc[i] + (U)x[i]);                                   \
    }                                                                                                            \
    WIDE static void NAME##_prod(T *restrict acc, const T *restrict x, size_t n) {                             \
        for (size_t i = 0; i < n; i++) acc[i] = (T)(U)((U)acc[i] * (U)x[i]);                                   \
    }                                                                                                            \
    WIDE static void NAME##_min(T *restrict acc, const T *restrict x, size_t n) {                              \
        for (size_t i = 0; i < n; i++) acc[i] = MIN_(acc[i], x[i]);                                             \
    }                                                                                                            \
    WIDE static void NAME##_max(T *restrict acc, const T *restrict x, size_t n) {                              \
        for (size_t i = 0; i < n; i++) acc[i] = MAX_(acc[i], x[i]);                                             \
    }
KERNELS(f32, float, float)
KERNELS(f64, double, double)
KERNELS(i8, int8_t, unsigned)   /* unsigned int: uint8 * uint8 promoted to int could overflow in C */
KERNELS(u8, uint8_t, unsigned)
KERNELS(i16, int16_t, unsigned)
KERNELS(u16, uint16_t, unsigned)
KERNELS(i32, int32_t, uint32_t)
KERNELS(u32, uint32_t, uint32_t)
KERNELS(i64, int64_t, uint64_t)
KERNELS(u64, uint64_t, uint64_t)

/* float16 <-> float32 (numpy's npy_half_to_float / npy_float_to_half) and bfloat16 <-> float32 */
static inline uint32_t f32_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
static inline float bits_f32(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }

static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13)); /* inf, nan (payload kept) */
    if (exp) return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
    float v = (float)man * 0x1p-24f;                                      /* zero, subnormal: exact */
    return bits_f32(sign | f32_bits(v));
}

static inline uint16_t f2h(float f) {
    uint32_t b = f32_bits(f), e = b & 0x7f800000u, sig = b & 0x007fffffu;
    uint16_t sign = (uint16_t)((b & 0x80000000u) >> 16);
    if (e >= 0x47800000u) {                                                /* overflow, inf, nan */
        if (e == 0x7f800000u && sig) {
            uint16_t h = (uint16_t)(0x7c00u + (sig >> 13));
            return (uint16_t)(sign + (h == 0x7c00u ? h + 1 : h));         /* a nan stays a nan */
        }
        return (uint16_t)(sign + 0x7c00u);
    }
    if (e <= 0x38000000u) {                                                /* subnormal half, or zero */
        if (e < 0x33000000u) return sign;
        uint32_t shift = 113u - (e >> 23);
        uint32_t s = (0x00800000u + sig) >> shift;
        if ((s & 0x3fffu) != 0x1000u || (sig & ((1u << shift) - 1u))) s += 0x1000u; /* nearest, ties to even */
        return (uint16_t)(sign + (s >> 13));
    }
    uint32_t h = (e - 0x38000000u) >> 13;                                  /* the exponent, in place */
    if ((sig & 0x3fffu) != 0x1000u) sig += 0x1000u;                        /* nearest, ties to even */
    return (uint16_t)(sign + h + (sig >> 13));                             /* a carry rounds up the exponent */
}

static inline float b2f(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline uint16_t f2b(float f) {
    uint32_t b = f32_bits(f);
    uint32_t r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    return f != f ? (uint16_t)(0x7fc0u | (r & 0x8000u)) : (uint16_t)r;
}

/* Which NaN a sum or product of two 16-bit floats carries, as the Python loop's numpy gives it: float16 (numpy's half
 * loops) the second operand's if it is one, else the first's, quieted; bfloat16 (numpy's float32 loops, then
 * reduce.f32_to_bf16, which keeps only a NaN's sign) the first operand's, else the second's. */
static inline float quiet(float a) { return bits_f32(f32_bits(a) | 0x00400000u); }
#define NAN_F16(r, a, b) ((b) != (b) ? quiet(b) : (a) != (a) ? quiet(a) : (r))
#define NAN_BF16(r, a, b) ((a) != (a) ? (a) : (b) != (b) ? (b) : (r))

#define HALF_KERNELS(NAME, TO, FROM, NAN_)                                                                      \
    WIDE static void NAME##_sum(uint16_t *restrict acc, const uint16_t *restrict x, size_t n) {               \
        for (size_t i = 0; i < n; i++) {                                                                        \
            float a = TO(acc[i]), b = TO(x[i]);                                                                 \
            acc[i] = FROM(NAN_(a + b, a, b));                                                                   \
        }                                                                                                        \
    }                                                                                                            \
    WIDE static void NAME##_prod(uint16_t *restrict acc, const uint16_t *restrict x, size_t n) {              \
        for (size_t i = 0; i < n; i++) {                                                                        \
            float a = TO(acc[i]), b = TO(x[i]);                                                                 \
            acc[i] = FROM(NAN_(a * b, a, b));                                                                   \
        }                                                                                                        \
    }                                                                                                            \
    WIDE static void NAME##_min(uint16_t *restrict acc, const uint16_t *restrict x, size_t n) {               \
        for (size_t i = 0; i < n; i++) { float a = TO(acc[i]), b = TO(x[i]); acc[i] = FROM(MIN_(a, b)); }     \
    }                                                                                                            \
    WIDE static void NAME##_max(uint16_t *restrict acc, const uint16_t *restrict x, size_t n) {               \
        for (size_t i = 0; i < n; i++) { float a = TO(acc[i]), b = TO(x[i]); acc[i] = FROM(MAX_(a, b)); }     \
    }                                                                                                            \
    WIDE static void NAME##_div(uint16_t *restrict acc, float d, size_t n) {                                   \
        for (size_t i = 0; i < n; i++) acc[i] = FROM(TO(acc[i]) / d);                                         \
    }
HALF_KERNELS(f16_soft, h2f, f2h, NAN_F16)
HALF_KERNELS(bf16, b2f, f2b, NAN_BF16)

/* float16 where the CPU converts (F16C, with AVX2): eight at a time, the same bits as h2f / f2h (the hardware
 * rounds to nearest even, as f2h; a NaN sum is quiet either way, its payload cut the same). MIN / MAX compare the
 * widened values and keep the chosen input's own bits (as numpy's half loops do: a signalling NaN stays one). The
 * rest of an array, and CPUs without F16C, take the loops above. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#define ROUND_ (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
__attribute__((target("avx2,f16c"))) static size_t f16_wide(int op, uint16_t *restrict acc,
                                                           const uint16_t *restrict x, float d, size_t n) {
    size_t i = 0;
    __m256 div = _mm256_set1_ps(d);
    for (; i + 8 <= n; i += 8) {
        __m128i ha = _mm_loadu_si128((const __m128i *)(acc + i)), hb = _mm_setzero_si128(), r;
        __m256 a = _mm256_cvtph_ps(ha), b = a;
        if (x) {
            hb = _mm_loadu_si128((const __m128i *)(x + i));
            b = _mm256_cvtph_ps(hb);
        }
        if (!x) {
            r = _mm256_cvtps_ph(_mm256_div_ps(a, div), ROUND_);
        } else if (op == OP_SUM || op == OP_AVERAGE || op == OP_PRODUCT) {
            __m256 sum = op == OP_PRODUCT ? _mm256_mul_ps(a, b) : _mm256_add_ps(a, b);
            __m256 qa = _mm256_or_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x00400000)));
            __m256 qb = _mm256_or_ps(b, _mm256_castsi256_ps(_mm256_set1_epi32(0x00400000)));
            sum = _mm256_blendv_ps(sum, qa, _mm256_cmp_ps(a, a, _CMP_UNORD_Q)); /* NAN_F16: b's, else a's */
            sum = _mm256_blendv_ps(sum, qb, _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
            r = _mm256_cvtps_ph(sum, ROUND_);
        } else {
            __m256 keep = op == OP_MIN ? _mm256_cmp_ps(a, b, _CMP_LE_OQ) : _mm256_cmp_ps(a, b, _CMP_GE_OQ);
            __m256i k = _mm256_castps_si256(_mm256_or_ps(keep, _mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
            __m128i k16 = _mm_packs_epi32(_mm256_castsi256_si128(k), _mm256_extracti128_si256(k, 1));
            r = _mm_blendv_epi8(hb, ha, k16);
        }
        _mm_storeu_si128((__m128i *)(acc + i), r);
    }
    return i;
}
static int f16c_ok = -1;
static size_t f16_fast(int op, uint16_t *acc, const uint16_t *x, float d, size_t n) {
    if (f16c_ok < 0) f16c_ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    return f16c_ok ? f16_wide(op, acc, x, d, n) : 0;
}
#else
static size_t f16_fast(int op, uint16_t *acc, const uint16_t *x, float d, size_t n) {
    (void)op; (void)acc; (void)x; (void)d; (void)n;
    return 0;
}
#endif
#define F16_OP(NAME, OP)                                                                                        \
    static void f16_##NAME(uint16_t *restrict acc, const uint16_t *restrict x, size_t n) {                     \
        size_t done = f16_fast(OP, acc, x, 1.0f, n);                                                            \
        f16_soft_##NAME(acc + done, x + done, n - done);                                                        \
    }
F16_OP(sum, OP_SUM)
F16_OP(prod, OP_PRODUCT)
F16_OP(min, OP_MIN)
F16_OP(max, OP_MAX)
static void f16_div(uint16_t *restrict acc, float d, size_t n) {
    size_t done = f16_fast(OP_AVERAGE, acc, NULL, d, n);
    f16_soft_div(acc + done, d, n - done);
}

WIDE static void div_f32(float *restrict acc, float d, size_t n) {
    for (size_t i = 0; i < n; i++) acc[i] = acc[i] / d;
}
WIDE static void div_f64(double *restrict acc, double d, size_t n) {
    for (size_t i = 0; i < n; i++) acc[i] = acc[i] / d;
}
/* an integer average as reduce.divide_average: trunc(sum / float64(n)), cast back */
#define INT_DIV(NAME, T)                                                                                        \
    static void NAME##_div(T *restrict acc, double d, size_t n) {                                               \
        for (size_t i = 0; i < n; i++) acc[i] = (T)trunc((double)acc[i] / d);                                   \
    }
INT_DIV(i8, int8_t)
INT_DIV(u8, uint8_t)
INT_DIV(i16, int16_t)
INT_DIV(u16, uint16_t)
INT_DIV(i32, int32_t)
INT_DIV(u32, uint32_t)
INT_DIV(i64, int64_t)
INT_DIV(u64, uint64_t)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

typedef void (*kernel)(void *restrict, const void *restrict, size_t);
#define ROW(NAME) {(kernel)NAME##_sum, (kernel)NAME##_sum, (kernel)NAME##_min, (kernel)NAME##_max, (kernel)NAME##_prod}
static const kernel kernels[DT_COUNT][OP_COUNT] = {
    [DT_F32] = ROW(f32), [DT_F64] = ROW(f64), [DT_I32] = ROW(i32), [DT_I64] = ROW(i64), [DT_U32] = ROW(u32),
    [DT_U64] = ROW(u64), [DT_F16] = ROW(f16), [DT_BF16] = ROW(bf16), [DT_I8] = ROW(i8), [DT_U8] = ROW(u8),
    [DT_I16] = ROW(i16), [DT_U16] = ROW(u16),
};
static const size_t itemsizes[DT_COUNT] = {4, 8, 4, 8, 1, 4, 8, 2, 2, 1, 1, 2, 2};

static void reduce_into(int dtype, int op, unsigned char *acc, const unsigned char *x, size_t nbytes) {
    kernels[dtype][op](acc, x, nbytes / itemsizes[dtype]);
}

static void divide(int dtype, unsigned char *acc, long n, size_t nbytes) {
    size_t k = nbytes / itemsizes[dtype];
    switch (dtype) {
    case DT_F32: div_f32((float *)acc, (float)n, k); break;
    case DT_F64: div_f64((double *)acc, (double)n, k); break;
    case DT_F16: f16_div((uint16_t *)acc, (float)h2f(f2h((float)n)), k); break;
    case DT_BF16: bf16_div((uint16_t *)acc, (float)n, k); break;
    case DT_I8: i8_div((int8_t *)acc, (double)n, k); break;
    case DT_U8: u8_div((uint8_t *)acc, (double)n, k); break;
    case DT_I16: i16_div((int16_t *)acc, (double)n, k); break;
    case DT_U16: u16_div((uint16_t *)acc, (double)n, k); break;
    case DT_I32: i32_div((int32_t *)acc, (double)n, k); break;
    case DT_U32: u32_div((uint32_t *)acc, (double)n, k); break;
    case DT_I64: i64_div((int64_t *)acc, (double)n, k); break;
    case DT_U64: u64_div((uint64_t *)acc, (double)n, k); break;
    default: break;
    }
}

/* -- tags ------------------------------------------------------------------------------------------------------ */
#define GIL_WAIT_NS 100000LL      /* a longer wait for the GIL means another thread holds it: 0.1 ms */
#define GIL_FREE_NS 1000000000LL  /* then tag without the GIL for 1 s */
#define EVP_CTRL_GCM_GET_TAG_ 0x10
#define EVP_CTRL_GCM_SET_TAG_ 0x11

/* the few libcrypto functions used (a stable ABI since OpenSSL 1.1), resolved at first use */
typedef struct evp_ctx EVP_CTX;
static struct {
    int tried, ok;
    const void *(*aes_256_gcm)(void);
    EVP_CTX *(*ctx_new)(void);
    void (*ctx_free)(EVP_CTX *);
    int (*init)(EVP_CTX *, const void *, void *, const unsigned char *, const unsigned char *);
    int (*update)(EVP_CTX *, unsigned char *, int *, const unsigned char *, int);
    int (*final)(EVP_CTX *, unsigned char *, int *);
    int (*ctrl)(EVP_CTX *, int, int, void *);
    int (*dec_init)(EVP_CTX *, const void *, void *, const unsigned char *, const unsigned char *);
    int (*dec_update)(EVP_CTX *, unsigned char *, int *, const unsigned char *, int);
    int (*dec_final)(EVP_CTX *, unsigned char *, int *);
} crypto;

static int64_t gil_free_until; /* process-wide: tag without the GIL until then (CLOCK_MONOTONIC ns) */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* called with the GIL held (module functions), so once */
static int crypto_load(void) {
    if (crypto.tried) return crypto.ok;
    crypto.tried = 1;
    const char *names[] = {"libcrypto.so.3", "libcrypto.so", "libcrypto.so.1.1"};
    void *lib = NULL;
    for (size_t i = 0; i < sizeof names / sizeof *names && !lib; i++) lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib) return 0;
    *(void **)&crypto.aes_256_gcm = dlsym(lib, "EVP_aes_256_gcm");
    *(void **)&crypto.ctx_new = dlsym(lib, "EVP_CIPHER_CTX_new");
    *(void **)&crypto.ctx_free = dlsym(lib, "EVP_CIPHER_CTX_free");
    *(void **)&crypto.init = dlsym(lib, "EVP_EncryptInit_ex");
    *(void **)&crypto.update = dlsym(lib, "EVP_EncryptUpdate");
    *(void **)&crypto.final = dlsym(lib, "EVP_EncryptFinal_ex");
    *(void **)&crypto.ctrl = dlsym(lib, "EVP_CIPHER_CTX_ctrl");
    *(void **)&crypto.dec_init = dlsym(lib, "EVP_DecryptInit_ex");
    *(void **)&crypto.dec_update = dlsym(lib, "EVP_DecryptUpdate");
    *(void **)&crypto.dec_final = dlsym(lib, "EVP_DecryptFinal_ex");
    crypto.ok = crypto.aes_256_gcm && crypto.ctx_new && crypto.ctx_free && crypto.init && crypto.update
                && crypto.final && crypto.ctrl && crypto.dec_init && crypto.dec_update && crypto.dec_final;
    return crypto.ok;
}

/* a context that encrypts (or, ``decrypt``, decrypts) under ``key`` */
static EVP_CTX *crypto_ctx(const unsigned char *key, int decrypt) {
    if (!crypto_load()) return NULL;
    EVP_CTX *ctx = crypto.ctx_new();
    if (ctx && (decrypt ? crypto.dec_init : crypto.init)(ctx, crypto.aes_256_gcm(), NULL, key, NULL) != 1) {
        crypto.ctx_free(ctx);
        ctx = NULL;
    }
    return ctx;
}

static void nonce_of(uint64_t counter, unsigned char iv[12]) {
    memset(iv, 0, 12);
    for (int i = 0; i < 8; i++) iv[4 + i] = (unsigned char)(counter >> (56 - 8 * i));
}

/* the tag by libcrypto, without the GIL; 0 on success */
static int tag_by_crypto(EVP_CTX *ctx, uint64_t counter, const unsigned char *length_kind,
                         const unsigned char *payload, size_t len, unsigned char *tag) {
    unsigned char iv[12], out[32];
    int outl;
    nonce_of(counter, iv);
    if (crypto.init(ctx, NULL, NULL, NULL, iv) != 1) return -1;
    while (len) {
        int piece = len > (1u << 30) ? (1 << 30) : (int)len;
        if (crypto.update(ctx, NULL, &outl, payload, piece) != 1) return -1;
        payload += piece;
        len -= (size_t)piece;
    }
    if (crypto.update(ctx, out, &outl, length_kind, 9) != 1 || crypto.final(ctx, out, &outl) != 1) return -1;
    return crypto.ctrl(ctx, EVP_CTRL_GCM_GET_TAG_, TAG_SIZE, tag) == 1 ? 0 : -1;
}

/* the tag by the caller's MAC function (``mac(nonce, length_kind, payload)``'s last 16 bytes), the GIL held */
static int tag_by_python(PyObject *mac, uint64_t counter, const unsigned char *length_kind, unsigned char *payload,
                         size_t len, unsigned char *tag) {
    unsigned char iv[12];
    nonce_of(counter, iv);
    int rc = -1;
    PyObject *nonce = PyBytes_FromStringAndSize((const char *)iv, 12);
    PyObject *plain = PyBytes_FromStringAndSize((const char *)length_kind, 9);
    PyObject *view = PyMemoryView_FromMemory((char *)payload, (Py_ssize_t)len, PyBUF_READ);
    PyObject *out = nonce && plain && view ? PyObject_CallFunctionObjArgs(mac, nonce, plain, view, NULL) : NULL;
    if (out) {
        char *data;
        Py_ssize_t size;
        if (PyBytes_AsStringAndSize(out, &data, &size) == 0) {
            if (size >= TAG_SIZE) {
                memcpy(tag, data + size - TAG_SIZE, TAG_SIZE);
                rc = 0;
            } else {
                PyErr_SetString(PyExc_ValueError, "the MAC function returned less than a tag");
            }
        }
    }
    Py_XDECREF(out);
    Py_XDECREF(view);
    Py_XDECREF(plain);
    Py_XDECREF(nonce);
    return rc;
}

/* Encrypted frames by libcrypto, without the GIL. Sealing: ``in`` the plaintext (``len``), ``out`` ciphertext | tag
 * (``len`` + 16); opening: ``in`` ciphertext | tag, ``out`` the plaintext. 0 on success, 1 when a tag fails, -1 when
 * libcrypto does. */
static int crypt_by_crypto(EVP_CTX *ctx, int sealing, uint64_t counter, const unsigned char *aad,
                           const unsigned char *in, size_t len, unsigned char *out) {
    unsigned char iv[12], tail[32];
    int outl;
    nonce_of(counter, iv);
    int (*init)(EVP_CTX *, const void *, void *, const unsigned char *, const unsigned char *) =
        sealing ? crypto.init : crypto.dec_init;
    int (*update)(EVP_CTX *, unsigned char *, int *, const unsigned char *, int) =
        sealing ? crypto.update : crypto.dec_update;
    if (init(ctx, NULL, NULL, NULL, iv) != 1 || update(ctx, NULL, &outl, aad, 9) != 1) return -1;
    const unsigned char *tag = in + len;
    while (len) {
        int piece = len > (1u << 30) ? (1 << 30) : (int)len;
        if (update(ctx, out, &outl, in, piece) != 1) return -1;
        in += piece;
        out += piece;
        len -= (size_t)piece;
    }
    if (sealing)
        return crypto.final(ctx, tail, &outl) == 1 && crypto.ctrl(ctx, EVP_CTRL_GCM_GET_TAG_, TAG_SIZE, out) == 1
                   ? 0 : -1;
    if (crypto.ctrl(ctx, EVP_CTRL_GCM_SET_TAG_, TAG_SIZE, (void *)tag) != 1) return -1;
    return crypto.dec_final(ctx, tail, &outl) == 1 ? 0 : 1;
}

/* Encrypted frames by the caller's functions, the GIL held: ``seal_into(nonce, aad, plaintext, out)``,
 * ``open_into(nonce, aad, sealed, out)`` -> whether the tag checked out. As crypt_by_crypto, -1 with an exception. */
static int crypt_by_python(PyObject *fn, int sealing, uint64_t counter, const unsigned char *aad,
                           unsigned char *in, size_t len, unsigned char *out) {
    unsigned char iv[12];
    nonce_of(counter, iv);
    size_t in_len = sealing ? len : len + TAG_SIZE, out_len = sealing ? len + TAG_SIZE : len;
    int rc = -1;
    PyObject *nonce = PyBytes_FromStringAndSize((const char *)iv, 12);
    PyObject *ad = PyBytes_FromStringAndSize((const char *)aad, 9);
    PyObject *src = PyMemoryView_FromMemory((char *)in, (Py_ssize_t)in_len, PyBUF_READ);
    PyObject *dst = PyMemoryView_FromMemory((char *)out, (Py_ssize_t)out_len, PyBUF_WRITE);
    PyObject *result = nonce && ad && src && dst ? PyObject_CallFunctionObjArgs(fn, nonce, ad, src, dst, NULL) : NULL;
    if (result) {
        int ok = sealing ? 1 : PyObject_IsTrue(result);
        rc = ok < 0 ? -1 : (ok ? 0 : 1);
    }
    Py_XDECREF(result);
    Py_XDECREF(dst);
    Py_XDECREF(src);
    Py_XDECREF(ad);
    Py_XDECREF(nonce);
    return rc;
}

enum mac_mode { MAC_AUTO = 0, MAC_NO_GIL = 1, MAC_GIL = 2 };

static int take_gil(int mode, EVP_CTX *ctx, PyThreadState **thread);

/* Seal or open an encrypted frame, one of the two ways (as tag_frame chooses): 0 on success, 1 when its tag fails,
 * -1 with a Python exception set, -2 when libcrypto failed. */
static int crypt_frame(int mode, PyObject *fn, EVP_CTX *ctx, int sealing, uint64_t counter,
                       const unsigned char *aad, unsigned char *in, size_t len, unsigned char *out,
                       PyThreadState **thread) {
    if (ctx && (mode == MAC_NO_GIL || (mode == MAC_AUTO && now_ns() < __atomic_load_n(&gil_free_until,
                                                                                          __ATOMIC_RELAXED)))) {
        int rc = crypt_by_crypto(ctx, sealing, counter, aad, in, len, out);
        return rc < 0 ? -2 : rc;
    }
    take_gil(mode, ctx, thread);
    int rc = crypt_by_python(fn, sealing, counter, aad, in, len, out);
    *thread = PyEval_SaveThread();
    return rc;
}

/* The tag of the frame numbered ``counter`` whose plaintext is ``length_kind`` (length | type byte) and whose
 * payload is ``len`` bytes at ``payload`` (see the top of this file for the two ways). 0 on success; -1 with a
 * Python exception set (the MAC function raised), -2 when libcrypto failed. */
static int tag_frame(int mode, PyObject *mac, EVP_CTX *ctx, uint64_t counter, const unsigned char *length_kind,
                     unsigned char *payload, size_t len, unsigned char *tag, PyThreadState **thread) {
    if (ctx && (mode == MAC_NO_GIL || (mode == MAC_AUTO && now_ns() < __atomic_load_n(&gil_free_until,
                                                                                          __ATOMIC_RELAXED))))
        return tag_by_crypto(ctx, counter, length_kind, payload, len, tag) == 0 ? 0 : -2;
    take_gil(mode, ctx, thread);
    int rc = tag_by_python(mac, counter, length_kind, payload, len, tag);
    *thread = PyEval_SaveThread();
    return rc;
}

/* this thread's voluntary context switches so far (it slept: on the GIL here); -1 where the system cannot say */
static long thread_sleeps(void) {
#ifdef RUSAGE_THREAD
    struct rusage use;
    return getrusage(RUSAGE_THREAD, &use) == 0 ? use.ru_nvcsw : -1;
#else
    return -1;
#endif
}

/* take the GIL back; a long wait for it (another thread runs Python) sends MAC_AUTO to libcrypto for a while. A
 * long wait in which this thread did not sleep is the scheduler's (a loaded machine preempted it), not another
 * thread's hold on the GIL: it keeps the faster ``cryptography`` (for sealing, AES-GCM at ~10 GB/s against the
 * system libcrypto's slower one here) */
static int take_gil(int mode, EVP_CTX *ctx, PyThreadState **thread) {
    int check = ctx && mode == MAC_AUTO;
    long slept = check ? thread_sleeps() : 0;
    int64_t asked = now_ns();
    PyEval_RestoreThread(*thread);
    int64_t got = now_ns();
    if (check && got - asked > GIL_WAIT_NS && (slept < 0 || thread_sleeps() != slept))
        __atomic_store_n(&gil_free_until, got + GIL_FREE_NS, __ATOMIC_RELAXED);
    return 0;
}

static void put_be64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (56 - 8 * i));
}

static uint64_t get_be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = (v << 8) | p[i];
    return v;
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* -- the loop -------------------------------------------------------------------------------------------------- */
typedef struct {
    int out_fd, in_fd, mac_mode;
    PyObject *out_mac, *in_mac;
    EVP_CTX *out_ctx, *in_ctx; /* NULL without libcrypto */
    uint64_t out_counter, in_counter;
    int encrypt;                              /* frames are encrypted: sealed into out_stage, opened from in_stage */
    unsigned char *out_stage, *in_stage;      /* (the largest frame + its tag each; NULL when not encrypted) */
    const int64_t *segs;   /* the buffer: (lo, hi, address) of each segment, in order, lo of the first 0 */
    Py_ssize_t n_segs;
    unsigned char *scratch, *gather; /* gather: a frame sent across segments is copied here first */
    const int64_t *first;  /* (lo, hi) byte ranges of buf sent first */
    Py_ssize_t n_first;
    const int64_t *plan;   /* per received frame: (step, lo, hi) */
    Py_ssize_t n_recv;
    int reduce_steps, total_steps, dtype, op;
    long ranks;            /* the average's divisor */
    int64_t timeout_ms, ahead, ahead_wait_ms, lowat_cap, lowat_tail, lowat_min;
    /* results */
    int status;
    long long detail;
    Py_ssize_t index;      /* frames received so far (the failing one on error) */
    int mid_send;          /* a frame was started (its counter taken) and not wholly handed to the kernel */
    unsigned char head[HEAD_SIZE];
} Ring;

static void set_lowat(Ring *r, int64_t *current, int64_t wanted) {
    if (wanted != *current) {
        int v = (int)wanted;
        setsockopt(r->in_fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v);
        *current = wanted;
    }
}

/* the segment holding logical byte lo (the last one starting at or before it) */
static Py_ssize_t seg_of(const int64_t *segs, Py_ssize_t n_segs, int64_t lo) {
    Py_ssize_t a = 0, b = n_segs - 1;
    while (a < b) {
        Py_ssize_t m = (a + b + 1) / 2;
        if (segs[3 * m] <= lo) a = m; else b = m - 1;
    }
    return a;
}

/* where the logical bytes lo:hi lie when one segment holds them all, else NULL */
static unsigned char *place(const int64_t *segs, Py_ssize_t n_segs, int64_t lo, int64_t hi) {
    const int64_t *g = segs + 3 * seg_of(segs, n_segs, lo);
    return hi <= g[1] ? (unsigned char *)(intptr_t)g[2] + (lo - g[0]) : NULL;
}

enum piece_action { GATHER, SCATTER, REDUCE, DIVIDE };

/* the logical bytes lo:hi segment by segment, against the contiguous ``flat`` (GATHER copies them into it,
 * SCATTER out of it, REDUCE reduces it into them, DIVIDE divides them by the ranks) */
static void pieces(const Ring *r, int action, int64_t lo, int64_t hi, unsigned char *flat) {
    for (Py_ssize_t s = seg_of(r->segs, r->n_segs, lo); lo < hi; s++) {
        const int64_t *g = r->segs + 3 * s;
        int64_t end = hi < g[1] ? hi : g[1];
        unsigned char *at = (unsigned char *)(intptr_t)g[2] + (lo - g[0]);
        size_t n = (size_t)(end - lo);
        switch (action) {
        case GATHER: memcpy(flat, at, n); break;
        case SCATTER: memcpy(at, flat, n); break;
        case REDUCE: reduce_into(r->dtype, r->op, at, flat, n); break;
        default: divide(r->dtype, at, r->ranks, n); break;
        }
        flat += n;
        lo = end;
    }
}

static void run_ring(Ring *r, PyThreadState **thread) {
    /* the send queue: byte ranges of buf, in order (at most every first chunk's frame and every received one) */
    Py_ssize_t cap = r->n_first + r->n_recv, q_head = 0, q_tail = 0;
    int64_t *queue = PyMem_RawMalloc(sizeof(int64_t) * 2 * (size_t)(cap ? cap : 1));
    if (!queue) { r->status = ST_NOMEM; return; }
    for (Py_ssize_t i = 0; i < r->n_first; i++) {
        queue[2 * q_tail] = r->first[2 * i];
        queue[2 * q_tail + 1] = r->first[2 * i + 1];
        q_tail++;
    }
    unsigned char out_head[HEAD_SIZE];
    struct iovec pending[2];
    int n_pending = 0;
    Py_ssize_t index = 0;
    size_t got_head = 0, target_len = 0, target_got = 0;
    unsigned char *target = NULL, *dest = NULL; /* where a frame is read (in_stage if encrypted); its payload's place */
    int have_target = 0, scattered = 0; /* scattered: an allgather frame across segments, received into scratch */
    unsigned char out_length_kind[9], in_length_kind[9]; /* a frame's plaintext: length | type byte */
    unsigned char expected_tag[TAG_SIZE], tag[TAG_SIZE];
    int same = r->out_fd == r->in_fd;
    int can_send = 1, can_recv = 1;
    int64_t last = now_ms(), lowat = 1, sent_bytes = 0, received_bytes = 0, released = -1;
    r->status = ST_OK;

    while (index < r->n_recv || n_pending || q_head < q_tail) {
        int progressed = 0, send_full = !can_send, recv_dry = !can_recv, held = 0;
        /* -- send as much as the socket takes */
        while (can_send && (n_pending || q_head < q_tail)) {
            if (!n_pending) {
                int64_t lo = queue[2 * q_head], hi = queue[2 * q_head + 1];
                q_head++;
                uint64_t length = (uint64_t)(hi - lo) + 1;
                put_be64(out_head, length);
                out_head[HEAD_SIZE - 1] = DATA_KIND;
                memcpy(out_length_kind, out_head, 8);
                out_length_kind[8] = DATA_KIND;
                unsigned char *from = place(r->segs, r->n_segs, lo, hi);
                if (!from) { /* across segments: gathered into one frame */
                    pieces(r, GATHER, lo, hi, r->gather);
                    from = r->gather;
                }
                int tagged;
                if (r->encrypt) { /* sealed into out_stage (ciphertext | tag), sent from there */
                    tagged = crypt_frame(r->mac_mode, r->out_mac, r->out_ctx, 1, r->out_counter, out_length_kind,
                                         from, (size_t)(hi - lo), r->out_stage, thread);
                    memcpy(out_head + 8, r->out_stage + (hi - lo), TAG_SIZE);
                    from = r->out_stage;
                } else {
                    tagged = tag_frame(r->mac_mode, r->out_mac, r->out_ctx, r->out_counter, out_length_kind, from,
                                       (size_t)(hi - lo), out_head + 8, thread);
                }
                if (tagged < 0) {
                    r->status = tagged == -1 ? ST_RAISED : ST_CRYPTO;
                    goto done;
                }
                r->out_counter++;
                pending[0].iov_base = out_head;
                pending[0].iov_len = HEAD_SIZE;
                pending[1].iov_base = from;
                pending[1].iov_len = (size_t)(hi - lo);
                n_pending = 2;
                if (hi == lo) { pending[1] = pending[0]; n_pending = 1; } /* (the ring plans no empty frame) */
            }
            struct iovec *iov = pending + (2 - n_pending);
            struct iovec offer[2];
            int n_offer = n_pending;
            size_t offered = 0;
            for (int k = 0; k < n_pending; k++) { offer[k] = iov[k]; offered += iov[k].iov_len; }
            int limited = 0;
            if (r->ahead && index < r->n_recv && received_bytes != released) {
                int64_t allowed = received_bytes + r->ahead - sent_bytes;
                if (allowed <= 0) { held = 1; break; }
                if ((size_t)allowed < offered) {
                    limited = 1;
                    if ((size_t)allowed <= offer[0].iov_len) { offer[0].iov_len = (size_t)allowed; n_offer = 1; }
                    else offer[1].iov_len = (size_t)allowed - offer[0].iov_len;
                    offered = (size_t)allowed;
                }
            }
            struct msghdr msg = {0};
            msg.msg_iov = offer;
            msg.msg_iovlen = (size_t)n_offer;
            ssize_t sent = sendmsg(r->out_fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (sent < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) { send_full = 1; can_send = 0; break; }
                r->status = ST_SEND_ERR;
                r->detail = errno;
                goto done;
            }
            progressed = 1;
            sent_bytes += sent;
            size_t left = (size_t)sent;
            while (left && n_pending) {
                struct iovec *v = pending + (2 - n_pending);
                size_t take = left < v->iov_len ? left : v->iov_len;
                v->iov_base = (unsigned char *)v->iov_base + take;
                v->iov_len -= take;
                left -= take;
                if (!v->iov_len) n_pending--;
            }
            while (n_pending && !pending[2 - n_pending].iov_len) n_pending--;
            if (n_pending) {
                if (limited && (size_t)sent == offered) continue; /* all that was allowed went: the allowance decides */
                send_full = 1;
                can_send = 0;
                break;
            }
        }
        /* -- receive what has arrived */
        while (index < r->n_recv) {
            const int64_t *step = r->plan + 3 * index;
            if (!have_target && got_head == HEAD_SIZE) { /* a header (perhaps read with the frame before) */
                uint64_t length = get_be64(r->head);
                size_t expected = (size_t)(step[2] - step[1]);
                if (length < 1) { r->status = ST_EMPTY; goto done; }
                if (r->head[HEAD_SIZE - 1] != DATA_KIND) { r->status = ST_CONTROL; goto done; }
                if (length - 1 != expected) { r->status = ST_SIZE; r->detail = (long long)(length - 1); goto done; }
                memcpy(expected_tag, r->head + 8, TAG_SIZE);
                memcpy(in_length_kind, r->head, 8);
                in_length_kind[8] = DATA_KIND;
                dest = step[0] < r->reduce_steps ? r->scratch : place(r->segs, r->n_segs, step[1], step[2]);
                scattered = dest == NULL;
                if (scattered) dest = r->scratch;
                target = r->encrypt ? r->in_stage : dest;
                target_len = expected;
                target_got = 0;
                got_head = 0;
                have_target = 1;
            }
            if (!have_target || target_got < target_len) {
                if (!can_recv) break;
                ssize_t n;
                size_t room;
                if (!have_target) {
                    room = HEAD_SIZE - got_head;
                    n = recv(r->in_fd, r->head + got_head, room, MSG_DONTWAIT);
                } else if (index + 1 < r->n_recv) {
                    /* the rest of this frame and the next one's header in one call (never past the last frame) */
                    struct iovec v[2] = {{target + target_got, target_len - target_got}, {r->head, HEAD_SIZE}};
                    struct msghdr msg = {0};
                    msg.msg_iov = v;
                    msg.msg_iovlen = 2;
                    room = target_len - target_got + HEAD_SIZE;
                    n = recvmsg(r->in_fd, &msg, MSG_DONTWAIT);
                } else {
                    room = target_len - target_got;
                    n = recv(r->in_fd, target + target_got, room, MSG_DONTWAIT);
                }
                if (n < 0) {
                    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) { recv_dry = 1; can_recv = 0; break; }
                    r->status = ST_RECV_ERR;
                    r->detail = errno;
                    goto done;
                }
                if (n == 0) { r->status = ST_RECV_ERR; r->detail = 0; goto done; }
                received_bytes += n;
                progressed = 1;
                if ((size_t)n < room) { recv_dry = 1; can_recv = 0; }
                if (!have_target) {
                    got_head += (size_t)n;
                    if (recv_dry && got_head < HEAD_SIZE) break;
                    continue;
                }
                target_got += (size_t)n;
                if (target_got > target_len) { /* the next frame's header came too */
                    got_head = target_got - target_len;
                    target_got = target_len;
                }
                if (target_got < target_len) {
                    if (recv_dry) break;
                    continue;
                }
                if (target_len >= (size_t)r->lowat_min) { recv_dry = 1; can_recv = 0; }
            }
            /* frame `index` is complete: check its tag before anything uses it */
            if (r->encrypt) { /* decrypted into its place, used only if the tag checked out */
                memcpy(r->in_stage + target_len, expected_tag, TAG_SIZE);
                int opened = crypt_frame(r->mac_mode, r->in_mac, r->in_ctx, 0, r->in_counter, in_length_kind,
                                         r->in_stage, target_len, dest, thread);
                if (opened < 0) {
                    r->status = opened == -1 ? ST_RAISED : ST_CRYPTO;
                    goto done;
                }
                if (opened) { r->status = ST_AUTH; goto done; }
            } else {
                int tagged = tag_frame(r->mac_mode, r->in_mac, r->in_ctx, r->in_counter, in_length_kind, target,
                                       target_len, tag, thread);
                if (tagged < 0) {
                    r->status = tagged == -1 ? ST_RAISED : ST_CRYPTO;
                    goto done;
                }
                unsigned char diff = 0; /* in constant time */
                for (int k = 0; k < TAG_SIZE; k++) diff |= (unsigned char)(tag[k] ^ expected_tag[k]);
                if (diff) { r->status = ST_AUTH; goto done; }
            }
            r->in_counter++;
            have_target = 0;
            if (step[0] < r->reduce_steps) {
                pieces(r, REDUCE, step[1], step[2], r->scratch);
                if (r->op == OP_AVERAGE && step[0] == r->reduce_steps - 1)
                    pieces(r, DIVIDE, step[1], step[2], r->scratch);
            } else if (scattered) {
                pieces(r, SCATTER, step[1], step[2], r->scratch);
            }
            if (step[0] + 1 < r->total_steps) {
                queue[2 * q_tail] = step[1];
                queue[2 * q_tail + 1] = step[2];
                q_tail++;
            }
            index++;
            progressed = 1;
        }
        if (index == r->n_recv && !n_pending && q_head == q_tail) break;
        if (held && (index == r->n_recv || received_bytes + r->ahead > sent_bytes)) held = 0;
        int64_t now = now_ms();
        int reading = index < r->n_recv;
        int sending = (n_pending || q_head < q_tail) && !held;
        if (progressed) {
            last = now;
            /* straight to poll only when both sides must wait; otherwise go round again at once */
            if (!((send_full || held || !(n_pending || q_head < q_tail)) && (recv_dry || !reading))) continue;
        } else if (now - last > r->timeout_ms) {
            r->status = ST_TIMEOUT;
            r->detail = reading ? 0 : 1;
            goto done;
        }
        if (reading) {
            int64_t wanted = have_target ? (int64_t)(target_len - target_got) : (int64_t)(HEAD_SIZE - got_head);
            if (wanted < r->lowat_min) wanted = 1;
            else {
                int64_t cap_now = index + 1 < r->n_recv ? r->lowat_cap : r->lowat_tail;
                if (wanted > cap_now) wanted = cap_now;
            }
            set_lowat(r, &lowat, wanted);
        }
        struct pollfd fds[2];
        int nfds = 0;
        short in_ev = reading ? POLLIN : 0, out_ev = sending ? POLLOUT : 0;
        if (same) {
            fds[nfds].fd = r->out_fd; fds[nfds].events = in_ev | out_ev; fds[nfds].revents = 0; nfds++;
        } else { /* a side with nothing to wait for is left out (fd -1): poll reports a hang-up asked or not */
            fds[nfds].fd = in_ev ? r->in_fd : -1; fds[nfds].events = in_ev; fds[nfds].revents = 0; nfds++;
            fds[nfds].fd = out_ev ? r->out_fd : -1; fds[nfds].events = out_ev; fds[nfds].revents = 0; nfds++;
        }
        int64_t wait_ms = r->timeout_ms - (now - last);
        if (wait_ms > 1000) wait_ms = 1000;
        if (wait_ms < 1) wait_ms = 1;
        if (held && wait_ms > r->ahead_wait_ms) wait_ms = r->ahead_wait_ms;
        int events = poll(fds, (nfds_t)nfds, (int)wait_ms);
        if (events < 0) {
            if (errno != EINTR) { r->status = ST_RECV_ERR; r->detail = errno; goto done; }
            PyEval_RestoreThread(*thread); /* a signal: let its Python handler run (Ctrl-C raises) */
            int raised = PyErr_CheckSignals() < 0;
            *thread = PyEval_SaveThread();
            if (raised) { r->status = ST_RAISED; goto done; }
            continue;
        }
        if (held && events == 0) released = received_bytes; /* nothing came for a while: send on regardless */
        for (int k = 0; k < nfds; k++) {
            short ev = fds[k].revents;
            if (fds[k].fd == r->out_fd && (ev & (POLLOUT | POLLHUP | POLLERR))) can_send = 1;
            if (fds[k].fd == r->in_fd && (ev & (POLLIN | POLLHUP | POLLERR))) can_recv = 1;
        }
    }
done:
    if (lowat != 1) set_lowat(r, &lowat, 1);
    r->index = index;
    r->mid_send = n_pending > 0;
    PyMem_RawFree(queue);
}

PyDoc_STRVAR(ring_doc,
"ring(out_fd, in_fd, out_mac, out_key, out_counter, in_mac, in_key, in_counter, buf, scratch, first, plan,\n"
"     reduce_steps, total_steps, dtype, op, ranks, timeout_ms, ahead, ahead_wait_ms, lowat_cap, lowat_tail,\n"
"     lowat_min, mac_mode, encrypt[, out_stage, in_stage], *, segments=None, gather=None)\n"
"-> (status, detail, out_counter, in_counter, frames_received, header, mid_send)\n\n"
"Run a ring's steps on ``buf`` (see the module's C source); ``first``: int64 (lo, hi) pairs, ``plan``: int64\n"
"(step, lo, hi) triples; ``out_mac``/``in_mac``: each direction's AESGCM.encrypt, ``out_key``/``in_key`` its\n"
"32-byte key; ``mac_mode``: 0 either way to the tag (see the source), 1 libcrypto, 2 the MAC function;\n"
"``encrypt``: frames are encrypted, ``out_mac``/``in_mac`` then each direction's ``seal_into``/``open_into``;\n"
"``out_stage``/``in_stage``: writable buffers of at least the largest frame + 16 bytes to seal into and receive\n"
"into, kept by the caller between calls (else allocated per call); ``segments``: a list of writable buffers\n"
"that stand for ``buf`` (then empty) as one logical buffer, their bytes one after the other (frames across\n"
"them are received into ``scratch`` and sent from ``gather``, each at least as large as such a frame).");

/* whether a frame's bytes lo:hi lie in the logical buffer of ``total`` bytes and fit where they pass through: a
 * frame received into the scratch (``scratched``, or across segments) or sent across segments (``sent``) */
static int frame_ok(const int64_t *segs, Py_ssize_t n_segs, int64_t total, int64_t lo, int64_t hi, int scratched,
                    int sent, Py_ssize_t scratch_len, Py_ssize_t gather_len) {
    if (lo < 0 || hi < lo || hi > total) return 0;
    int across = place(segs, n_segs, lo, hi) == NULL;
    if ((scratched || (across && !sent)) && hi - lo > scratch_len) return 0;
    return !(across && sent && hi - lo > gather_len);
}

static PyObject *ring(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    int out_fd, in_fd, reduce_steps, total_steps, dtype, op;
    unsigned long long out_counter, in_counter;
    long ranks;
    long long timeout_ms, ahead, ahead_wait_ms, lowat_cap, lowat_tail, lowat_min;
    PyObject *out_mac, *in_mac;
    Py_buffer out_key, in_key, buf, scratch, first, plan, out_given = {0}, in_given = {0}, gather = {0};
    int mac_mode, encrypt;
    PyObject *segments = Py_None;
    static char *names[] = {"", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "",
                            "", "", "", "", "", "", "segments", "gather", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iiOy*KOy*Kw*w*y*y*iiiilLLLLLLii|w*w*$Ow*", names, &out_fd,
                                     &in_fd, &out_mac, &out_key, &out_counter, &in_mac, &in_key, &in_counter, &buf,
                                     &scratch, &first, &plan, &reduce_steps, &total_steps, &dtype, &op, &ranks,
                                     &timeout_ms, &ahead, &ahead_wait_ms, &lowat_cap, &lowat_tail, &lowat_min,
                                     &mac_mode, &encrypt, &out_given, &in_given, &segments, &gather))
        return NULL;
    PyObject *result = NULL;
    EVP_CTX *out_ctx = NULL, *in_ctx = NULL;
    unsigned char *out_stage = NULL, *in_stage = NULL;
    int own_stages = 0;
    /* the segment table: ``buf`` alone, or each of ``segments`` (their buffers held until the end) */
    int64_t one_seg[3] = {0, buf.len, (int64_t)(intptr_t)buf.buf};
    int64_t *segs = one_seg, total = buf.len;
    Py_ssize_t n_segs = 1;
    Py_buffer *views = NULL;
    if (segments != Py_None) {
        if (!PyList_Check(segments) || PyList_GET_SIZE(segments) == 0 || buf.len) {
            PyErr_SetString(PyExc_ValueError, "segments must be a non-empty list, with an empty buf");
            goto out;
        }
        n_segs = PyList_GET_SIZE(segments);
        segs = PyMem_Malloc(sizeof(int64_t) * 3 * (size_t)n_segs);
        views = PyMem_Calloc((size_t)n_segs, sizeof(Py_buffer));
        if (!segs || !views) {
            PyErr_NoMemory();
            goto out;
        }
        total = 0;
        for (Py_ssize_t i = 0; i < n_segs; i++) {
            if (PyObject_GetBuffer(PyList_GET_ITEM(segments, i), &views[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
                goto out;
            if (views[i].len <= 0) {
                PyErr_SetString(PyExc_ValueError, "a segment is empty");
                goto out;
            }
            segs[3 * i] = total;
            total += views[i].len;
            segs[3 * i + 1] = total;
            segs[3 * i + 2] = (int64_t)(intptr_t)views[i].buf;
        }
    }
    if (out_key.len != 32 || in_key.len != 32) {
        PyErr_SetString(PyExc_ValueError, "keys must be 32 bytes");
        goto out;
    }
    if (mac_mode != MAC_GIL) {
        out_ctx = crypto_ctx(out_key.buf, 0);
        in_ctx = out_ctx ? crypto_ctx(in_key.buf, encrypt) : NULL;
        if (!in_ctx && mac_mode == MAC_NO_GIL) {
            PyErr_SetString(PyExc_RuntimeError, "libcrypto (OpenSSL) could not be loaded or set up");
            goto out;
        }
    }
    if (reduce_steps > 0 && (dtype < 0 || dtype >= DT_COUNT || dtype == DT_BYTES || op < 0 || op >= OP_COUNT)) {
        PyErr_SetString(PyExc_ValueError, "unknown dtype or reduction code");
        goto out;
    }
    Py_ssize_t n_first = first.len / (Py_ssize_t)(2 * sizeof(int64_t)), n_recv = plan.len / (Py_ssize_t)(3 * sizeof(int64_t));
    const int64_t *f = first.buf, *p = plan.buf;
    for (Py_ssize_t i = 0; i < n_first; i++)
        if (!frame_ok(segs, n_segs, total, f[2 * i], f[2 * i + 1], 0, 1, scratch.len, gather.len)) {
            PyErr_SetString(PyExc_ValueError, "a first range lies outside the buffer or the gather buffer");
            goto out;
        }
    for (Py_ssize_t i = 0; i < n_recv; i++) {
        int64_t step = p[3 * i], lo = p[3 * i + 1], hi = p[3 * i + 2];
        if (!frame_ok(segs, n_segs, total, lo, hi, step < reduce_steps, 0, scratch.len, gather.len)
            || (step + 1 < total_steps && !frame_ok(segs, n_segs, total, lo, hi, 0, 1, scratch.len, gather.len))) {
            PyErr_SetString(PyExc_ValueError, "a planned frame lies outside the buffer, scratch or gather buffer");
            goto out;
        }
    }
    if (encrypt) { /* the stages: the largest frame sent or received, and a tag */
        int64_t largest = 0;
        for (Py_ssize_t i = 0; i < n_first; i++)
            if (f[2 * i + 1] - f[2 * i] > largest) largest = f[2 * i + 1] - f[2 * i];
        for (Py_ssize_t i = 0; i < n_recv; i++)
            if (p[3 * i + 2] - p[3 * i + 1] > largest) largest = p[3 * i + 2] - p[3 * i + 1];
        Py_ssize_t need = (Py_ssize_t)largest + TAG_SIZE;
        if (out_given.buf && in_given.buf && out_given.len >= need && in_given.len >= need) {
            out_stage = out_given.buf; /* the caller's, kept between calls: no pages mapped and zeroed per call */
            in_stage = in_given.buf;
        } else {
            own_stages = 1;
            out_stage = PyMem_RawMalloc((size_t)need);
            in_stage = PyMem_RawMalloc((size_t)need);
        }
        if (!out_stage || !in_stage) {
            PyErr_NoMemory();
            goto out;
        }
    }
    Ring r = {0};
    r.encrypt = encrypt; r.out_stage = out_stage; r.in_stage = in_stage;
    r.out_fd = out_fd; r.in_fd = in_fd; r.out_mac = out_mac; r.in_mac = in_mac; r.mac_mode = mac_mode;
    if (in_ctx) { r.out_ctx = out_ctx; r.in_ctx = in_ctx; } /* both or neither */
    r.out_counter = out_counter; r.in_counter = in_counter;
    r.segs = segs; r.n_segs = n_segs; r.gather = gather.buf; r.scratch = scratch.buf;
    r.first = f; r.n_first = n_first; r.plan = p; r.n_recv = n_recv;
    r.reduce_steps = reduce_steps; r.total_steps = total_steps; r.dtype = dtype; r.op = op; r.ranks = ranks;
    r.timeout_ms = timeout_ms; r.ahead = ahead; r.ahead_wait_ms = ahead_wait_ms;
    r.lowat_cap = lowat_cap; r.lowat_tail = lowat_tail; r.lowat_min = lowat_min;
    PyThreadState *thread = PyEval_SaveThread();
    run_ring(&r, &thread);
    PyEval_RestoreThread(thread);
    if (r.status == ST_RAISED) goto out; /* the exception is set */
    result = Py_BuildValue("iLKKny#O", r.status, r.detail, (unsigned long long)r.out_counter,
                           (unsigned long long)r.in_counter, r.index, (const char *)r.head, (Py_ssize_t)HEAD_SIZE,
                           r.mid_send ? Py_True : Py_False);
out:
    for (Py_ssize_t i = 0; views && i < n_segs; i++)
        if (views[i].obj) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    if (segs != one_seg) PyMem_Free(segs);
    if (gather.obj) PyBuffer_Release(&gather);
    if (own_stages) {
        PyMem_RawFree(out_stage);
        PyMem_RawFree(in_stage);
    }
    if (out_given.obj) PyBuffer_Release(&out_given);
    if (in_given.obj) PyBuffer_Release(&in_given);
    if (out_ctx) crypto.ctx_free(out_ctx);
    if (in_ctx) crypto.ctx_free(in_ctx);
    PyBuffer_Release(&out_key);
    PyBuffer_Release(&in_key);
    PyBuffer_Release(&buf);
    PyBuffer_Release(&scratch);
    PyBuffer_Release(&first);
    PyBuffer_Release(&plan);
    return result;
}

#ifdef __linux__ /* futexes, sched_getcpu, CPU sets: Linux only, as the shared-memory transport is */
/* -- the shared-memory small allreduce (spark_hvd.core.transport.shm's latency path) ----------------------------
 * One block, one array, the counter protocol of shm.py (slot g, IN = g, wait every peer's IN, reduce, OUT = g) with
 * no Python between the steps. ``layout`` (bytes, int64s, built once per group by ShmGroup.attach): size, local
 * index, nslots, block_bytes, every member's control page address, every member's slot area address.
 *
 * A wait spins (the pause instruction) for ``spin_ns``, yielding the core at every look after ``yield_ns`` (the peer
 * may be queued on this very core), then sleeps on the futex, the GIL released, with this rank's SLEEP word saying
 * on whose word it sleeps. A publication stores the counter, fences, and makes the futex wake call only where a
 * peer's SLEEP word names that counter (a waiter stores SLEEP before its futex wait, whose check of the value runs
 * after the kernel's locked operation: either the waker sees SLEEP or the waiter sees the new value). After
 * ``budget_ns`` of waiting it returns the stage it waits at (the caller checks its peers and waits in Python, then
 * calls again from there): 1 for the slot (every peer's OUT >= g - nslots), 3 for the peers' data (IN >= g); 0 when
 * done. Nothing here allocates or touches Python objects while the GIL is released. */
#define SHM_IN 0
#define SHM_OUT 16
#define SHM_SLEEP 26
#define SHM_CPU 27 /* 1 + the CPU this rank last waited on */
#define SHM_WORDS 512 /* a control page's int64 words: SLEEP = 1 + rank * SHM_WORDS + word */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline int64_t shm_load(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

/* 1 + this thread's CPU, stored in this rank's CPU word where it changed; 0 where the system cannot say */
static int64_t shm_here(int64_t *const *ctrl, int64_t me) {
    int cpu = sched_getcpu();
    if (cpu < 0) return 0;
    if (__atomic_load_n(ctrl[me] + SHM_CPU, __ATOMIC_RELAXED) != 1 + cpu)
        __atomic_store_n(ctrl[me] + SHM_CPU, 1 + cpu, __ATOMIC_RELAXED);
    return 1 + cpu;
}

#define NUDGE_EVERY_NS 10000000LL /* a thread moves itself off its peer's CPU at most this often: 10 ms */
static __thread int64_t nudged_at;

/* Move this thread off CPU ``here - 1`` (where its peer is queued) and give it its CPUs back at once: the kernel
 * migrates a thread whose CPU leaves its set, and nothing holds it there afterwards (not a binding: shm_bind.py).
 * 1 when it moved. */
static int shm_nudge(int64_t here) {
    int64_t now = now_ns();
    if (now - nudged_at < NUDGE_EVERY_NS) return 0;
    nudged_at = now;
    cpu_set_t before, away;
    if (sched_getaffinity(0, sizeof before, &before) || CPU_COUNT(&before) < 2 || here - 1 >= CPU_SETSIZE ||
        !CPU_ISSET(here - 1, &before))
        return 0;
    away = before;
    CPU_CLR(here - 1, &away);
    if (sched_setaffinity(0, sizeof away, &away)) return 0;
    sched_setaffinity(0, sizeof before, &before);
    return 1;
}

/* one look's pause: where the peer last waited on this very CPU (it is queued behind this rank: spinning would
 * only keep it from running), move to another CPU (shm_nudge) or yield; after yield_ns, yield at every look */
static inline void shm_pause(int64_t *const *ctrl, int64_t me, int64_t k, int64_t *here, int64_t spent,
                             int64_t yield_ns, int move) {
    if (*here && __atomic_load_n(ctrl[k] + SHM_CPU, __ATOMIC_RELAXED) == *here) {
        if (move && shm_nudge(*here)) {
            *here = shm_here(ctrl, me);
            return;
        }
        sched_yield();
    } else if (spent >= yield_ns) {
        sched_yield();
    }
}

static void shm_publish(int64_t *const *ctrl, int64_t n, int64_t me, int word, int64_t value) {
    __atomic_store_n(ctrl[me] + word, value, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    int64_t want = 1 + me * SHM_WORDS + word;
    for (int64_t k = 0; k < n; k++)
        if (k != me && __atomic_load_n(ctrl[k] + SHM_SLEEP, __ATOMIC_RELAXED) == want) {
            syscall(SYS_futex, ctrl[me] + word, FUTEX_WAKE, 0x7FFFFFFF, NULL, NULL, 0);
            return;
        }
}

/* wait until ctrl[k][word] >= target: 1 when it is, 0 after budget_ns */
static int shm_wait(int64_t *const *ctrl, int64_t me, int64_t k, int word, int64_t target, int64_t spin_ns,
                    int64_t yield_ns, int64_t budget_ns, int move) {
    const int64_t *p = ctrl[k] + word;
    if (shm_load(p) >= target) return 1;
    int64_t t0 = now_ns(), now = t0, here = spin_ns > 0 ? shm_here(ctrl, me) : 0;
    while (now - t0 < spin_ns) {
        for (int i = 0; i < 32; i++) {
            if (shm_load(p) >= target) return 1;
            cpu_relax();
        }
        now = now_ns();
        shm_pause(ctrl, me, k, &here, now - t0, yield_ns, move);
    }
    int64_t *sleep_word = ctrl[me] + SHM_SLEEP;
    __atomic_store_n(sleep_word, 1 + k * SHM_WORDS + word, __ATOMIC_RELAXED);
    int reached = 0;
    for (;;) {
        int64_t v = shm_load(p);
        if (v >= target) { reached = 1; break; }
        now = now_ns();
        if (now - t0 >= budget_ns) break;
        int64_t left = budget_ns - (now - t0);
        if (left > 2000000) left = 2000000;
        struct timespec ts = {(time_t)(left / 1000000000), (long)(left % 1000000000)};
        Py_BEGIN_ALLOW_THREADS
        syscall(SYS_futex, p, FUTEX_WAIT, (int)(uint32_t)v, &ts, NULL, 0);
        Py_END_ALLOW_THREADS
    }
    __atomic_store_n(sleep_word, 0, __ATOMIC_RELAXED);
    return reached;
}

static int64_t *const *shm_layout(Py_buffer *layout, int64_t *n, int64_t *me, int64_t *nslots, int64_t *block,
                                  int64_t *const **slots) {
    const int64_t *l = (const int64_t *)layout->buf;
    if (layout->len < 4 * 8) return NULL;
    *n = l[0], *me = l[1], *nslots = l[2], *block = l[3];
    if (*n < 2 || *me < 0 || *me >= *n || *n > 4096 || layout->len != (4 + 2 * *n) * 8) return NULL;
    *slots = (int64_t *const *)(l + 4 + *n);
    return (int64_t *const *)(l + 4);
}

PyDoc_STRVAR(shm_small_doc,
"shm_small(layout, buf, dtype, op, g, stage, spin_ns, yield_ns, budget_ns, move) -> int\n\n"
"The shared-memory small allreduce of ``buf`` (writable, contiguous, at most a block) as collective ``g``, from\n"
"``stage`` (0, or where a call returned): 0 done, 1 / 3 waited ``budget_ns`` for the slot / the peers' data.");

PyDoc_STRVAR(shm_agreed_doc,
"shm_agreed(layout, buf, agree, dtype, op, g, stage, spin_ns, yield_ns, budget_ns, move) -> int\n\n"
"``shm_small`` with the ranks' agreement in band: an 8-byte flag ahead of ``buf`` in the slot (``agree``), and\n"
"``buf`` reduced in place only if every rank's flag is set (a rank that does not agree writes its flag alone, and\n"
"its ``buf`` is never read or written). 0 done and agreed, 4 done and not agreed, 1 / 3 as ``shm_small``.");

/* shm_small (flagged 0) and shm_agreed (flagged 1: the flag's 8 bytes ahead of the data in the slot) */
static PyObject *shm_small_run(PyObject *args, int flagged) {
    Py_buffer layout, buf;
    int agree = 1, dtype, op, stage, move;
    long long g, spin_ns, yield_ns, budget_ns;
    int parsed = flagged ? PyArg_ParseTuple(args, "y*w*piiLiLLLp", &layout, &buf, &agree, &dtype, &op, &g, &stage,
                                            &spin_ns, &yield_ns, &budget_ns, &move)
                         : PyArg_ParseTuple(args, "y*w*iiLiLLLp", &layout, &buf, &dtype, &op, &g, &stage, &spin_ns,
                                            &yield_ns, &budget_ns, &move);
    if (!parsed) return NULL;
    const size_t head = flagged ? 8 : 0;
    int64_t n, me, nslots, block;
    int64_t *const *slots;
    int64_t *const *ctrl = shm_layout(&layout, &n, &me, &nslots, &block, &slots);
    int result = 0;
    PyObject *answer = NULL;
    if (!ctrl || dtype < 0 || dtype >= DT_COUNT || dtype == DT_BYTES || (flagged && dtype == DT_BF16) || op < 0 ||
        op >= OP_COUNT || g < 1 || buf.len + (Py_ssize_t)head > block || buf.len % (Py_ssize_t)itemsizes[dtype]) {
        PyErr_SetString(PyExc_ValueError, flagged ? "shm_agreed: bad layout, dtype, op, sequence number or size"
                                                  : "shm_small: bad layout, dtype, op, sequence number or size");
        goto out;
    }
    size_t nbytes = (size_t)buf.len;
    size_t off = (size_t)((g - 1) % nslots) * (size_t)block;
    unsigned char *acc = (unsigned char *)buf.buf;
    if (stage <= 0) {
        if (g > nslots)
            for (int64_t k = 0; k < n; k++)
                if (k != me && !shm_wait(ctrl, me, k, SHM_OUT, g - nslots, spin_ns, yield_ns, budget_ns, move)) {
                    result = 1;
                    goto out;
                }
        unsigned char *mine = (unsigned char *)slots[me] + off;
        if (flagged) {
            const int64_t flag = agree ? 1 : 0;
            memcpy(mine, &flag, 8);
        }
        if (agree) memcpy(mine + head, acc, nbytes);
        shm_publish(ctrl, n, me, SHM_IN, g);
    }
    for (int64_t k = 0; k < n; k++)
        if (k != me && !shm_wait(ctrl, me, k, SHM_IN, g, spin_ns, yield_ns, budget_ns, move)) {
            result = 3;
            goto out;
        }
    int all = 1;
    for (int64_t k = 0; flagged && k < n && all; k++) {
        int64_t flag;
        memcpy(&flag, (const unsigned char *)slots[k] + off, 8);
        all = flag == 1;
    }
    if (!all) {
        result = 4;
    } else {
        if (n == 2 && dtype != DT_BF16) {
            reduce_into(dtype, op, acc, (unsigned char *)slots[1 - me] + off + head, nbytes); /* commutative */
        } else {
            memcpy(acc, (unsigned char *)slots[0] + off + head, nbytes);
            for (int64_t k = 1; k < n; k++) reduce_into(dtype, op, acc, (unsigned char *)slots[k] + off + head, nbytes);
        }
        if (op == OP_AVERAGE) divide(dtype, acc, (long)n, nbytes);
    }
    shm_publish(ctrl, n, me, SHM_OUT, g);
out:
    if (!PyErr_Occurred()) answer = PyLong_FromLong(result);
    PyBuffer_Release(&layout);
    PyBuffer_Release(&buf);
    return answer;
}

static PyObject *shm_small(PyObject *self, PyObject *args) {
    (void)self;
    return shm_small_run(args, 0);
}

static PyObject *shm_agreed(PyObject *self, PyObject *args) {
    (void)self;
    return shm_small_run(args, 1);
}

PyDoc_STRVAR(shm_release_doc,
"shm_release(layout, target, spin_ns, yield_ns, move) -> bool\n\n"
"Spin (no sleep) until every peer's OUT reached ``target``, yielding the core at every look after ``yield_ns``;\n"
"False where ``spin_ns`` ran out first (ShmGroup.release).");

static PyObject *shm_release(PyObject *self, PyObject *args) {
    Py_buffer layout;
    long long target, spin_ns, yield_ns;
    int move;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*LLLp", &layout, &target, &spin_ns, &yield_ns, &move)) return NULL;
    int64_t n, me, nslots, block;
    int64_t *const *slots;
    int64_t *const *ctrl = shm_layout(&layout, &n, &me, &nslots, &block, &slots);
    if (!ctrl) {
        PyBuffer_Release(&layout);
        PyErr_SetString(PyExc_ValueError, "shm_release: bad layout");
        return NULL;
    }
    int done = 1;
    int64_t t0 = 0, here = 0;
    for (int64_t k = 0; k < n && done; k++) {
        if (k == me) continue;
        const int64_t *p = ctrl[k] + SHM_OUT;
        while (shm_load(p) < target) {
            for (int i = 0; i < 32 && shm_load(p) < target; i++) cpu_relax();
            int64_t now = now_ns();
            if (!t0) t0 = now, here = shm_here(ctrl, me);
            if (now - t0 > spin_ns) { done = 0; break; }
            shm_pause(ctrl, me, k, &here, now - t0, yield_ns, move);
        }
    }
    PyBuffer_Release(&layout);
    return PyBool_FromLong(done);
}

/* -- the cross-memory pair's reduce-scatter (shm_cma.CmaPair.allreduce, step 2) -------------------------------- */
/* The byte range [lo, hi) of a concatenation of arrays, given as a table of (address, bytes) pairs: walk it piece by
 * piece from the piece holding lo (``*at``: its index, ``*start``: its first byte in the concatenation). */
static int64_t cma_pieces(const int64_t *table, int64_t n, int64_t lo, int64_t hi, int64_t *at, int64_t *start,
                          struct iovec *out) {
    int64_t k = 0;
    while (*at < n && *start + table[2 * *at + 1] <= lo) *start += table[2 * *at + 1], (*at)++;
    for (int64_t i = *at, s = *start; i < n && s < hi; s += table[2 * i + 1], i++) {
        int64_t a = lo > s ? lo : s, b = hi < s + table[2 * i + 1] ? hi : s + table[2 * i + 1];
        if (b > a) out[k].iov_base = (void *)(intptr_t)(table[2 * i] + (a - s)), out[k++].iov_len = (size_t)(b - a);
    }
    return k;
}

PyDoc_STRVAR(cma_reduce_doc,
"cma_reduce(pid, mine, theirs, scratch, lo, hi, dtype, op, divisor) -> (errno, got, want)\n\n"
"Bytes [lo, hi) of the concatenation of this process's arrays ``mine`` op= the same bytes of process ``pid``'s\n"
"``theirs`` (int64 tables of (address, bytes) pairs), read block by block (``scratch``'s length, a multiple of the\n"
"itemsize) by process_vm_readv into ``scratch`` and reduced piece by piece where the arrays lie (then divided by\n"
"``divisor`` where it is above 1); without the GIL. (0, 0, 0), or the read that failed: its errno (0: short).");

static PyObject *cma_reduce(PyObject *self, PyObject *args) {
    Py_buffer mine, theirs, scratch;
    int pid, dtype, op;
    long long lo, hi;
    long divisor;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*y*w*LLiil", &pid, &mine, &theirs, &scratch, &lo, &hi, &dtype, &op, &divisor))
        return NULL;
    int64_t nm = mine.len / 16, nt = theirs.len / 16, block = scratch.len;
    PyObject *answer = NULL;
    struct iovec *iov = NULL;
    if (dtype < 0 || dtype >= DT_COUNT || dtype == DT_BYTES || op < 0 || op >= OP_COUNT || nm < 1 || nt < 1 ||
        block < 1 || block % (int64_t)itemsizes[dtype] || lo < 0 || hi < lo) {
        PyErr_SetString(PyExc_ValueError, "cma_reduce: bad tables, scratch, range, dtype or op");
        goto out;
    }
    iov = PyMem_Malloc((size_t)(nm > nt ? nm : nt) * sizeof *iov);
    if (!iov) {
        PyErr_NoMemory();
        goto out;
    }
    int err = 0;
    ssize_t got = 0, want = 0;
    unsigned char *buf = (unsigned char *)scratch.buf;
    const int64_t *tm = (const int64_t *)mine.buf, *tt = (const int64_t *)theirs.buf;
    Py_BEGIN_ALLOW_THREADS
    int64_t am = 0, sm = 0, at = 0, st = 0;
    for (int64_t a = lo; a < hi && !err; a += block) {
        int64_t b = hi - a < block ? hi : a + block;
        struct iovec local = {buf, (size_t)(b - a)};
        int64_t k = cma_pieces(tt, nt, a, b, &at, &st, iov);
        want = b - a;
        got = process_vm_readv(pid, &local, 1, iov, (unsigned long)k, 0);
        if (got != want) {
            err = got < 0 ? errno : 0;
            if (!err) err = -1;
            break;
        }
        k = cma_pieces(tm, nm, a, b, &am, &sm, iov);
        for (int64_t i = 0, off = 0; i < k; off += (int64_t)iov[i].iov_len, i++) {
            reduce_into(dtype, op, iov[i].iov_base, buf + off, iov[i].iov_len);
            if (divisor > 1) divide(dtype, iov[i].iov_base, divisor, iov[i].iov_len);
        }
    }
    Py_END_ALLOW_THREADS
    if (err) answer = Py_BuildValue("inn", err < 0 ? 0 : err, (Py_ssize_t)got, (Py_ssize_t)want);
    else answer = Py_BuildValue("iii", 0, 0, 0);
out:
    PyMem_Free(iov);
    PyBuffer_Release(&mine);
    PyBuffer_Release(&theirs);
    PyBuffer_Release(&scratch);
    return answer;
}
#endif /* __linux__ */

static PyMethodDef methods[] = {
    {"ring", (PyCFunction)(void (*)(void))ring, METH_VARARGS | METH_KEYWORDS, ring_doc},
#ifdef __linux__
    {"shm_small", shm_small, METH_VARARGS, shm_small_doc},
    {"shm_agreed", shm_agreed, METH_VARARGS, shm_agreed_doc},
    {"shm_release", shm_release, METH_VARARGS, shm_release_doc},
    {"cma_reduce", cma_reduce, METH_VARARGS, cma_reduce_doc},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ringloop",
    "The ring's pipelined exchange loop, compiled (see spark_hvd/core/transport/ringloop.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ringloop(void) { return PyModule_Create(&module); }
