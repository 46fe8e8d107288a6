// A whole decode step's decoder layers in one call: what engine_worker/models/llama.py runs layer by layer through
// ctypes (add_rms_norm, qgemm, rope_and_store, decode_attention, silu_and_mul), the same kernels on the same
// buffers in the same order, so the numbers are those of the layer-by-layer path bit for bit. At batch 1 a step of
// SmolLM2 is 30 layers of nine native calls, and the Python between them (module calls, views, argument checks,
// ctypes conversions) was a quarter of the step (engine_worker/models/native_decode.py says when this runs).

#include <cstdint>
#include <vector>

extern "C" {
void zs_add_rms_norm_f32(const float *, int64_t, float *, const float *, float *, int64_t, int, float);
void zs_add_rms_norm_bf16(const uint16_t *, int64_t, uint16_t *, const uint16_t *, uint16_t *, int64_t, int, float);
void zs_silu_and_mul_f32(const float *, float *, int64_t, int);
void zs_silu_and_mul_bf16(const uint16_t *, uint16_t *, int64_t, int);
int zs_rope_and_store_f32(float *, int64_t, int64_t, const int64_t *, const float *, const float *, float *, int64_t,
                          const int64_t *, int, int, int);
int zs_rope_and_store_bf16(uint16_t *, int64_t, int64_t, const int64_t *, const float *, const float *, uint16_t *,
                           int64_t, const int64_t *, int, int, int);
int zs_decode_attention_f32(const float *, int64_t, const float *, int64_t, const int32_t *, int64_t, const int32_t *,
                            float *, int, int, int, int, int, float, int);
int zs_decode_attention_bf16(const uint16_t *, int64_t, const uint16_t *, int64_t, const int32_t *, int64_t,
                             const int32_t *, uint16_t *, int, int, int, int, int, float, int);
int zs_qgemm_f32(const float *, int64_t, float *, int64_t, int64_t, const uint8_t *, const void *, const void *, int,
                 int64_t, int64_t, int, int);
int zs_qgemm_bf16(const uint16_t *, int64_t, uint16_t *, int64_t, int64_t, const uint8_t *, const void *, const void *,
                  int, int64_t, int64_t, int, int);
}

namespace {

// One layer's arguments, as int64s (pointers as addresses): the layout native_decode.py packs.
enum Field : int {
    kLn1, kLn2, kKv,  // the two norms' weights; the layer's [2, KV, slots, D] cache
    kLinears,  // then four linears (qkv, o, gate_up, down) of kLinearFields: codes, scales, mins, half, N, K, G, bits
};
constexpr int kLinearFields = 8;
constexpr int kLayerFields = kLinears + 4 * kLinearFields;

// The kernels of one activation dtype, by the suffix of their exported names.
#define ZS_KERNELS(NAME, TYPE, SUFFIX)                                                                             \
    struct NAME {                                                                                                  \
        using T = TYPE;                                                                                            \
        static void norm(const T *x, T *res, const T *w, T *out, int64_t n, int h, float eps) {                    \
            zs_add_rms_norm_##SUFFIX(x, h, res, w, out, n, h, eps);                                                \
        }                                                                                                          \
        static void silu(const T *gu, T *out, int64_t n, int inter) {                                              \
            zs_silu_and_mul_##SUFFIX(gu, out, n, inter);                                                           \
        }                                                                                                          \
        static int rope(T *qkv, int64_t n, int64_t stride, const int64_t *pos, const float *c, const float *s, T *kv, \
                        int64_t plane, const int64_t *slots, int H, int KV, int D) {                               \
            return zs_rope_and_store_##SUFFIX(qkv, n, stride, pos, c, s, kv, plane, slots, H, KV, D);              \
        }                                                                                                          \
        static int attend(const T *q, int64_t qs, const T *kv, int64_t plane, const int32_t *tables, int64_t ts,   \
                          const int32_t *lens, T *out, int B, int H, int KV, int D, int bs, float scale, int window) { \
            return zs_decode_attention_##SUFFIX(q, qs, kv, plane, tables, ts, lens, out, B, H, KV, D, bs, scale,   \
                                                window);                                                           \
        }                                                                                                          \
        /* l: one linear's fields (codes, scales, mins, half, N, K, G, bits) */                                    \
        static int gemm(const T *x, T *y, int64_t m, const int64_t *l) {                                           \
            return zs_qgemm_##SUFFIX(x, l[5], y, l[4], m, (const uint8_t *)l[0], (const void *)l[1],               \
                                     (const void *)l[2], int(l[3]), l[4], l[5], int(l[6]), int(l[7]));             \
        }                                                                                                          \
    };

ZS_KERNELS(Kernels32, float, f32)
ZS_KERNELS(Kernels16, uint16_t, bf16)

// x [n, hidden]: the embeddings in; the residual stream, updated in place (as the first layer's input norm makes
// it). out [n, hidden]: the last layer's MLP output. The caller adds the two, as the model's forward does.
template <typename K>
int decode_layers(typename K::T *x, typename K::T *out, int64_t n, const int64_t *layers, int num_layers, int hidden,
                  int H, int KV, int D, int inter, float eps, const int64_t *positions, const int64_t *slots,
                  const float *cos, const float *sin, int64_t plane, const int32_t *tables, int64_t table_stride,
                  const int32_t *lens, int block_size, float scale, int window) {
    using T = typename K::T;
    const int64_t qkv_width = int64_t(H + 2 * KV) * D;
    std::vector<T> h(n * hidden), qkv(n * qkv_width), att(n * int64_t(H) * D), gu(n * 2 * int64_t(inter)),
        act(n * int64_t(inter));
    for (int i = 0; i < num_layers; ++i) {
        const int64_t *f = layers + int64_t(i) * kLayerFields;
        const int64_t *lin = f + kLinears;
        T *kv = (T *)f[kKv];
        // input norm: the first layer's of the embeddings alone; later ones add the previous MLP's output first
        K::norm(i == 0 ? x : out, i == 0 ? nullptr : x, (const T *)f[kLn1], h.data(), n, hidden, eps);
        int rc = K::gemm(h.data(), qkv.data(), n, lin);
        if (!rc) rc = K::rope(qkv.data(), n, qkv_width, positions, cos, sin, kv, plane, slots, H, KV, D);
        if (!rc) rc = K::attend(qkv.data(), qkv_width, kv, plane, tables, table_stride, lens, att.data(), int(n), H,
                                KV, D, block_size, scale, window);
        if (!rc) rc = K::gemm(att.data(), out, n, lin + kLinearFields);
        if (rc) return rc;
        K::norm(out, x, (const T *)f[kLn2], h.data(), n, hidden, eps);
        rc = K::gemm(h.data(), gu.data(), n, lin + 2 * kLinearFields);
        if (rc) return rc;
        K::silu(gu.data(), act.data(), n, inter);
        rc = K::gemm(act.data(), out, n, lin + 3 * kLinearFields);
        if (rc) return rc;
    }
    return 0;
}

}  // namespace

extern "C" {

int zs_decode_layers_fields(void) { return kLayerFields; }

#define ZS_DECODE_LAYERS(SUFFIX, KERNELS)                                                                          \
    int zs_decode_layers_##SUFFIX(KERNELS::T *x, KERNELS::T *out, int64_t n, const int64_t *layers, int num_layers, \
                                  int hidden, int H, int KV, int D, int inter, float eps, const int64_t *positions, \
                                  const int64_t *slots, const float *cos, const float *sin, int64_t plane,          \
                                  const int32_t *tables, int64_t table_stride, const int32_t *lens, int block_size,  \
                                  float scale, int window) {                                                       \
        if (n <= 0 || num_layers <= 0) return -1;                                                                  \
        return decode_layers<KERNELS>(x, out, n, layers, num_layers, hidden, H, KV, D, inter, eps, positions,      \
                                      slots, cos, sin, plane, tables, table_stride, lens, block_size, scale,       \
                                      window);                                                                     \
    }

ZS_DECODE_LAYERS(f32, Kernels32)
ZS_DECODE_LAYERS(bf16, Kernels16)

}  // extern "C"
