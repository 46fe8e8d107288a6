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
// Few rows (a decode step): each tile is read once from memory and its weights are formed in registers for all the
// rows at once; the step is bound by the bytes of the weights, a quarter of bf16's for 4-bit. Many rows (a prompt
// chunk): a pair of tiles is formed into float32 once, into a per-thread buffer, and every block of 8 rows runs an
// FMA micro-kernel over it (16 accumulators), so the cost of forming the weights is spread over all the rows.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

struct QArgs {
    const uint8_t *codes;
    const float *scales;
    const float *mins;  // may be null
    int64_t N, K;
    int G;
    int bits;  // 4 or 8
};

inline int64_t tile_code_bytes(const QArgs &a) { return a.bits == 4 ? a.K * 8 : a.K * 16; }

// The float32 weights of tile t, inputs [0, K), as w[k * 16 + j].
void form_tile_generic(const QArgs &a, int64_t t, float *w) {
    const uint8_t *c = a.codes + t * tile_code_bytes(a);
    const int64_t groups = a.K / a.G;
    const float *s = a.scales + t * groups * 16, *m = a.mins ? a.mins + t * groups * 16 : nullptr;
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
            w[k * 16 + j] = m ? q * s[g * 16 + j] + m[g * 16 + j] : q * s[g * 16 + j];
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

// Up to R rows (R <= 4) against tile t, weights formed in registers.
template <int R>
void tile_few_avx512(const QArgs &a, int64_t t, const float *x, int64_t xs, float *y, int64_t ys) {
    const uint8_t *c = a.codes + t * tile_code_bytes(a);
    const int64_t groups = a.K / a.G;
    const float *s = a.scales + t * groups * 16, *m = a.mins ? a.mins + t * groups * 16 : nullptr;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int64_t g = 0; g < groups; ++g) {
        const __m512 sv = _mm512_loadu_ps(s + g * 16);
        const __m512 mv = m ? _mm512_loadu_ps(m + g * 16) : _mm512_setzero_ps();
        const int64_t k0 = g * a.G;
        if (a.bits == 4) {
            for (int64_t k = k0; k < k0 + a.G; k += 2) {
                const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + (k / 2) * 16)));
                const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low4)), sv, mv);
                const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), sv, mv);
                for (int r = 0; r < R; ++r) {
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + k]), w0, acc[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + k + 1]), w1, acc[r]);
                }
            }
        } else {
            for (int64_t k = k0; k < k0 + a.G; ++k) {
                const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + k * 16)));
                const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), sv, mv);
                for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + k]), w, acc[r]);
            }
        }
    }
    const __mmask16 mask = tail_mask(a.N - t * 16);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ys + t * 16, mask, acc[r]);
}

void form_tile_avx512(const QArgs &a, int64_t t, float *w) {
    const uint8_t *c = a.codes + t * tile_code_bytes(a);
    const int64_t groups = a.K / a.G;
    const float *s = a.scales + t * groups * 16, *m = a.mins ? a.mins + t * groups * 16 : nullptr;
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int64_t g = 0; g < groups; ++g) {
        const __m512 sv = _mm512_loadu_ps(s + g * 16);
        const __m512 mv = m ? _mm512_loadu_ps(m + g * 16) : _mm512_setzero_ps();
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

template <int R>
void few_rows(const QArgs &a, int64_t tiles, const float *x, int64_t xs, float *y, int64_t ys) {
#pragma omp parallel for schedule(static) if (tiles * a.K * R >= (1 << 15))
    for (int64_t t = 0; t < tiles; ++t) tile_few_avx512<R>(a, t, x, xs, y, ys);
}
#endif

bool g_qgemm_portable = false;

}  // namespace

extern "C" {

// Returns 0, or a negative number for arguments it cannot take.
int zs_qgemm_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride, int64_t M, const uint8_t *codes,
                 const float *scales, const float *mins, int64_t N, int64_t K, int G, int bits) {
    if (M < 0 || N <= 0 || K <= 0 || G <= 0 || K % G || (bits != 4 && bits != 8) || (bits == 4 && G % 2))
        return -1;
    if (M == 0) return 0;
    const QArgs a{codes, scales, mins, N, K, G, bits};
    const int64_t tiles = (N + 15) / 16;
#ifdef __AVX512F__
    if (!g_qgemm_portable) {
        if (M <= 4) {
            switch (M) {
                case 1: few_rows<1>(a, tiles, x, x_stride, y, y_stride); break;
                case 2: few_rows<2>(a, tiles, x, x_stride, y, y_stride); break;
                case 3: few_rows<3>(a, tiles, x, x_stride, y, y_stride); break;
                default: few_rows<4>(a, tiles, x, x_stride, y, y_stride); break;
            }
            return 0;
        }
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

}  // extern "C"
