// y = x @ W.T for weights kept quantized, as GGUF files store them: W[n, k] = scale[n, g] * q[n, k] + min[n, g]
// (g = k / G, a group of G consecutive inputs), q a 4-bit or 8-bit integer. Q4_0, Q4_1 and Q4_K map onto the
// 4-bit form exactly, Q5_*, Q6_K and Q8_0 onto the 8-bit one (engine_worker/gguf_quant.py), so the products are the
// dequantized float32 model's up to the order of the sums. x and y are float32 (zs_qgemm_f32), or bf16
// (zs_qgemm_bf16: its section below).
//
// Layout (built once at load by engine_worker/models/quant_linear.py): the output rows in tiles of 16; per tile,
//   4-bit: for each pair of inputs (2p, 2p+1), 16 bytes, byte j = q[16t+j, 2p] | q[16t+j, 2p+1] << 4;
//   8-bit: for each input k, 16 signed bytes, byte j = q[16t+j, k];
//   scale, min: for each group, 16 floats (lane j: row 16t+j); no min array when every min is 0.
// A tile's 16 rows are one AVX-512 vector: the kernel never shuffles.
//
// Every path computes one output the same way, so a row's outputs do not depend on the rows beside it (a decode
// step of 1 or 30 sequences, a prompt chunk, a migrated stream's prompt computed again all give the same numbers):
// per group, s = x[k0] * q[k0] + x[k0 + 1] * q[k0 + 1] + ... as one FMA chain in input order from zero; then
// acc = fma(s, scale, acc) and, with mins, acc = fma(min, xsum, acc), groups in order, where xsum is the row's
// inputs of the group summed in order. (A 16-bit-integer VNNI path was 1e-4 off float32 and no faster on AMD's
// double-pumped AVX-512; a greedy stream moved to another engine then wrote other tokens.)
//
// Few rows (up to 8: a decode step): each tile is read once from memory and its codes become floats in registers
// for all the rows at once; a step's chains are R rows x T tiles (the FMA latency needs about 8). The step is bound
// by the bytes of the weights, a quarter of bf16's for 4-bit.
// Many rows (a prompt chunk, a large decode batch): a pair of tiles' codes becomes floats once, in a per-thread
// buffer, and blocks of 8 rows run over it, so forming is spread over all the rows.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

bool g_qgemm_portable = false;
int g_few_rows = 8;  // rows up to which the codes are formed in registers (the results are the same either way)

struct QArgs {
    const uint8_t *codes;
    const void *scales;  // float32, or float16 where ``half``
    const void *mins;  // may be null
    int64_t N, K;
    int G;
    int bits;  // 4 or 8
    bool half;
    const float *xsum;  // with mins: each row's inputs summed over each group, in order ([rows][K / G])
};

// An IEEE half's value (the portable path; the vectorised ones convert with vcvtph2ps).
inline float half_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            int e = -1;
            uint32_t m = man;
            do {
                m <<= 1;
                ++e;
            } while (!(m & 1024));
            bits = sign | uint32_t(127 - 15 - e) << 23 | (m & 1023) << 13;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else {
        bits = sign | (exp + 127 - 15) << 23 | man << 13;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float scale_at(const void *p, int64_t i, bool half) {
    return half ? half_to_float(static_cast<const uint16_t *>(p)[i]) : static_cast<const float *>(p)[i];
}

inline float input_value(float v) { return v; }

inline float input_value(uint16_t bf16) {
    const uint32_t bits = uint32_t(bf16) << 16;
    float v;
    std::memcpy(&v, &bits, 4);
    return v;
}

// Each row's inputs summed over each group ([M][K / G]), every sum in input order from zero, as every path adds
// the mins. The groups' sums advance together, input by input: one add waits for the last one of its own group
// only, not for every add of the row before it (a chain of K dependent adds cost prefill 3-6% of a matmul).
template <typename X>
std::vector<float> group_sums(const X *x, int64_t x_stride, int64_t M, int64_t K, int G) {
    const int64_t groups = K / G;
    std::vector<float> sums(size_t(M * groups), 0.f);
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t r = 0; r < M; ++r) {
        const X *xr = x + r * x_stride;
        float *out = sums.data() + r * groups;
        for (int i = 0; i < G; ++i)
            for (int64_t g = 0; g < groups; ++g) out[g] += input_value(xr[g * G + i]);
    }
    return sums;
}

inline int64_t tile_code_bytes(const QArgs &a) { return a.bits == 4 ? a.K * 8 : a.K * 16; }

// The codes of tile t as floats, inputs [0, K): q[k * 16 + j] (lane j: row 16t + j).
void form_codes_generic(const QArgs &a, int64_t t, float *q) {
    const uint8_t *c = a.codes + t * tile_code_bytes(a);
    for (int64_t k = 0; k < a.K; ++k)
        for (int j = 0; j < 16; ++j) {
            if (a.bits == 4) {
                const uint8_t b = c[(k / 2) * 16 + j];
                q[k * 16 + j] = float((k & 1) ? b >> 4 : b & 15);
            } else {
                q[k * 16 + j] = float(int8_t(c[k * 16 + j]));
            }
        }
}

// The portable path: every row against tile t, by the definition at the top (std::fma: one rounding, as the
// vector FMAs), so it gives the vectorised paths' numbers.
void tile_rows_generic(const QArgs &a, int64_t t, const float *x, int64_t xs, float *y, int64_t ys, int64_t M,
                       std::vector<float> &buf) {
    buf.resize(size_t(a.K) * 16);
    form_codes_generic(a, t, buf.data());
    const int64_t n0 = t * 16, nn = std::min<int64_t>(16, a.N - n0), groups = a.K / a.G, base = t * groups * 16;
    for (int64_t r = 0; r < M; ++r) {
        float acc[16] = {};
        for (int64_t g = 0; g < groups; ++g) {
            float s[16] = {};
            for (int64_t k = g * a.G; k < (g + 1) * a.G; ++k) {
                const float xv = x[r * xs + k];
                for (int j = 0; j < 16; ++j) s[j] = std::fma(xv, buf[k * 16 + j], s[j]);
            }
            for (int j = 0; j < 16; ++j) {
                acc[j] = std::fma(s[j], scale_at(a.scales, base + g * 16 + j, a.half), acc[j]);
                if (a.mins) acc[j] = std::fma(scale_at(a.mins, base + g * 16 + j, a.half), a.xsum[r * groups + g], acc[j]);
            }
        }
        for (int j = 0; j < nn; ++j) y[r * ys + n0 + j] = acc[j];
    }
}

#ifdef __AVX512F__
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u); }

inline __m512 load_scales(const void *p, int64_t i, bool half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(static_cast<const uint16_t *>(p) + i)))
                : _mm512_loadu_ps(static_cast<const float *>(p) + i);
}

// The end of group g for R rows against the T tiles from t0, the outputs in registers (the few-row kernels): acc =
// fma(s, scale, acc), then, with mins, fma(min, the group's input sum, acc), the order every path keeps.
template <int R, int T>
inline void end_group_few(const QArgs &a, int64_t t0, int64_t g, const __m512 (&s)[R][T], __m512 (&acc)[R][T]) {
    const int64_t groups = a.K / a.G;
    for (int i = 0; i < T; ++i) {
        const int64_t at = (t0 + i) * groups * 16 + g * 16;
        const __m512 sv = load_scales(a.scales, at, a.half);
        for (int r = 0; r < R; ++r) acc[r][i] = _mm512_fmadd_ps(s[r][i], sv, acc[r][i]);
        if (a.mins) {
            const __m512 mv = load_scales(a.mins, at, a.half);
            for (int r = 0; r < R; ++r)
                acc[r][i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.xsum[r * groups + g]), acc[r][i]);
        }
    }
}

// R rows (R <= 8) against T consecutive tiles from t0: R x T chains, each tile's codes read once for all the rows.
template <int R, int T>
void tiles_few_avx512(const QArgs &a, int64_t t0, const float *x, int64_t xs, float *y, int64_t ys) {
    const int64_t groups = a.K / a.G;
    const uint8_t *c[T];
    for (int i = 0; i < T; ++i) c[i] = a.codes + (t0 + i) * tile_code_bytes(a);
    __m512 acc[R][T];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < T; ++i) acc[r][i] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int64_t g = 0; g < groups; ++g) {
        __m512 s[R][T];
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < T; ++i) s[r][i] = _mm512_setzero_ps();
        const int64_t k0 = g * a.G;
        if (a.bits == 4) {
            for (int64_t k = k0; k < k0 + a.G; k += 2) {
#pragma GCC unroll 8
                for (int i = 0; i < T; ++i) {
                    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c[i] + (k / 2) * 16)));
                    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_and_si512(b, low4));
                    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
                    for (int r = 0; r < R; ++r) {
                        s[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + k]), q0, s[r][i]);
                        s[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + k + 1]), q1, s[r][i]);
                    }
                }
            }
        } else {
            for (int64_t k = k0; k < k0 + a.G; ++k) {
#pragma GCC unroll 8
                for (int i = 0; i < T; ++i) {
                    const __m512 q = _mm512_cvtepi32_ps(
                        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c[i] + k * 16))));
                    for (int r = 0; r < R; ++r) s[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + k]), q, s[r][i]);
                }
            }
        }
        end_group_few<R, T>(a, t0, g, s, acc);
    }
    for (int i = 0; i < T; ++i) {
        const __mmask16 mask = tail_mask(a.N - (t0 + i) * 16);
        for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ys + (t0 + i) * 16, mask, acc[r][i]);
    }
}

// Few rows: the tiles split evenly between the threads, each thread's run in blocks of T.
template <int R>
void few_rows(const QArgs &a, int64_t tiles, const float *x, int64_t xs, float *y, int64_t ys) {
    constexpr int T = R <= 2 ? 4 : R <= 4 ? 2 : 1;
#pragma omp parallel if (tiles * a.K * R >= (1 << 15))
    {
        const int64_t n = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t hi = tiles * (id + 1) / n;
        int64_t t = tiles * id / n;
        for (; t + T <= hi; t += T) tiles_few_avx512<R, T>(a, t, x, xs, y, ys);
        for (; t < hi; ++t) tiles_few_avx512<R, 1>(a, t, x, xs, y, ys);
    }
}

void form_codes_avx512(const QArgs &a, int64_t t, float *q) {
    const uint8_t *c = a.codes + t * tile_code_bytes(a);
    if (a.bits == 4) {
        const __m512i low4 = _mm512_set1_epi32(15);
        for (int64_t k = 0; k < a.K; k += 2) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + (k / 2) * 16)));
            _mm512_storeu_ps(q + k * 16, _mm512_cvtepi32_ps(_mm512_and_si512(b, low4)));
            _mm512_storeu_ps(q + (k + 1) * 16, _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)));
        }
    } else {
        for (int64_t k = 0; k < a.K; ++k)
            _mm512_storeu_ps(q + k * 16,
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + k * 16)))));
    }
}

// The end of group g for R rows against two tiles (the second absent where !two), their outputs waiting in acc:
// acc = fma(s, scale, acc), then, with mins, fma(min, the group's input sum, acc): the order every path keeps.
template <int R>
inline void end_group(const QArgs &a, const __m512 (&s0)[R], const __m512 (&s1)[R], bool two, int64_t b0,
                      int64_t b1, int64_t g, const float *xsum, float (&acc)[R][2][16]) {
    const int64_t groups = a.K / a.G;
    const __m512 sv0 = load_scales(a.scales, b0 + g * 16, a.half);
    const __m512 sv1 = two ? load_scales(a.scales, b1 + g * 16, a.half) : sv0;
    const __m512 mv0 = a.mins ? load_scales(a.mins, b0 + g * 16, a.half) : sv0;
    const __m512 mv1 = a.mins && two ? load_scales(a.mins, b1 + g * 16, a.half) : sv0;
    for (int r = 0; r < R; ++r) {
        __m512 a0 = _mm512_fmadd_ps(s0[r], sv0, _mm512_load_ps(acc[r][0]));
        if (a.mins) a0 = _mm512_fmadd_ps(mv0, _mm512_set1_ps(xsum[r * groups + g]), a0);
        _mm512_store_ps(acc[r][0], a0);
        if (two) {
            __m512 a1 = _mm512_fmadd_ps(s1[r], sv1, _mm512_load_ps(acc[r][1]));
            if (a.mins) a1 = _mm512_fmadd_ps(mv1, _mm512_set1_ps(xsum[r * groups + g]), a1);
            _mm512_store_ps(acc[r][1], a1);
        }
    }
}

// Rows [0, R) (R <= 8) of x against tiles t0 (codes q0) and t0 + 1 (q1, null for a lone last tile). The group sums
// fill the registers (2R); the outputs wait in the L1 cache between groups.
template <int R>
void rows_two_tiles(const QArgs &a, const float *q0, const float *q1, int64_t t0, const float *x, int64_t xs,
                    const float *xsum, float *y, int64_t ys) {
    const int64_t groups = a.K / a.G, b0 = t0 * groups * 16, b1 = b0 + groups * 16;
    alignas(64) float acc[R][2][16] = {};
    for (int64_t g = 0; g < groups; ++g) {
        __m512 s0[R], s1[R];
        for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
        const int64_t k0 = g * a.G;
        if (q1) {
            for (int64_t k = k0; k < k0 + a.G; ++k) {
                const __m512 v0 = _mm512_loadu_ps(q0 + k * 16), v1 = _mm512_loadu_ps(q1 + k * 16);
                for (int r = 0; r < R; ++r) {
                    const __m512 xv = _mm512_set1_ps(x[r * xs + k]);
                    s0[r] = _mm512_fmadd_ps(xv, v0, s0[r]);
                    s1[r] = _mm512_fmadd_ps(xv, v1, s1[r]);
                }
            }
        } else {
            for (int64_t k = k0; k < k0 + a.G; ++k) {
                const __m512 v0 = _mm512_loadu_ps(q0 + k * 16);
                for (int r = 0; r < R; ++r) s0[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + k]), v0, s0[r]);
            }
        }
        end_group<R>(a, s0, s1, q1 != nullptr, b0, b1, g, xsum, acc);
    }
    const __mmask16 mask0 = tail_mask(a.N - t0 * 16), mask1 = q1 ? tail_mask(a.N - t0 * 16 - 16) : 0;
    for (int r = 0; r < R; ++r) {
        _mm512_mask_storeu_ps(y + r * ys + t0 * 16, mask0, _mm512_load_ps(acc[r][0]));
        if (q1) _mm512_mask_storeu_ps(y + r * ys + t0 * 16 + 16, mask1, _mm512_load_ps(acc[r][1]));
    }
}

void many_rows(const QArgs &a, int64_t tiles, const float *x, int64_t xs, float *y, int64_t ys, int64_t M) {
    // Rows in chunks, so that a chunk of x stays in the caches while every tile pair runs over it (forming a pair
    // again per chunk costs K * 32 per 256 rows).
    constexpr int64_t kRowChunk = 256;
    const int64_t pairs = (tiles + 1) / 2, chunks = (M + kRowChunk - 1) / kRowChunk, groups = a.K / a.G;
#pragma omp parallel
    {
        std::vector<float> buf(size_t(a.K) * 32);
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t c = 0; c < chunks; ++c)
            for (int64_t p = 0; p < pairs; ++p) {
                const int64_t r0 = c * kRowChunk, rows = std::min(kRowChunk, M - r0), t0 = 2 * p;
                const bool two = t0 + 1 < tiles;
                float *q0 = buf.data(), *q1 = two ? buf.data() + a.K * 16 : nullptr;
                form_codes_avx512(a, t0, q0);
                if (two) form_codes_avx512(a, t0 + 1, q1);
                int64_t r = r0;
                auto block = [&](auto rows_fn) {
                    rows_fn(a, q0, q1, t0, x + r * xs, xs, a.xsum ? a.xsum + r * groups : nullptr, y + r * ys, ys);
                };
                for (; r + 8 <= r0 + rows; r += 8) block(rows_two_tiles<8>);
                switch (r0 + rows - r) {
                    case 7: block(rows_two_tiles<7>); break;
                    case 6: block(rows_two_tiles<6>); break;
                    case 5: block(rows_two_tiles<5>); break;
                    case 4: block(rows_two_tiles<4>); break;
                    case 3: block(rows_two_tiles<3>); break;
                    case 2: block(rows_two_tiles<2>); break;
                    case 1: block(rows_two_tiles<1>); break;
                    default: break;
                }
            }
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
// bf16 inputs (--dtype auto on a CPU with native bf16, or --dtype bfloat16): the codes become bf16, exactly (4-bit
// and 8-bit integers are), and vdpbf16ps multiplies an input pair by a code pair and adds both products per lane, 32
// products an instruction. The group's scale and min apply in float32, in the float32 path's order: per group
// s = the vdpbf16ps chain over the group's input pairs in order from zero, then acc = fma(s, scale, acc) and, with
// mins, acc = fma(min, xsum, acc). Only the inputs are rounded to bf16, not the weights (the dequantized bf16 model
// rounds both), and every path computes each output so, so a row's numbers do not depend on the rows beside it.

// 32 bf16s, entry i = bf16(i & 15): vpermw reads the low 5 bits of each index.
inline __m512i nibble_bf16_table() {
    alignas(64) static const uint16_t t[32] = {
        0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140,
        0x4150, 0x4160, 0x4170, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110,
        0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
    return _mm512_load_si512(t);
}

// Tile codes for inputs 2p and 2p + 1 as a bf16 pair per lane: bf16(q[2p][j]) | bf16(q[2p + 1][j]) << 16.
inline __m512i codes_pair_bf16(const QArgs &a, const uint8_t *c, int64_t p, __m512i table) {
    if (a.bits == 4) {  // byte j = lo | hi << 4: the low word indexes by lo (+ a bit the table ignores), the high by hi
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + p * 16)));
        return _mm512_permutexvar_epi16(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), table);
    }
    // 8-bit: a small integer's float has a bf16's bits in its top half
    const __m512i q0 = _mm512_castps_si512(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 2 * p * 16)))));
    const __m512i q1 = _mm512_castps_si512(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + (2 * p + 1) * 16)))));
    return _mm512_mask_blend_epi16(__mmask32(0xaaaaaaaau), _mm512_srli_epi32(q0, 16), q1);
}

inline __m512 pair_of(const uint16_t *x) {
    int32_t xp;
    std::memcpy(&xp, x, 4);
    return _mm512_castsi512_ps(_mm512_set1_epi32(xp));
}

inline void store_bf16(uint16_t *y, __mmask16 mask, __m512 v) {
    _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// R rows (R <= 8) of bf16 inputs against T consecutive tiles from t0, the codes formed in registers.
template <int R, int T>
void tiles_few_bf16(const QArgs &a, int64_t t0, const uint16_t *x, int64_t xs, uint16_t *y, int64_t ys) {
    const int64_t groups = a.K / a.G, half = a.G / 2;
    const __m512i table = nibble_bf16_table();
    const uint8_t *c[T];
    for (int i = 0; i < T; ++i) c[i] = a.codes + (t0 + i) * tile_code_bytes(a);
    __m512 acc[R][T];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < T; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512 s[R][T];
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < T; ++i) s[r][i] = _mm512_setzero_ps();
        for (int64_t p = g * half; p < (g + 1) * half; ++p) {
            __m512 xv[R];
            for (int r = 0; r < R; ++r) xv[r] = pair_of(x + r * xs + 2 * p);
#pragma GCC unroll 8
            for (int i = 0; i < T; ++i) {
                const __m512bh w = (__m512bh)codes_pair_bf16(a, c[i], p, table);
                for (int r = 0; r < R; ++r) s[r][i] = _mm512_dpbf16_ps(s[r][i], w, (__m512bh)xv[r]);
            }
        }
        end_group_few<R, T>(a, t0, g, s, acc);
    }
    for (int i = 0; i < T; ++i) {
        const __mmask16 mask = tail_mask(a.N - (t0 + i) * 16);
        for (int r = 0; r < R; ++r) store_bf16(y + r * ys + (t0 + i) * 16, mask, acc[r][i]);
    }
}

template <int R>
void few_rows_bf16(const QArgs &a, int64_t tiles, const uint16_t *x, int64_t xs, uint16_t *y, int64_t ys) {
    constexpr int T = R <= 2 ? 4 : R <= 4 ? 2 : 1;
#pragma omp parallel if (tiles * a.K * R >= (1 << 15))
    {
        const int64_t n = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t hi = tiles * (id + 1) / n;
        int64_t t = tiles * id / n;
        for (; t + T <= hi; t += T) tiles_few_bf16<R, T>(a, t, x, xs, y, ys);
        for (; t < hi; ++t) tiles_few_bf16<R, 1>(a, t, x, xs, y, ys);
    }
}

// Tile t's code pairs into w[p * 16 + j] (K / 2 pairs of 16 lanes).
void form_tile_bf16(const QArgs &a, int64_t t, int32_t *w) {
    const uint8_t *c = a.codes + t * tile_code_bytes(a);
    const __m512i table = nibble_bf16_table();
    for (int64_t p = 0; p < a.K / 2; ++p) _mm512_storeu_si512(w + p * 16, codes_pair_bf16(a, c, p, table));
}

// Rows [0, R) (R <= 8) against tiles t0 (pairs w0) and t0 + 1 (w1, null for a lone last tile); the outputs wait in
// the L1 cache between groups, as on the float32 path.
template <int R>
void rows_two_tiles_bf16(const QArgs &a, const int32_t *w0, const int32_t *w1, int64_t t0, const uint16_t *x,
                         int64_t xs, const float *xsum, uint16_t *y, int64_t ys) {
    const int64_t groups = a.K / a.G, half = a.G / 2, b0 = t0 * groups * 16, b1 = b0 + groups * 16;
    alignas(64) float acc[R][2][16] = {};
    for (int64_t g = 0; g < groups; ++g) {
        __m512 s0[R], s1[R];
        for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
        if (w1) {
            for (int64_t p = g * half; p < (g + 1) * half; ++p) {
                const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + p * 16);
                const __m512bh v1 = (__m512bh)_mm512_loadu_si512(w1 + p * 16);
                for (int r = 0; r < R; ++r) {
                    const __m512bh xv = (__m512bh)pair_of(x + r * xs + 2 * p);
                    s0[r] = _mm512_dpbf16_ps(s0[r], v0, xv);
                    s1[r] = _mm512_dpbf16_ps(s1[r], v1, xv);
                }
            }
        } else {
            for (int64_t p = g * half; p < (g + 1) * half; ++p) {
                const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + p * 16);
                for (int r = 0; r < R; ++r) s0[r] = _mm512_dpbf16_ps(s0[r], v0, (__m512bh)pair_of(x + r * xs + 2 * p));
            }
        }
        end_group<R>(a, s0, s1, w1 != nullptr, b0, b1, g, xsum, acc);
    }
    const __mmask16 mask0 = tail_mask(a.N - t0 * 16), mask1 = w1 ? tail_mask(a.N - t0 * 16 - 16) : 0;
    for (int r = 0; r < R; ++r) {
        store_bf16(y + r * ys + t0 * 16, mask0, _mm512_load_ps(acc[r][0]));
        if (w1) store_bf16(y + r * ys + t0 * 16 + 16, mask1, _mm512_load_ps(acc[r][1]));
    }
}

void many_rows_bf16(const QArgs &a, int64_t tiles, const uint16_t *x, int64_t xs, uint16_t *y, int64_t ys,
                    int64_t M) {
    constexpr int64_t kRowChunk = 256;
    const int64_t pairs = (tiles + 1) / 2, chunks = (M + kRowChunk - 1) / kRowChunk, groups = a.K / a.G;
#pragma omp parallel
    {
        std::vector<int32_t> buf(size_t(a.K) * 16);  // two tiles of K / 2 pairs of 16 lanes
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t c = 0; c < chunks; ++c)
            for (int64_t p = 0; p < pairs; ++p) {
                const int64_t r0 = c * kRowChunk, rows = std::min(kRowChunk, M - r0), t0 = 2 * p;
                const bool two = t0 + 1 < tiles;
                int32_t *w0 = buf.data(), *w1 = two ? buf.data() + a.K * 8 : nullptr;
                form_tile_bf16(a, t0, w0);
                if (two) form_tile_bf16(a, t0 + 1, w1);
                int64_t r = r0;
                auto block = [&](auto fn) {
                    fn(a, w0, w1, t0, x + r * xs, xs, a.xsum ? a.xsum + r * groups : nullptr, y + r * ys, ys);
                };
                for (; r + 8 <= r0 + rows; r += 8) block(rows_two_tiles_bf16<8>);
                switch (r0 + rows - r) {
                    case 7: block(rows_two_tiles_bf16<7>); break;
                    case 6: block(rows_two_tiles_bf16<6>); break;
                    case 5: block(rows_two_tiles_bf16<5>); break;
                    case 4: block(rows_two_tiles_bf16<4>); break;
                    case 3: block(rows_two_tiles_bf16<3>); break;
                    case 2: block(rows_two_tiles_bf16<2>); break;
                    case 1: block(rows_two_tiles_bf16<1>); break;
                    default: break;
                }
            }
    }
}
#endif

}  // namespace

extern "C" {

// Returns 0, or a negative number for arguments it cannot take.
int zs_qgemm_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride, int64_t M, const uint8_t *codes,
                 const void *scales, const void *mins, int half, int64_t N, int64_t K, int G, int bits) {
    if (M < 0 || N <= 0 || K <= 0 || G <= 0 || K % G || (bits != 4 && bits != 8) || (bits == 4 && G % 2))
        return -1;
    if (M == 0) return 0;
    QArgs a{codes, scales, mins, N, K, G, bits, half != 0, nullptr};
    std::vector<float> xsum;
    if (mins) {
        xsum = group_sums(x, x_stride, M, K, G);
        a.xsum = xsum.data();
    }
    const int64_t tiles = (N + 15) / 16;
#ifdef __AVX512F__
    if (!g_qgemm_portable && G % 8 == 0) {  // (GGUF's groups are 16 or 32)
        if (M <= g_few_rows) {
            switch (M) {
                case 1: few_rows<1>(a, tiles, x, x_stride, y, y_stride); break;
                case 2: few_rows<2>(a, tiles, x, x_stride, y, y_stride); break;
                case 3: few_rows<3>(a, tiles, x, x_stride, y, y_stride); break;
                case 4: few_rows<4>(a, tiles, x, x_stride, y, y_stride); break;
                case 5: few_rows<5>(a, tiles, x, x_stride, y, y_stride); break;
                case 6: few_rows<6>(a, tiles, x, x_stride, y, y_stride); break;
                case 7: few_rows<7>(a, tiles, x, x_stride, y, y_stride); break;
                default: few_rows<8>(a, tiles, x, x_stride, y, y_stride); break;
            }
        } else {
            many_rows(a, tiles, x, x_stride, y, y_stride, M);
        }
        return 0;
    }
#endif
#pragma omp parallel
    {
        std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tiles; ++t) tile_rows_generic(a, t, x, x_stride, y, y_stride, M, buf);
    }
    return 0;
}

// The same for bf16 inputs and outputs (uint16_t bit patterns). Returns 0; -2 where this CPU or build has no bf16
// kernel (the caller takes the float32 one); -1 for arguments it cannot take.
int zs_qgemm_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, int64_t M,
                  const uint8_t *codes, const void *scales, const void *mins, int half, int64_t N, int64_t K, int G,
                  int bits) {
    if (M < 0 || N <= 0 || K <= 0 || G <= 0 || K % G || (bits != 4 && bits != 8) || G % 8) return -1;
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (g_qgemm_portable) return -2;
    if (M == 0) return 0;
    QArgs a{codes, scales, mins, N, K, G, bits, half != 0, nullptr};
    const int64_t tiles = (N + 15) / 16;
    std::vector<float> xsum;
    if (mins) {
        xsum = group_sums(x, x_stride, M, K, G);
        a.xsum = xsum.data();
    }
    switch (M <= g_few_rows ? M : 0) {
        case 1: few_rows_bf16<1>(a, tiles, x, x_stride, y, y_stride); break;
        case 2: few_rows_bf16<2>(a, tiles, x, x_stride, y, y_stride); break;
        case 3: few_rows_bf16<3>(a, tiles, x, x_stride, y, y_stride); break;
        case 4: few_rows_bf16<4>(a, tiles, x, x_stride, y, y_stride); break;
        case 5: few_rows_bf16<5>(a, tiles, x, x_stride, y, y_stride); break;
        case 6: few_rows_bf16<6>(a, tiles, x, x_stride, y, y_stride); break;
        case 7: few_rows_bf16<7>(a, tiles, x, x_stride, y, y_stride); break;
        case 8: few_rows_bf16<8>(a, tiles, x, x_stride, y, y_stride); break;
        default: many_rows_bf16(a, tiles, x, x_stride, y, y_stride, M); break;
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)y; (void)y_stride; (void)codes; (void)scales; (void)mins; (void)half;
    return -2;
#endif
}

void zs_qgemm_set_portable(int on) { g_qgemm_portable = on != 0; }

void zs_qgemm_set_few_rows(int n) { g_few_rows = std::clamp(n, 0, 8); }

}  // extern "C"
