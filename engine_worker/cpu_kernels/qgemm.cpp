// y = x @ W.T for weights kept quantized, as GGUF files store them: W[n, k] = scale[n, g] * q[n, k] + min[n, g]
// (g = k / G, a group of G consecutive inputs), q a 4-bit or 8-bit integer. Q4_0, Q4_1 and Q4_K map onto the
// 4-bit form exactly, Q5_*, Q6_K and Q8_0 onto the 8-bit one (engine_worker/gguf_quant.py), so the products are the
// dequantized float32 model's up to the order of the sums. x and y are float32.
//
// Layout (built once at load by engine_worker/models/quant_linear.py): the output rows in tiles of 16; per tile,
//   4-bit: for each pair of inputs (2p, 2p+1), 16 bytes, byte j = q[16t+j, 2p] | q[16t+j, 2p+1] << 4;
//   8-bit: for each input k, 16 signed bytes, byte j = q[16t+j, k];
//   scale, min: for each group, 16 floats (lane j: row 16t+j); no min array when every min is 0.
// A tile's 16 rows are one AVX-512 vector: the kernel never shuffles.
//
// Few rows (up to 8: a decode step): each tile is read once from memory and its weights are formed in registers for
// all the rows at once, in float32; the step is bound by the bytes of the weights, a quarter of bf16's for 4-bit.
// Many rows (a prompt chunk, a large decode batch): with AVX512-VNNI, the inputs become 16-bit integers per group and
// a pair of tiles 16-bit code pairs, and vpdpwssd sums 32 products an instruction (``many_rows_vnni``: within 1e-4
// of float32, far finer than bf16); without it, a pair of tiles is formed into float32 once, into a per-thread
// buffer, and blocks of 8 rows run an FMA micro-kernel over it. Either way the cost of forming the weights is spread
// over all the rows; both are compute-bound, at 0.6-0.9x oneDNN's bf16 matmul on this kind of CPU.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

bool g_qgemm_portable = false;
bool g_qgemm_float = false;  // many rows in float32 FMAs even where VNNI is there (for tests and the benchmark)
int g_few_rows = 8;  // rows up to which the weights are formed in registers (measured: faster than VNNI up to 8)

struct QArgs {
    const uint8_t *codes;
    const void *scales;  // float32, or float16 where ``half``
    const void *mins;  // may be null
    int64_t N, K;
    int G;
    int bits;  // 4 or 8
    bool half;
    const float *xsum;  // with mins, few rows: each row's sum over each group ([rows][K / G])
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

inline int64_t tile_code_bytes(const QArgs &a) { return a.bits == 4 ? a.K * 8 : a.K * 16; }

// The float32 weights of tile t, inputs [0, K), as w[k * 16 + j].
void form_tile_generic(const QArgs &a, int64_t t, float *w) {
    const uint8_t *c = a.codes + t * tile_code_bytes(a);
    const int64_t groups = a.K / a.G, base = t * groups * 16;
    for (int64_t k = 0; k < a.K; ++k) {
        const int64_t g = k / a.G;
        for (int j = 0; j < 16; ++j) {
            float q;
            if (a.bits == 4) {
                const uint8_t b = c[(k / 2) * 16 + j];
                q = float((k & 1) ? b >> 4 : b & 15);
            } else {
                q = float(int8_t(c[k * 16 + j]));
            }
            const int64_t at = base + g * 16 + j;
            const float sc = scale_at(a.scales, at, a.half);
            w[k * 16 + j] = a.mins ? q * sc + scale_at(a.mins, at, a.half) : q * sc;
        }
    }
}

void tile_rows_generic(const QArgs &a, int64_t t, const float *x, int64_t xs, float *y, int64_t ys, int64_t M,
                       std::vector<float> &buf) {
    buf.resize(size_t(a.K) * 16);
    form_tile_generic(a, t, buf.data());
    const int64_t n0 = t * 16, nn = std::min<int64_t>(16, a.N - n0);
    for (int64_t r = 0; r < M; ++r) {
        float acc[16] = {};
        for (int64_t k = 0; k < a.K; ++k) {
            const float xv = x[r * xs + k];
            for (int j = 0; j < 16; ++j) acc[j] += xv * buf[k * 16 + j];
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

// Up to R rows (R <= 8) against tile t: per group, sum x * q over independent chains (an FMA's latency would bound a
// single chain), then scale the group's sum once, and add min * the group's input sum.
template <int R>
void tile_few_avx512(const QArgs &a, int64_t t, const float *x, int64_t xs, float *y, int64_t ys) {
    constexpr int C = R <= 2 ? 4 : R <= 4 ? 2 : 1;
    const uint8_t *c = a.codes + t * tile_code_bytes(a);
    const int64_t groups = a.K / a.G, base = t * groups * 16;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int64_t g = 0; g < groups; ++g) {
        __m512 ga[R][C];
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < C; ++i) ga[r][i] = _mm512_setzero_ps();
        const int64_t k0 = g * a.G;
        // (The chain of each step is a constant after unrolling: an index known only at run time would keep the
        // chains in memory instead of registers.)
        if (a.bits == 4) {
            for (int64_t k = k0; k < k0 + a.G; k += 2 * C) {
#pragma GCC unroll 4
                for (int i = 0; i < C; ++i) {
                    const int64_t kk = k + 2 * i;
                    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + (kk / 2) * 16)));
                    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_and_si512(b, low4));
                    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
                    for (int r = 0; r < R; ++r) {
                        ga[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + kk]), q0, ga[r][i]);
                        ga[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + kk + 1]), q1, ga[r][i]);
                    }
                }
            }
        } else {
            for (int64_t k = k0; k < k0 + a.G; k += C) {
#pragma GCC unroll 4
                for (int i = 0; i < C; ++i) {
                    const __m512 q = _mm512_cvtepi32_ps(
                        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + (k + i) * 16))));
                    for (int r = 0; r < R; ++r)
                        ga[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + k + i]), q, ga[r][i]);
                }
            }
        }
        const __m512 sv = load_scales(a.scales, base + g * 16, a.half);
        const __m512 mv = a.mins ? load_scales(a.mins, base + g * 16, a.half) : _mm512_setzero_ps();
        for (int r = 0; r < R; ++r) {
            __m512 sum = ga[r][0];
            for (int i = 1; i < C; ++i) sum = _mm512_add_ps(sum, ga[r][i]);
            acc[r] = _mm512_fmadd_ps(sum, sv, acc[r]);
            if (a.mins) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.xsum[r * groups + g]), acc[r]);
        }
    }
    const __mmask16 mask = tail_mask(a.N - t * 16);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ys + t * 16, mask, acc[r]);
}

void form_tile_avx512(const QArgs &a, int64_t t, float *w) {
    const uint8_t *c = a.codes + t * tile_code_bytes(a);
    const int64_t groups = a.K / a.G, base = t * groups * 16;
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int64_t g = 0; g < groups; ++g) {
        const __m512 sv = load_scales(a.scales, base + g * 16, a.half);
        const __m512 mv = a.mins ? load_scales(a.mins, base + g * 16, a.half) : _mm512_setzero_ps();
        const int64_t k0 = g * a.G;
        if (a.bits == 4) {
            for (int64_t k = k0; k < k0 + a.G; k += 2) {
                const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + (k / 2) * 16)));
                _mm512_storeu_ps(w + k * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low4)), sv, mv));
                _mm512_storeu_ps(w + (k + 1) * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), sv, mv));
            }
        } else {
            for (int64_t k = k0; k < k0 + a.G; ++k) {
                const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + k * 16)));
                _mm512_storeu_ps(w + k * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), sv, mv));
            }
        }
    }
}

// Rows [r0, r0 + R) (R <= 8) against two formed tiles (w0, w1: [K][16] each; w1 may be null for a lone last tile).
template <int R>
void rows_two_tiles(const float *w0, const float *w1, int64_t K, const float *x, int64_t xs, float *y, int64_t ys,
                    int64_t n0, __mmask16 mask0, __mmask16 mask1) {
    __m512 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    if (w1) {
        for (int64_t k = 0; k < K; ++k) {
            const __m512 v0 = _mm512_loadu_ps(w0 + k * 16), v1 = _mm512_loadu_ps(w1 + k * 16);
            for (int r = 0; r < R; ++r) {
                const __m512 xv = _mm512_set1_ps(x[r * xs + k]);
                a0[r] = _mm512_fmadd_ps(xv, v0, a0[r]);
                a1[r] = _mm512_fmadd_ps(xv, v1, a1[r]);
            }
        }
    } else {
        for (int64_t k = 0; k < K; ++k) {
            const __m512 v0 = _mm512_loadu_ps(w0 + k * 16);
            for (int r = 0; r < R; ++r) a0[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + k]), v0, a0[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm512_mask_storeu_ps(y + r * ys + n0, mask0, a0[r]);
        if (w1) _mm512_mask_storeu_ps(y + r * ys + n0 + 16, mask1, a1[r]);
    }
}

#ifdef __AVX512VNNI__
// Many rows with VNNI: each row's inputs become 16-bit integers per group (step = the group's largest magnitude /
// 32767, far finer than bf16's 8 bits), the weights' codes 16-bit pairs, and vpdpwssd sums 32 products an
// instruction, twice float32 FMA's rate, exactly in int32; each group's sum is scaled once per row and tile.
struct QuantRows {
    std::vector<int16_t> q;  // [M][K]
    std::vector<float> step, sum;  // [M][groups]: the step, and the float32 sum of the group's inputs (for mins)
};

void quantize_rows(const float *x, int64_t xs, int64_t M, int64_t K, int G, QuantRows &out) {
    const int64_t groups = K / G;
    out.q.resize(size_t(M * K));
    out.step.resize(size_t(M * groups));
    out.sum.resize(size_t(M * groups));
#pragma omp parallel for schedule(static) if (M * K >= (1 << 14))
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t g = 0; g < groups; ++g) {
            const float *xg = x + m * xs + g * G;
            float top = 0.f, sum = 0.f;
            for (int i = 0; i < G; ++i) {
                top = std::max(top, std::abs(xg[i]));
                sum += xg[i];
            }
            const float inv = top > 0.f ? 32767.f / top : 0.f;
            int16_t *qg = out.q.data() + m * K + g * G;
            for (int i = 0; i < G; ++i) qg[i] = int16_t(std::nearbyint(xg[i] * inv));
            out.step[m * groups + g] = top / 32767.f;
            out.sum[m * groups + g] = sum;
        }
    }
}

// Tile t's codes as 16-bit pairs: word p of lane j = q[16t + j, 2p] | q[16t + j, 2p + 1] << 16.
void form_pairs(const QArgs &a, int64_t t, int32_t *w) {
    const uint8_t *c = a.codes + t * tile_code_bytes(a);
    for (int64_t p = 0; p < a.K / 2; ++p) {
        __m512i word;
        if (a.bits == 4) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + p * 16)));
            word = _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32(15)),
                                   _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0xF0)), 12));
        } else {
            const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 2 * p * 16)));
            const __m512i hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + (2 * p + 1) * 16)));
            word = _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(hi, 16));
        }
        _mm512_storeu_si512(w + p * 16, word);
    }
}

// Rows [0, R) of ``xr`` (R <= 6) against tiles t0 (pairs w0) and t0 + 1 (w1, null for a lone last tile).
template <int R>
void rows_pairs(const QArgs &a, const QuantRows &xr, int64_t r0, const int32_t *w0, const int32_t *w1, int64_t t0,
                float *y, int64_t ys) {
    const int64_t groups = a.K / a.G, half = a.G / 2, b0 = t0 * groups * 16, b1 = b0 + groups * 16;
    const bool mins = a.mins != nullptr;
    __m512 f0[R], f1[R];
    for (int r = 0; r < R; ++r) f0[r] = f1[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512i i0[R], i1[R];
        for (int r = 0; r < R; ++r) i0[r] = i1[r] = _mm512_setzero_si512();
        const int32_t *xq[R];
        for (int r = 0; r < R; ++r) xq[r] = (const int32_t *)(xr.q.data() + (r0 + r) * a.K + g * a.G);
        const int32_t *g0 = w0 + g * half * 16, *g1 = w1 ? w1 + g * half * 16 : nullptr;
        for (int64_t p = 0; p < half; ++p) {
            const __m512i v0 = _mm512_loadu_si512(g0 + p * 16);
            if (g1) {
                const __m512i v1 = _mm512_loadu_si512(g1 + p * 16);
                for (int r = 0; r < R; ++r) {
                    const __m512i xb = _mm512_set1_epi32(xq[r][p]);
                    i0[r] = _mm512_dpwssd_epi32(i0[r], v0, xb);
                    i1[r] = _mm512_dpwssd_epi32(i1[r], v1, xb);
                }
            } else {
                for (int r = 0; r < R; ++r) i0[r] = _mm512_dpwssd_epi32(i0[r], v0, _mm512_set1_epi32(xq[r][p]));
            }
        }
        const __m512 sc0 = load_scales(a.scales, b0 + g * 16, a.half);
        const __m512 sc1 = g1 ? load_scales(a.scales, b1 + g * 16, a.half) : sc0;
        for (int r = 0; r < R; ++r) {
            const int64_t at = (r0 + r) * groups + g;
            const __m512 step = _mm512_set1_ps(xr.step[at]);
            f0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0[r]), _mm512_mul_ps(sc0, step), f0[r]);
            if (g1) f1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[r]), _mm512_mul_ps(sc1, step), f1[r]);
            if (mins) {
                const __m512 sum = _mm512_set1_ps(xr.sum[at]);
                f0[r] = _mm512_fmadd_ps(load_scales(a.mins, b0 + g * 16, a.half), sum, f0[r]);
                if (g1) f1[r] = _mm512_fmadd_ps(load_scales(a.mins, b1 + g * 16, a.half), sum, f1[r]);
            }
        }
    }
    const __mmask16 mask0 = tail_mask(a.N - t0 * 16), mask1 = w1 ? tail_mask(a.N - t0 * 16 - 16) : 0;
    for (int r = 0; r < R; ++r) {
        _mm512_mask_storeu_ps(y + (r0 + r) * ys + t0 * 16, mask0, f0[r]);
        if (w1) _mm512_mask_storeu_ps(y + (r0 + r) * ys + t0 * 16 + 16, mask1, f1[r]);
    }
}

void many_rows_vnni(const QArgs &a, int64_t tiles, const float *x, int64_t xs, float *y, int64_t ys, int64_t M) {
    QuantRows xr;
    quantize_rows(x, xs, M, a.K, a.G, xr);
    const int64_t pairs = (tiles + 1) / 2;
#pragma omp parallel
    {
        std::vector<int32_t> buf(size_t(a.K) * 16);  // two tiles of K / 2 words of 16 lanes
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < pairs; ++p) {
            const int64_t t0 = 2 * p;
            const bool two = t0 + 1 < tiles;
            int32_t *w0 = buf.data(), *w1 = two ? buf.data() + a.K * 8 : nullptr;
            form_pairs(a, t0, w0);
            if (two) form_pairs(a, t0 + 1, w1);
            int64_t r = 0;
            for (; r + 6 <= M; r += 6) rows_pairs<6>(a, xr, r, w0, w1, t0, y, ys);
            switch (M - r) {
                case 5: rows_pairs<5>(a, xr, r, w0, w1, t0, y, ys); break;
                case 4: rows_pairs<4>(a, xr, r, w0, w1, t0, y, ys); break;
                case 3: rows_pairs<3>(a, xr, r, w0, w1, t0, y, ys); break;
                case 2: rows_pairs<2>(a, xr, r, w0, w1, t0, y, ys); break;
                case 1: rows_pairs<1>(a, xr, r, w0, w1, t0, y, ys); break;
                default: break;
            }
        }
    }
}
#endif

template <int R>
void few_rows(const QArgs &a, int64_t tiles, const float *x, int64_t xs, float *y, int64_t ys) {
#pragma omp parallel for schedule(static) if (tiles * a.K * R >= (1 << 15))
    for (int64_t t = 0; t < tiles; ++t) tile_few_avx512<R>(a, t, x, xs, y, ys);
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
    if (mins && M <= g_few_rows) {
        const int64_t groups = K / G;
        xsum.resize(size_t(M * groups));
        for (int64_t r = 0; r < M; ++r)
            for (int64_t g = 0; g < groups; ++g) {
                float sum = 0.f;
                for (int i = 0; i < G; ++i) sum += x[r * x_stride + g * G + i];
                xsum[r * groups + g] = sum;
            }
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
            return 0;
        }
#ifdef __AVX512VNNI__
        if (!g_qgemm_float) {
            many_rows_vnni(a, tiles, x, x_stride, y, y_stride, M);
            return 0;
        }
#endif
        // Rows in chunks, so that a chunk of x stays in the caches while every tile pair runs over it (forming a
        // pair again per chunk costs K * 32 per 256 rows).
        constexpr int64_t kRowChunk = 256;
        const int64_t pairs = (tiles + 1) / 2, chunks = (M + kRowChunk - 1) / kRowChunk;
#pragma omp parallel
        {
            std::vector<float> buf(size_t(K) * 32);
#pragma omp for schedule(dynamic, 1) collapse(2)
            for (int64_t c = 0; c < chunks; ++c)
            for (int64_t p = 0; p < pairs; ++p) {
                const int64_t rows = std::min(kRowChunk, M - c * kRowChunk);
                const float *xc = x + c * kRowChunk * x_stride;
                float *yc = y + c * kRowChunk * y_stride;
                const int64_t t0 = 2 * p;
                const bool two = t0 + 1 < tiles;
                float *w0 = buf.data(), *w1 = two ? buf.data() + K * 16 : nullptr;
                form_tile_avx512(a, t0, w0);
                if (two) form_tile_avx512(a, t0 + 1, w1);
                const __mmask16 m0 = tail_mask(N - t0 * 16), m1 = two ? tail_mask(N - t0 * 16 - 16) : 0;
                int64_t r = 0;
                for (; r + 8 <= rows; r += 8)
                    rows_two_tiles<8>(w0, w1, K, xc + r * x_stride, x_stride, yc + r * y_stride, y_stride, t0 * 16, m0,
                                      m1);
                for (; r < rows; ++r)
                    rows_two_tiles<1>(w0, w1, K, xc + r * x_stride, x_stride, yc + r * y_stride, y_stride, t0 * 16, m0,
                                      m1);
            }
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

void zs_qgemm_set_portable(int on) { g_qgemm_portable = on != 0; }

void zs_qgemm_set_float(int on) { g_qgemm_float = on != 0; }

void zs_qgemm_set_few_rows(int n) { g_few_rows = std::clamp(n, 0, 8); }

}  // extern "C"
