// zserve's CPU kernels: the few steps of a decode step that torch can only express as several
// passes over memory. Built at first use by __init__.py (g++ -O3 -march=native -fopenmp) and
// called through ctypes with raw pointers, so this file needs no torch headers and compiles in a
// few seconds. OpenMP here is the libgomp torch already loaded (same soname), so these kernels share
// torch's thread pool instead of fighting it for the cores.
//
// Every kernel comes in float32 and bfloat16 (raw uint16) flavours; all arithmetic is float32.
// Return value: 0 on success, a negative number for arguments the kernel cannot handle (the
// Python side then raises; it checks shapes before calling, so this is a second line).

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kMaxGroup = 64;   // query heads per KV head
constexpr int kChunk = 32;      // keys scored before one online-softmax update

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    return __builtin_bit_cast(float, u);
}

inline void from_f32(float x, float *dst) { *dst = x; }
inline void from_f32(float x, uint16_t *dst) {
    // Round to nearest even, as torch does; NaN stays a (quiet) NaN. Branch-free so that loops
    // storing bf16 vectorise.
    const uint32_t u = __builtin_bit_cast(uint32_t, x);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    *dst = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// x rounded to T's precision, back in float: the fused kernels round where torch's separate ops
// would store an intermediate tensor, so bf16 results match the unfused model's.
template <typename T>
inline float round_as(float x) {
    T h;
    from_f32(x, &h);
    return to_f32(h);
}

// exp(x) for x <= 0, vectorisable (no libm call): x = n*ln2 + r with |r| <= ln2/2, then a
// degree-7 Taylor polynomial for exp(r) (relative error below 2e-8, under float's rounding).
inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float magic = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
    float n = (x * 1.44269504088896341f + magic) - magic;
    float r = x - n * 0.693145751953125f;  // ln2 split in two for an exact first product
    r = r - n * 1.428606765330187e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t e = (int32_t(n) + 127) << 23;
    return p * __builtin_bit_cast(float, e);
}

// Decode attention over the paged cache: one query token per sequence, keys and values read in
// place through the block table (no gather). Online softmax over chunks of keys, so memory use
// does not grow with the context.
//
//   q      [B, H, D] rows, row b starts at q + b * q_stride (heads contiguous inside a row)
//   kv     one layer of the pool: [2, KV, slots, D]; plane p (k: 0..KV-1, v: KV..2KV-1) starts
//          at kv + p * plane
//   tables [B, table_stride] int32 block ids; lens [B] int32 keys per row (>= 1)
//   window > 0: only the last `window` keys of each row (sliding-window attention)
//   out    [B, H, D] contiguous
//
// One work item is (row, KV head): its G query heads share every key and value row read.
struct DecodeArgs {
    int64_t q_stride, plane, table_stride;
    const int32_t *tables, *lens;
    int H, KV, G, D, bs;
    float scale;
    int window;  // > 0: attend to the last `window` keys only (sliding-window attention)

    int first_key(int len) const { return window > 0 && len > window ? len - window : 0; }
};

bool g_portable_only = false;  // tests set it to check the portable versions on AVX-512 machines

inline int64_t slot_of(const int32_t *table, int pos, int bs) { return int64_t(table[pos / bs]) * bs + pos % bs; }

template <typename T>
using DecodeItem = void (*)(const T *, const T *, T *, int, int, const DecodeArgs &);

// Portable version: any head size; the compiler vectorises the loops over D.
template <typename T>
void decode_item_generic(const T *q, const T *kv, T *out, int b, int h, const DecodeArgs &a) {
    const int G = a.G, D = a.D, len = a.lens[b];
    alignas(64) float qf[kMaxGroup][kMaxHeadDim];
    alignas(64) float acc[kMaxGroup][kMaxHeadDim];
    alignas(64) float row[kMaxHeadDim];
    alignas(64) float s[kMaxGroup][kChunk];
    float m[kMaxGroup], l[kMaxGroup];
    int64_t slot[kChunk];
    for (int g = 0; g < G; ++g) {
        const T *qr = q + b * a.q_stride + int64_t(h * G + g) * D;
        for (int d = 0; d < D; ++d) qf[g][d] = to_f32(qr[d]) * a.scale;
        for (int d = 0; d < D; ++d) acc[g][d] = 0.0f;
        m[g] = -3.0e38f;
        l[g] = 0.0f;
    }
    const int32_t *table = a.tables + b * a.table_stride;
    const T *kplane = kv + h * a.plane, *vplane = kv + (a.KV + h) * a.plane;
    for (int p0 = a.first_key(len); p0 < len; p0 += kChunk) {
        const int n = len - p0 < kChunk ? len - p0 : kChunk;
        for (int t = 0; t < n; ++t) {
            slot[t] = slot_of(table, p0 + t, a.bs);
            const T *kr = kplane + slot[t] * D;
            for (int d = 0; d < D; ++d) row[d] = to_f32(kr[d]);
            for (int g = 0; g < G; ++g) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < D; ++d) dot += qf[g][d] * row[d];
                s[g][t] = dot;
            }
        }
        for (int g = 0; g < G; ++g) {
            float mx = m[g];
            for (int t = 0; t < n; ++t) mx = s[g][t] > mx ? s[g][t] : mx;
            const float corr = exp_nonpositive(m[g] - mx);
            float sum = 0.0f;
            for (int t = 0; t < n; ++t) {
                s[g][t] = exp_nonpositive(s[g][t] - mx);
                sum += s[g][t];
            }
            l[g] = l[g] * corr + sum;
            m[g] = mx;
            for (int d = 0; d < D; ++d) acc[g][d] *= corr;
        }
        for (int t = 0; t < n; ++t) {
            const T *vr = vplane + slot[t] * D;
            for (int d = 0; d < D; ++d) row[d] = to_f32(vr[d]);
            for (int g = 0; g < G; ++g) {
                const float w = s[g][t];
#pragma omp simd
                for (int d = 0; d < D; ++d) acc[g][d] += w * row[d];
            }
        }
    }
    for (int g = 0; g < G; ++g) {
        const float inv = 1.0f / l[g];
        T *o = out + (int64_t(b) * a.H + h * G + g) * D;
        for (int d = 0; d < D; ++d) from_f32(acc[g][d] * inv, o + d);
    }
}

#ifdef __AVX512F__
// AVX-512 version for head sizes of NJ * 16 (64 and 128 cover the common models): a row of
// keys or values is NJ registers, scores of 16 keys are one register, so the softmax update is
// a handful of vector instructions per 16 keys.
inline __m512 load16(const float *p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store16(float *p, __m512 v) { _mm512_storeu_ps(p, v); }
inline __m512i bf16_bits16(__m512 v) {  // round to nearest even in the low 16 bits; NaN stays NaN
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}
inline void store16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(p), _mm512_cvtepi32_epi16(bf16_bits16(v)));
}
template <typename T>
inline __m512 round16(__m512 v) {
    if constexpr (sizeof(T) == 4) return v;
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
}

inline __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

template <typename T, int NJ, int G>
void decode_item_avx512(const T *q, const T *kv, T *out, int b, int h, const DecodeArgs &a) {
    const int len = a.lens[b];
    constexpr int D = NJ * 16;
    __m512 qv[G][NJ], acc[G][NJ];
    alignas(64) float s[G][16];
    float m[G], l[G];
    const __m512 scale = _mm512_set1_ps(a.scale);
    for (int g = 0; g < G; ++g) {
        const T *qr = q + b * a.q_stride + int64_t(h * G + g) * D;
        for (int j = 0; j < NJ; ++j) {
            qv[g][j] = _mm512_mul_ps(load16(qr + 16 * j), scale);
            acc[g][j] = _mm512_setzero_ps();
        }
        m[g] = -3.0e38f;
        l[g] = 0.0f;
    }
    const int32_t *table = a.tables + b * a.table_stride;
    const T *kplane = kv + h * a.plane, *vplane = kv + (a.KV + h) * a.plane;
    int64_t slot[16];
    for (int p0 = a.first_key(len); p0 < len; p0 += 16) {
        const int n = len - p0 < 16 ? len - p0 : 16;
        const __mmask16 live = n == 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
        for (int t = 0; t < n; ++t) {
            slot[t] = slot_of(table, p0 + t, a.bs);
            const T *kr = kplane + slot[t] * D;
            __m512 k[NJ];
            for (int j = 0; j < NJ; ++j) k[j] = load16(kr + 16 * j);
            for (int g = 0; g < G; ++g) {
                __m512 d = _mm512_mul_ps(qv[g][0], k[0]);
                for (int j = 1; j < NJ; ++j) d = _mm512_fmadd_ps(qv[g][j], k[j], d);
                s[g][t] = _mm512_reduce_add_ps(d);
            }
        }
        for (int g = 0; g < G; ++g) {
            __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(-3.0e38f), live, s[g]);
            const float mx = std::max(m[g], _mm512_reduce_max_ps(sv));
            const __m512 p = _mm512_maskz_mov_ps(live, exp16_nonpositive(_mm512_sub_ps(sv, _mm512_set1_ps(mx))));
            const float corr = _mm512_cvtss_f32(exp16_nonpositive(_mm512_set1_ps(m[g] - mx)));
            l[g] = l[g] * corr + _mm512_reduce_add_ps(p);
            m[g] = mx;
            _mm512_store_ps(s[g], p);
            if (corr != 1.0f)
                for (int j = 0; j < NJ; ++j) acc[g][j] = _mm512_mul_ps(acc[g][j], _mm512_set1_ps(corr));
        }
        for (int t = 0; t < n; ++t) {
            const T *vr = vplane + slot[t] * D;
            __m512 v[NJ];
            for (int j = 0; j < NJ; ++j) v[j] = load16(vr + 16 * j);
            for (int g = 0; g < G; ++g) {
                const __m512 w = _mm512_set1_ps(s[g][t]);
                for (int j = 0; j < NJ; ++j) acc[g][j] = _mm512_fmadd_ps(w, v[j], acc[g][j]);
            }
        }
    }
    for (int g = 0; g < G; ++g) {
        T *o = out + (int64_t(b) * a.H + h * G + g) * D;
        alignas(64) float tmp[D];
        const __m512 inv = _mm512_set1_ps(1.0f / l[g]);
        for (int j = 0; j < NJ; ++j) _mm512_store_ps(tmp + 16 * j, _mm512_mul_ps(acc[g][j], inv));
        for (int d = 0; d < D; ++d) from_f32(tmp[d], o + d);
    }
}

// The (head size, group size) pairs of common models get a fully unrolled version; others the
// portable one.
template <typename T, int NJ, int... Gs>
DecodeItem<T> pick_group(int G, DecodeItem<T> fallback) {
    DecodeItem<T> f = fallback;
    ((G == Gs ? (f = decode_item_avx512<T, NJ, Gs>, 0) : 0), ...);
    return f;
}

template <typename T>
DecodeItem<T> pick_avx512(int NJ, int G, DecodeItem<T> fallback) {
    if (NJ == 4) return pick_group<T, 4, 1, 2, 3, 4, 5, 6, 7, 8>(G, fallback);
    if (NJ == 8) return pick_group<T, 8, 1, 2, 3, 4, 5, 6, 7, 8>(G, fallback);
    return fallback;
}
#endif

template <typename T>
int decode_attention(const T *q, int64_t q_stride, const T *kv, int64_t plane, const int32_t *tables,
                     int64_t table_stride, const int32_t *lens, T *out, int B, int H, int KV, int D, int bs,
                     float scale, int window) {
    if (B < 0 || KV <= 0 || H % KV || H / KV > kMaxGroup || D <= 0 || D > kMaxHeadDim || bs <= 0) return -1;
    for (int b = 0; b < B; ++b)
        if (lens[b] <= 0) return -2;
    const DecodeArgs a{q_stride, plane, table_stride, tables, lens, H, KV, H / KV, D, bs, scale, window};
    auto item = decode_item_generic<T>;
#ifdef __AVX512F__
    if ((D == 64 || D == 128) && !g_portable_only) item = pick_avx512<T>(D / 16, H / KV, item);
#endif
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < KV; ++h) item(q, kv, out, b, h, a);
    return 0;
}

#ifdef __AVX512F__
template <typename T>
void add_rms_norm_row16(const T *xr, T *rr, const T *w, T *o, int hidden, float eps) {
    __m512 ss = _mm512_setzero_ps();
    const T *src = xr;
    if (rr != nullptr) {
        for (int d = 0; d < hidden; d += 16) {
            const __m512 h = round16<T>(_mm512_add_ps(load16(xr + d), load16(rr + d)));
            store16(rr + d, h);
            ss = _mm512_fmadd_ps(h, h, ss);
        }
        src = rr;
    } else {
        for (int d = 0; d < hidden; d += 16) {
            const __m512 h = load16(xr + d);
            ss = _mm512_fmadd_ps(h, h, ss);
        }
    }
    const __m512 inv = _mm512_set1_ps(1.0f / __builtin_sqrtf(_mm512_reduce_add_ps(ss) / float(hidden) + eps));
    for (int d = 0; d < hidden; d += 16)
        store16(o + d, _mm512_mul_ps(load16(w + d), round16<T>(_mm512_mul_ps(load16(src + d), inv))));
}

template <typename T>
void silu_and_mul_row16(const T *g, const T *u, T *o, int inter) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int d = 0; d < inter; d += 16) {
        const __m512 x = load16(g + d);
        const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 t = exp16_nonpositive(_mm512_mask_blend_ps(neg, _mm512_sub_ps(_mm512_setzero_ps(), x), x));
        const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, t), _mm512_add_ps(one, t));
        store16(o + d, _mm512_mul_ps(round16<T>(_mm512_mul_ps(x, sig)), load16(u + d)));
    }
}
#endif

// RMSNorm, optionally fused with the residual add before it (one pass instead of five ops):
//   residual <- x + residual (when residual is given);  out = w * norm(residual or x)
// Rounded as torch rounds: the sum to T, the normalised value to T, then the product to T.
template <typename T>
void add_rms_norm(const T *x, int64_t x_stride, T *residual, const T *w, T *out, int64_t rows, int hidden,
                  float eps) {
#pragma omp parallel for schedule(static) if (rows * hidden >= (1 << 16))
    for (int64_t r = 0; r < rows; ++r) {
        const T *xr = x + r * x_stride;
        T *o = out + r * hidden;
#ifdef __AVX512F__
        if (hidden % 16 == 0 && !g_portable_only) {
            add_rms_norm_row16(xr, residual == nullptr ? nullptr : residual + r * hidden, w, o, hidden, eps);
            continue;
        }
#endif
        const T *src = xr;
        float ss = 0.0f;
        if (residual != nullptr) {
            T *rr = residual + r * hidden;
#pragma omp simd reduction(+ : ss)
            for (int d = 0; d < hidden; ++d) {
                const float h = round_as<T>(to_f32(xr[d]) + to_f32(rr[d]));
                from_f32(h, rr + d);
                ss += h * h;
            }
            src = rr;
        } else {
#pragma omp simd reduction(+ : ss)
            for (int d = 0; d < hidden; ++d) ss += to_f32(xr[d]) * to_f32(xr[d]);
        }
        const float inv = 1.0f / __builtin_sqrtf(ss / float(hidden) + eps);
#pragma omp simd
        for (int d = 0; d < hidden; ++d) from_f32(to_f32(w[d]) * round_as<T>(to_f32(src[d]) * inv), o + d);
    }
}

// SwiGLU's activation: out = silu(gate) * up for rows laid out [gate | up] (2 * inter wide).
template <typename T>
void silu_and_mul(const T *gate_up, T *out, int64_t rows, int inter) {
#pragma omp parallel for schedule(static) if (rows * inter >= (1 << 15))
    for (int64_t r = 0; r < rows; ++r) {
        const T *g = gate_up + r * 2 * int64_t(inter);
        const T *u = g + inter;
        T *o = out + r * inter;
#ifdef __AVX512F__
        if (inter % 16 == 0 && !g_portable_only) {
            silu_and_mul_row16(g, u, o, inter);
            continue;
        }
#endif
#pragma omp simd
        for (int d = 0; d < inter; ++d) {
            const float x = to_f32(g[d]);
            const float t = exp_nonpositive(x < 0.0f ? x : -x);  // e^-|x|, never overflows
            const float sig = x < 0.0f ? t / (1.0f + t) : 1.0f / (1.0f + t);
            from_f32(round_as<T>(x * sig) * to_f32(u[d]), o + d);
        }
    }
}

// Rotary embedding of the q and k heads of a fused qkv projection, in place, then the step's
// keys and values stored in the paged cache (one pass over qkv instead of eight ops):
//   row i of qkv = [H q heads | KV k heads | KV v heads] of D, at qkv + i * row_stride
//   x <- x * cos + roll(x, D/2) * signed_sin   (tables [positions, D], float32; rotate-half RoPE)
//   k, v -> kv planes (layout as decode_attention) at slots[i]
template <typename T>
void rope_and_store(T *qkv, int64_t n, int64_t row_stride, const int64_t *positions, const float *cos,
                    const float *signed_sin, T *kv, int64_t plane, const int64_t *slots, int H, int KV, int D) {
#pragma omp parallel for schedule(static) if (n * (H + KV) * D >= (1 << 15))
    for (int64_t i = 0; i < n; ++i) {
        T *row = qkv + i * row_stride;
        const float *c = cos + positions[i] * D;
        const float *sn = signed_sin + positions[i] * D;
        const int half = D / 2;
        alignas(64) float x[kMaxHeadDim], cr[kMaxHeadDim], sr[kMaxHeadDim];
        for (int d = 0; d < D; ++d) {
            cr[d] = round_as<T>(c[d]);
            sr[d] = round_as<T>(sn[d]);
        }
        for (int head = 0; head < H + KV; ++head) {
            T *h = row + int64_t(head) * D;
            for (int d = 0; d < D; ++d) x[d] = to_f32(h[d]);
            for (int d = 0; d < D; ++d) {
                const float rot = x[d < half ? d + half : d - half];
                from_f32(round_as<T>(x[d] * cr[d]) + round_as<T>(rot * sr[d]), h + d);
            }
            if (head >= H) std::memcpy(kv + (head - H) * plane + slots[i] * D, h, sizeof(T) * D);
        }
        for (int head = 0; head < KV; ++head)
            std::memcpy(kv + (KV + head) * plane + slots[i] * D, row + int64_t(H + KV + head) * D, sizeof(T) * D);
    }
}


// Multi-LoRA for decode: per adapter segment (its token rows, a slot and a layout), the shrink
//   h[rows, :width] = x[rows] @ at[slot][:, :width]          (width = rank * modules adapted)
// then per adapted module j (bit j of mask, its block the i-th set bit: h's columns i*rank..)
//   y[rows, cols_j] += h[rows, block] @ bt_j[slot][:rank]     (rounded to T, then added, as torch does)
// Each adapter's weights are streamed once for all its rows (a few in decode), in tiles of rows
// that stay in registers; work items are segments (the shrink, reading the slot's A.T whole) then
// (segment, module, 256 output columns), so the threads split the weights between them. Sums run over the inner
// dimension in order.
//   x [*, in] rows at x + row * x_stride;  y [*, sum(outs)] rows at y + row * y_stride
//   rows: the token rows of every segment, segment by segment (nrows of them, each < n)
//   segs: per segment {begin, end (into rows, back to back from 0), slot (< slots), rank, mask}
//   at [slots, in, W] contiguous, W = max_rank * nmod;  bt[j] [slots, max_rank, outs[j]] contiguous
struct LoraArgs {
    int64_t x_stride, y_stride;
    const int64_t *rows;
    const int32_t *segs;
    int in, W, nmod, max_rank;
    int outs[3], cols[3];
};

constexpr int kLoraShrinkRows = 4;  // rows per register tile of the shrink (by up to 4 vectors of columns)
constexpr int kLoraExpandRows = 4;  // rows summed at a time by the expand
constexpr int kLoraExpandCols = 1024;  // output columns of one expand item

inline int block_of(int mask, int j) { return __builtin_popcount(unsigned(mask) & ((1u << j) - 1u)); }

template <typename T>
void lora_shrink_generic(const T *x, const T *at, float *h, const LoraArgs &a, int s, int) {
    const int32_t *g = a.segs + 5 * s;
    const int width = g[3] * __builtin_popcount(unsigned(g[4]));
    const T *as = at + int64_t(g[2]) * a.in * a.W;
    for (int r = g[0]; r < g[1]; ++r) {
        const T *xr = x + a.rows[r] * a.x_stride;
        float *hr = h + int64_t(r) * a.W;
        for (int c = 0; c < width; ++c) hr[c] = 0.0f;
        for (int i = 0; i < a.in; ++i) {
            const float xv = to_f32(xr[i]);
            for (int c = 0; c < width; ++c) hr[c] += xv * to_f32(as[int64_t(i) * a.W + c]);
        }
        for (int c = 0; c < width; ++c) hr[c] = round_as<T>(hr[c]);
    }
}

template <typename T>
void lora_expand_generic(const float *h, const T *const *bt, T *y, const LoraArgs &a, int s, int j, int o0) {
    const int32_t *g = a.segs + 5 * s;
    const int rank = g[3], first = block_of(g[4], j) * rank, out = a.outs[j];
    const int nc = std::min(kLoraExpandCols, out - o0);
    const T *b = bt[j] + int64_t(g[2]) * a.max_rank * out + o0;
    for (int r = g[0]; r < g[1]; ++r) {
        const float *hr = h + int64_t(r) * a.W + first;
        float acc[kLoraExpandCols] = {};
        for (int k = 0; k < rank; ++k)
            for (int c = 0; c < nc; ++c) acc[c] += hr[k] * to_f32(b[int64_t(k) * out + c]);
        T *yr = y + a.rows[r] * a.y_stride + a.cols[j] + o0;
        for (int c = 0; c < nc; ++c) from_f32(to_f32(yr[c]) + round_as<T>(acc[c]), yr + c);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ZS_LORA_AVX512 1
inline __mmask16 lanes(int n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n > 0 ? n : 0)) - 1u); }
inline __m512 load16m(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16m(const uint16_t *p, __mmask16 m) {
    const __m256i v = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline void store16m(float *p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16m(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits16(v)));
}

template <typename T, int R, int NV>
void lora_shrink_tile(const T *x, const T *as, float *h, const LoraArgs &a, int r0, int c0, int width) {
    const T *xr[R];
    __m512 acc[R][NV];
    __mmask16 m[NV];
    for (int v = 0; v < NV; ++v) m[v] = lanes(width - c0 - 16 * v);
    for (int t = 0; t < R; ++t) {
        xr[t] = x + a.rows[r0 + t] * a.x_stride;
        for (int v = 0; v < NV; ++v) acc[t][v] = _mm512_setzero_ps();
    }
    for (int i = 0; i < a.in; ++i) {
        __m512 w[NV];
        for (int v = 0; v < NV; ++v) w[v] = load16m(as + int64_t(i) * a.W + c0 + 16 * v, m[v]);
        for (int t = 0; t < R; ++t) {
            const __m512 xv = _mm512_set1_ps(to_f32(xr[t][i]));
            for (int v = 0; v < NV; ++v) acc[t][v] = _mm512_fmadd_ps(xv, w[v], acc[t][v]);
        }
    }
    for (int t = 0; t < R; ++t)
        for (int v = 0; v < NV; ++v) store16m(h + int64_t(r0 + t) * a.W + c0 + 16 * v, round16<T>(acc[t][v]), m[v]);
}

template <typename T, int NV>
void lora_shrink_cols(const T *x, const T *as, float *h, const LoraArgs &a, int r0, int r1, int c0, int width) {
    for (; r0 < r1; r0 += kLoraShrinkRows) {
        switch (std::min(kLoraShrinkRows, r1 - r0)) {
            case 1: lora_shrink_tile<T, 1, NV>(x, as, h, a, r0, c0, width); break;
            case 2: lora_shrink_tile<T, 2, NV>(x, as, h, a, r0, c0, width); break;
            case 3: lora_shrink_tile<T, 3, NV>(x, as, h, a, r0, c0, width); break;
            default: lora_shrink_tile<T, 4, NV>(x, as, h, a, r0, c0, width); break;
        }
    }
}

// One item per segment: the slot's A.T rows are read whole (width columns, contiguous), in tiles of up to 64
// columns by 4 rows held in registers.
template <typename T>
void lora_shrink_avx512(const T *x, const T *at, float *h, const LoraArgs &a, int s, int) {
    const int32_t *g = a.segs + 5 * s;
    const int width = g[3] * __builtin_popcount(unsigned(g[4]));
    const T *as = at + int64_t(g[2]) * a.in * a.W;
    for (int c0 = 0; c0 < width; c0 += 64) {
        switch (std::min(4, (width - c0 + 15) / 16)) {
            case 1: lora_shrink_cols<T, 1>(x, as, h, a, g[0], g[1], c0, width); break;
            case 2: lora_shrink_cols<T, 2>(x, as, h, a, g[0], g[1], c0, width); break;
            case 3: lora_shrink_cols<T, 3>(x, as, h, a, g[0], g[1], c0, width); break;
            default: lora_shrink_cols<T, 4>(x, as, h, a, g[0], g[1], c0, width); break;
        }
    }
}

// One item is (segment, module, up to 256 output columns): the rank rows of B.T's columns are read
// in order (1 KB runs in fp32), into float sums of up to 8 rows at a time.
template <typename T>
void lora_expand_avx512(const float *h, const T *const *bt, T *y, const LoraArgs &a, int s, int j, int o0) {
    constexpr int V = kLoraExpandCols / 16;
    const int32_t *g = a.segs + 5 * s;
    const int rank = g[3], first = block_of(g[4], j) * rank, out = a.outs[j];
    const T *b = bt[j] + int64_t(g[2]) * a.max_rank * out + o0;
    const int nv = std::min(V, (out - o0 + 15) / 16);
    __mmask16 m[V];
    for (int v = 0; v < nv; ++v) m[v] = lanes(out - o0 - 16 * v);
    alignas(64) float acc[kLoraExpandRows][kLoraExpandCols];
    for (int r0 = g[0]; r0 < g[1]; r0 += kLoraExpandRows) {
        const int R = std::min(kLoraExpandRows, g[1] - r0);
        for (int t = 0; t < R; ++t)
            for (int v = 0; v < nv; ++v) _mm512_store_ps(acc[t] + 16 * v, _mm512_setzero_ps());
        for (int k = 0; k < rank; ++k) {
            const T *bk = b + int64_t(k) * out;
            for (int v = 0; v < nv; ++v) {
                const __m512 w = load16m(bk + 16 * v, m[v]);
                for (int t = 0; t < R; ++t) {
                    const __m512 hv = _mm512_set1_ps(h[int64_t(r0 + t) * a.W + first + k]);
                    _mm512_store_ps(acc[t] + 16 * v, _mm512_fmadd_ps(hv, w, _mm512_load_ps(acc[t] + 16 * v)));
                }
            }
        }
        for (int t = 0; t < R; ++t) {
            T *yr = y + a.rows[r0 + t] * a.y_stride + a.cols[j] + o0;
            for (int v = 0; v < nv; ++v)
                store16m(yr + 16 * v, _mm512_add_ps(load16m(yr + 16 * v, m[v]), round16<T>(_mm512_load_ps(acc[t] + 16 * v))),
                         m[v]);
        }
    }
}
#endif

template <typename T>
int lora_shrink_expand(const T *x, int64_t x_stride, T *y, int64_t y_stride, const int64_t *rows, int64_t nrows,
                       const int32_t *segs, int nseg, const T *at, int in, int W, const T *const *bt,
                       const int32_t *outs, int nmod, int max_rank, int slots, int64_t n) {
    if (nseg < 0 || in <= 0 || nmod < 1 || nmod > 3 || max_rank <= 0 || W != max_rank * nmod) return -1;
    LoraArgs a{x_stride, y_stride, rows, segs, in, W, nmod, max_rank, {0, 0, 0}, {0, 0, 0}};
    for (int j = 0, col = 0; j < nmod; ++j) {
        if (outs[j] <= 0) return -1;
        a.outs[j] = outs[j];
        a.cols[j] = col;
        col += outs[j];
    }
    std::vector<std::pair<int, int>> shrink;
    std::vector<std::array<int, 3>> expand;
    int total = 0;
    for (int s = 0; s < nseg; ++s) {
        const int32_t *g = segs + 5 * s;
        if (g[0] != total || g[1] <= g[0] || g[1] > nrows || g[2] < 0 || g[2] >= slots || g[3] < 1 || g[3] > max_rank ||
            g[4] <= 0 || g[4] >= (1 << nmod))
            return -2;
        for (int r = g[0]; r < g[1]; ++r)
            if (rows[r] < 0 || rows[r] >= n) return -3;
        total = g[1];
        const int width = g[3] * __builtin_popcount(unsigned(g[4]));
        shrink.push_back({s, 0});
        for (int j = 0; j < nmod; ++j)
            if (g[4] >> j & 1)
                for (int o0 = 0; o0 < outs[j]; o0 += kLoraExpandCols) expand.push_back({s, j, o0});
    }
    if (total == 0) return 0;
    std::vector<float> h(size_t(total) * W);
    auto shrink_item = lora_shrink_generic<T>;
    auto expand_item = lora_expand_generic<T>;
#ifdef ZS_LORA_AVX512
    if (!g_portable_only) {
        shrink_item = lora_shrink_avx512<T>;
        expand_item = lora_expand_avx512<T>;
    }
#endif
    const int ns = int(shrink.size()), ne = int(expand.size());
#pragma omp parallel if (int64_t(total) * in * W >= (1 << 14))
    {
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < ns; ++i) shrink_item(x, at, h.data(), a, shrink[i].first, shrink[i].second);
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < ne; ++i) expand_item(h.data(), bt, y, a, expand[i][0], expand[i][1], expand[i][2]);
    }
    return 0;
}

}  // namespace

extern "C" {

#define ZS_ELEMENTWISE(SUFFIX, T)                                                                                  \
    void zs_add_rms_norm_##SUFFIX(const T *x, int64_t x_stride, T *residual, const T *w, T *out, int64_t rows,      \
                                  int hidden, float eps) {                                                         \
        add_rms_norm(x, x_stride, residual, w, out, rows, hidden, eps);                                            \
    }                                                                                                              \
    void zs_silu_and_mul_##SUFFIX(const T *gate_up, T *out, int64_t rows, int inter) {                             \
        silu_and_mul(gate_up, out, rows, inter);                                                                   \
    }                                                                                                              \
    int zs_rope_and_store_##SUFFIX(T *qkv, int64_t n, int64_t row_stride, const int64_t *positions, const float *c, \
                                   const float *s, T *kv, int64_t plane, const int64_t *slots, int H, int KV, int D) { \
        if (D <= 0 || D > kMaxHeadDim || D % 2) return -1;                                                         \
        rope_and_store(qkv, n, row_stride, positions, c, s, kv, plane, slots, H, KV, D);                           \
        return 0;                                                                                                  \
    }

ZS_ELEMENTWISE(f32, float)
ZS_ELEMENTWISE(bf16, uint16_t)

int zs_decode_attention_f32(const float *q, int64_t q_stride, const float *kv, int64_t plane, const int32_t *tables,
                            int64_t table_stride, const int32_t *lens, float *out, int B, int H, int KV, int D,
                            int bs, float scale, int window) {
    return decode_attention(q, q_stride, kv, plane, tables, table_stride, lens, out, B, H, KV, D, bs, scale, window);
}

int zs_decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *kv, int64_t plane,
                             const int32_t *tables, int64_t table_stride, const int32_t *lens, uint16_t *out, int B,
                             int H, int KV, int D, int bs, float scale, int window) {
    return decode_attention(q, q_stride, kv, plane, tables, table_stride, lens, out, B, H, KV, D, bs, scale, window);
}

#define ZS_LORA(SUFFIX, T)                                                                                         \
    int zs_lora_shrink_expand_##SUFFIX(const T *x, int64_t x_stride, T *y, int64_t y_stride, const int64_t *rows,     \
                                       int64_t nrows, const int32_t *segs, int nseg, const T *at, int in, int W,      \
                                       const T *bt0, const T *bt1, const T *bt2, const int32_t *outs, int nmod,       \
                                       int max_rank, int slots, int64_t n) {                                      \
        const T *bt[3] = {bt0, bt1, bt2};                                                                          \
        return lora_shrink_expand(x, x_stride, y, y_stride, rows, nrows, segs, nseg, at, in, W, bt, outs, nmod,     \
                                  max_rank, slots, n);                                                             \
    }

ZS_LORA(f32, float)
ZS_LORA(bf16, uint16_t)

void zs_set_portable_only(int on) { g_portable_only = on != 0; }

int zs_abi_version(void) { return 4; }

}  // extern "C"
