/* hetforge native CPU kernels, fp32: one-row products (the GEMVs of a decode step) and the row ops
 * between them (norms, rotary, the decode attention).
 *
 * Why: a decode step reads every weight once, so it is bound by memory bandwidth. ATen runs a one-row
 * linear as a single-threaded MKL GEMV (~17 GB/s on the 2-core build host); a bmm over a chunked view
 * of the weight uses both cores but still reaches only 25-29 GB/s. These loops give each thread one
 * contiguous block of the weight and stream it once (33 GB/s there, the same as a plain read of memory).
 * Plain C: the compiler vectorizes the loops (-O3 -march=native); OpenMP comes from the libgomp that
 * torch has already loaded, so this shares torch's thread pool. Built and loaded by native.py. */
#define _GNU_SOURCE
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* An OpenMP team size: at least one (num_threads(0) would mean "the default", possibly more threads than
 * a caller's per-thread scratch has rows). */
static int clamp_threads(int threads) { return threads < 1 ? 1 : threads; }

static float dot(const float *restrict a, const float *restrict b, long k) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (long i = 0; i < k; i++) s += a[i] * b[i];
    return s;
}

/* Four dot products sharing x: four weight rows streamed at once. */
static void dot4(const float *restrict a0, const float *restrict a1, const float *restrict a2,
                 const float *restrict a3, const float *restrict b, long k, float *out) {
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (long i = 0; i < k; i++) {
        s0 += a0[i] * b[i];
        s1 += a1[i] * b[i];
        s2 += a2[i] * b[i];
        s3 += a3[i] * b[i];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

/* y[n] = sum_k w[n, k] x[k] (+ bias[n]); w is [N, K] row-major (F.linear layout). Each thread takes one
 * contiguous block of rows and reads it as four streams (the block's quarters, one row of each at a time):
 * one stream per core leaves memory bandwidth unused on the build host (29 GB/s vs 35 GB/s for four,
 * measured on one 768 MiB weight). */
void hf_gemv_nk(const float *w, const float *x, const float *bias, float *y, long n, long k, int threads) {
    threads = clamp_threads(threads);
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long r0 = n * t / nt, r1 = n * (t + 1) / nt, q = (r1 - r0) / 4;
        float o[4];
        for (long i = r0; i < r0 + q; i++) {
            dot4(w + i * k, w + (i + q) * k, w + (i + 2 * q) * k, w + (i + 3 * q) * k, x, k, o);
            for (int j = 0; j < 4; j++) y[i + j * q] = o[j];
        }
        for (long r = r0 + 4 * q; r < r1; r++) y[r] = dot(w + r * k, x, k);
        if (bias)
            for (long r = r0; r < r1; r++) y[r] += bias[r];
    }
}

/* y[n] = sum_k x[k] w[k, n] (+ bias[n]); w is [K, N] row-major (GPT-2 Conv1D / addmm layout). Split-K:
 * each thread streams a contiguous block of rows (as four streams, its quarters) into its own row of
 * ``part`` (a [slots, N] scratch the caller owns; at most ``slots`` threads run), then the partial rows
 * are summed in thread order, so the result does not depend on timing. */
void hf_gemv_kn(const float *w, const float *x, const float *bias, float *y, long n, long k, int threads,
                float *part, int slots) {
    threads = clamp_threads(threads > slots ? slots : threads);
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        {  /* acc is this thread's row of part; its restrict scope ends before part is read across rows */
            long k0 = k * t / nt, k1 = k * (t + 1) / nt, q = (k1 - k0) / 4;
            float *restrict acc = part + (size_t)t * n;
            memset(acc, 0, (size_t)n * sizeof(float));
            for (long i = k0; i < k0 + q; i++) {
                const float x0 = x[i], x1 = x[i + q], x2 = x[i + 2 * q], x3 = x[i + 3 * q];
                const float *restrict w0 = w + i * n, *restrict w1 = w0 + q * n;
                const float *restrict w2 = w1 + q * n, *restrict w3 = w2 + q * n;
#pragma omp simd
                for (long j = 0; j < n; j++) acc[j] += (x0 * w0[j] + x1 * w1[j]) + (x2 * w2[j] + x3 * w3[j]);
            }
            for (long i = k0 + 4 * q; i < k1; i++) {
                const float xi = x[i];
                const float *restrict wr = w + i * n;
#pragma omp simd
                for (long j = 0; j < n; j++) acc[j] += xi * wr[j];
            }
        }
#pragma omp barrier
        long j0 = n * t / nt, j1 = n * (t + 1) / nt;
        for (long j = j0; j < j1; j++) {
            float s = part[j];
            for (int c = 1; c < nt; c++) s += part[(size_t)c * n + j];
            y[j] = bias ? s + bias[j] : s;
        }
    }
}

/* Reads ``n`` floats as ``threads`` x four streams, like the GEMVs above (a memory-bandwidth probe for
 * calibration: the fastest weight stream this host sustains). Returns their sum so nothing is elided. */
float hf_read_stream(const float *a, long n, int threads) {
    threads = clamp_threads(threads);
    float total = 0.f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long i0 = n * t / nt, i1 = n * (t + 1) / nt, q = (i1 - i0) / 4;
        const float *restrict a0 = a + i0, *restrict a1 = a0 + q, *restrict a2 = a1 + q, *restrict a3 = a2 + q;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (long i = 0; i < q; i++) s += (a0[i] + a1[i]) + (a2[i] + a3[i]);
        for (long i = i0 + 4 * q; i < i1; i++) s += a[i];
        total += s;
    }
    return total;
}

/* ---------------------------------------------------------------- decode-step row ops
 * The small per-token ops between the GEMVs. In ATen each is 3-6 kernel calls of ~3 µs dispatch on a
 * 768-float row; here each is one call. Elementwise ones are bit-equal to ATen's chains (the library is
 * built with -ffp-contract=off, so a*b + c*d is rounded like the separate ATen ops); the two norms sum
 * in their own order, so they match ATen to rounding, not bitwise. */
/* Hugging Face rotary on contiguous rows of width d: y = x*cos + rotate_half(x)*sin, with cos/sin one row
 * of width d shared by all rows (one position). rotate_half(x) = cat(-x[d/2:], x[:d/2]). */
void hf_rotary(const float *x, const float *cos_, const float *sin_, float *y, long rows, long d, int threads) {
    threads = clamp_threads(threads);
    long h = d / 2;
#pragma omp parallel for num_threads(threads) if (rows * d >= 65536) schedule(static)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        float *yr = y + r * d;
        for (long i = 0; i < h; i++) yr[i] = xr[i] * cos_[i] + (-xr[i + h]) * sin_[i];
        for (long i = h; i < d; i++) yr[i] = xr[i] * cos_[i] + xr[i - h] * sin_[i];
    }
}

/* Hugging Face rotary over many positions (prefill): x [b, h, s, d] read with strides sb, sh, ss (elements; the
 * last dim dense), e.g. a transposed view of a projection's output, read in place; cos/sin one row of width d per
 * position (row i at cos_ + i * cs; cs = 0: one row for every position); y dense [b, h, s, d]. Same roundings
 * as hf_rotary (and the ATen chain). */
void hf_rotary_pos(const float *x, const float *cos_, const float *sin_, float *y, long b, long nh, long s,
                   long d, long sb, long sh, long ss, long cs, int threads) {
    threads = clamp_threads(threads);
    long h = d / 2, rows = b * nh * s;
#pragma omp parallel for num_threads(threads) if (rows * d >= 65536) schedule(static)
    for (long r = 0; r < rows; r++) {
        long ib = r / (nh * s), ih = (r / s) % nh, is = r % s;
        const float *xr = x + ib * sb + ih * sh + is * ss, *c = cos_ + is * cs, *sn = sin_ + is * cs;
        float *yr = y + r * d;
        for (long i = 0; i < h; i++) yr[i] = xr[i] * c[i] + (-xr[i + h]) * sn[i];
        for (long i = h; i < d; i++) yr[i] = xr[i] * c[i] + xr[i - h] * sn[i];
    }
}

/* RMSNorm of contiguous rows: y = w * (x * (1 / sqrt(mean(x^2) + eps))); w may be NULL. */
void hf_rms_norm(const float *x, const float *w, float *y, long rows, long d, float eps, int threads) {
    threads = clamp_threads(threads);
#pragma omp parallel for num_threads(threads) if (rows * d >= 65536) schedule(static)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        float *yr = y + r * d;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (long i = 0; i < d; i++) s += xr[i] * xr[i];
        float inv = 1.f / sqrtf(s / (float)d + eps);
        if (w) {
            for (long i = 0; i < d; i++) yr[i] = w[i] * (xr[i] * inv);
        } else {
            for (long i = 0; i < d; i++) yr[i] = xr[i] * inv;
        }
    }
}

/* LayerNorm of contiguous rows (biased variance, two passes): y = (x - mean) * rstd * w + b; w, b may be NULL. */
void hf_layer_norm(const float *x, const float *w, const float *b, float *y, long rows, long d, float eps,
                   int threads) {
    threads = clamp_threads(threads);
#pragma omp parallel for num_threads(threads) if (rows * d >= 65536) schedule(static)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        float *yr = y + r * d;
        float s = 0.f, q = 0.f;
#pragma omp simd reduction(+ : s)
        for (long i = 0; i < d; i++) s += xr[i];
        float mean = s / (float)d;
#pragma omp simd reduction(+ : q)
        for (long i = 0; i < d; i++) q += (xr[i] - mean) * (xr[i] - mean);
        float rstd = 1.f / sqrtf(q / (float)d + eps);
        for (long i = 0; i < d; i++) {
            float v = (xr[i] - mean) * rstd;
            if (w) v = v * w[i];
            if (b) v = v + b[i];
            yr[i] = v;
        }
    }
}

/* One new query row per head against a read-only KV cache plus the new row (the decode step's attention).
 * q [h, d], k_new/v_new [hkv, d], caches [hkv, s, d], mask [s] additive (may hold -inf), new_mask the
 * additive mask of the new row against itself (one float, or NULL); out [h, d]. Head i reads kv head i / (h / hkv). Heads
 * run in parallel; scores sit in a per-head buffer of s + 1 floats (scratch [h, s + 1]). */
void hf_decode_attention(const float *q, const float *k_new, const float *v_new, const float *k_cache,
                         const float *v_cache, const float *mask, const float *new_mask, float *out, float *scratch,
                         long h, long hkv, long s, long d, float scale, int threads) {
    threads = clamp_threads(threads);
    long g = h / hkv;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long i = 0; i < h; i++) {
        long j = i / g;
        const float *qi = q + i * d, *kc = k_cache + j * s * d, *vc = v_cache + j * s * d;
        float *p = scratch + i * (s + 1), *o = out + i * d;
        float mx = -INFINITY;
        for (long t = 0; t < s; t++) {
            float v = scale * dot(qi, kc + t * d, d) + mask[t];
            p[t] = v;
            if (v > mx) mx = v;
        }
        float vn = scale * dot(qi, k_new + j * d, d) + (new_mask ? *new_mask : 0.f);
        p[s] = vn;
        if (vn > mx) mx = vn;
        float z = 0.f;
        for (long t = 0; t <= s; t++) {
            float e = expf(p[t] - mx);
            p[t] = e;
            z += e;
        }
        float iz = 1.f / z;
        for (long c = 0; c < d; c++) o[c] = 0.f;
        for (long t = 0; t < s; t++) {
            float w = p[t] * iz;
            if (w == 0.f) continue;
            const float *vr = vc + t * d;
#pragma omp simd
            for (long c = 0; c < d; c++) o[c] += w * vr[c];
        }
        float w = p[s] * iz;
        const float *vr = v_new + j * d;
#pragma omp simd
        for (long c = 0; c < d; c++) o[c] += w * vr[c];
    }
}

/* ---------------------------------------------------------------- one-row MLP blocks */

/* act(v) for ACT_RELU, ACT_GELU (erf), ACT_GELU_TANH, ACT_SILU: the formulas of ATen's kernels (results equal
 * to rounding: libm's erff/tanhf/expf are not ATen's vectorized ones). */
enum { ACT_NONE = 0, ACT_RELU = 1, ACT_GELU = 2, ACT_GELU_TANH = 3, ACT_SILU = 4 };

static float act_of(float v, int act) {
    switch (act) {
    case ACT_RELU: return v <= 0.f ? 0.f : v; /* NaN stays NaN, as in torch.relu */
    case ACT_GELU: return v * 0.5f * (1.f + erff(v * (float)M_SQRT1_2));
    case ACT_GELU_TANH: {
        const float beta = (float)(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
        float cube = v * v * v;
        float inner = beta * (v + kappa * cube);
        return 0.5f * v * (1.f + tanhf(inner));
    }
    case ACT_SILU: return v / (1.f + expf(-v));
    default: return v;
    }
}

/* y = act(x·W (+ b)) for one row: the GEMV above, then the activation over the row, split over threads. */
void hf_linear_act(const float *w, const float *x, const float *bias, float *y, long n, long k, int weight_t,
                   int act, int threads, float *part, int slots) {
    threads = clamp_threads(threads);
    if (weight_t)
        hf_gemv_kn(w, x, bias, y, n, k, threads, part, slots);
    else
        hf_gemv_nk(w, x, bias, y, n, k, threads);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long j = 0; j < n; j++) y[j] = act_of(y[j], act);
}

/* SwiGLU-style block for one row: h = act(Wg·x) * (Wu·x) into ``h`` ([F] scratch), then y = Wd·h when wd
 * is given. Wg, Wu [F, D], Wd [D, F], row-major, no biases. Gate and up rows are streamed together
 * (rows i and i + q of each: four streams), one parallel region for both products. */
void hf_gated_mlp(const float *x, const float *wg, const float *wu, const float *wd, float *h, float *y,
                  long f, long d, int act, int threads) {
    threads = clamp_threads(threads);
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long r0 = f * t / nt, r1 = f * (t + 1) / nt, q = (r1 - r0) / 2;
        float o[4];
        for (long i = r0; i < r0 + q; i++) {
            dot4(wg + i * d, wg + (i + q) * d, wu + i * d, wu + (i + q) * d, x, d, o);
            h[i] = act_of(o[0], act) * o[2];
            h[i + q] = act_of(o[1], act) * o[3];
        }
        for (long i = r0 + 2 * q; i < r1; i++) h[i] = act_of(dot(wg + i * d, x, d), act) * dot(wu + i * d, x, d);
    }
    if (wd) hf_gemv_nk(wd, h, 0, y, d, f, threads);
}

/* ---------------------------------------------------------------- int8 weight-only one-row product */

static float dot_q8(const int8_t *restrict q, const float *restrict x, long k) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (long i = 0; i < k; i++) s += (float)q[i] * x[i];
    return s;
}

/* y[n] = act(scale[n] * sum_k q[n, k] x[k] (+ bias[n])) for one fp32 row x and int8 weights q [N, K] with
 * per-output-channel fp32 scales (hetforge::linear_w8; ATen's _weight_int8pack_mm scales the same way).
 * A quarter of the bytes of the fp32 product, read like hf_gemv_nk: four streams per thread. */
void hf_gemv_q8(const int8_t *q, const float *scales, const float *x, const float *bias, float *y, long n, long k,
                int act, int threads) {
    threads = clamp_threads(threads);
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long r0 = n * t / nt, r1 = n * (t + 1) / nt, qn = (r1 - r0) / 4;
        for (long i = r0; i < r0 + qn; i++) {
            const int8_t *restrict a0 = q + i * k, *restrict a1 = q + (i + qn) * k;
            const int8_t *restrict a2 = q + (i + 2 * qn) * k, *restrict a3 = q + (i + 3 * qn) * k;
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (long c = 0; c < k; c++) {
                s0 += (float)a0[c] * x[c];
                s1 += (float)a1[c] * x[c];
                s2 += (float)a2[c] * x[c];
                s3 += (float)a3[c] * x[c];
            }
            y[i] = s0, y[i + qn] = s1, y[i + 2 * qn] = s2, y[i + 3 * qn] = s3;
        }
        for (long r = r0 + 4 * qn; r < r1; r++) y[r] = dot_q8(q + r * k, x, k);
        for (long r = r0; r < r1; r++) {
            float v = y[r] * scales[r];
            if (bias) v = v + bias[r];
            y[r] = act_of(v, act);
        }
    }
}
