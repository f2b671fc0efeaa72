/* hetforge native CPU kernels: one-row products (the GEMVs of a decode step), fp32.
 *
 * Why: a decode step reads every weight once, so it is bound by memory bandwidth. ATen runs a one-row
 * linear as a single-threaded MKL GEMV (~17 GB/s on the 2-core build host); a bmm over a chunked view
 * of the weight uses both cores but still reaches only 25-29 GB/s. These loops give each thread one
 * contiguous block of the weight and stream it once (33 GB/s there, the same as a plain read of memory).
 * Plain C: the compiler vectorizes the loops (-O3 -march=native); OpenMP comes from the libgomp that
 * torch has already loaded, so this shares torch's thread pool. Built and loaded by native.py. */
#include <omp.h>
#include <string.h>

static float dot(const float *restrict a, const float *restrict b, long k) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (long i = 0; i < k; i++) s += a[i] * b[i];
    return s;
}

/* y[n] = sum_k w[n, k] x[k] (+ bias[n]); w is [N, K] row-major (F.linear layout). Rows split in
 * contiguous blocks, one per thread. */
void hf_gemv_nk(const float *w, const float *x, const float *bias, float *y, long n, long k, int threads) {
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long r0 = n * t / nt, r1 = n * (t + 1) / nt;
        for (long r = r0; r < r1; r++) {
            float s = dot(w + r * k, x, k);
            y[r] = bias ? s + bias[r] : s;
        }
    }
}

/* y[n] = sum_k x[k] w[k, n] (+ bias[n]); w is [K, N] row-major (GPT-2 Conv1D / addmm layout). Split-K:
 * each thread streams a contiguous block of rows into its own row of ``part`` (a [slots, N] scratch the
 * caller owns; at most ``slots`` threads run), then the partial rows are summed in thread order, so the
 * result does not depend on timing. */
void hf_gemv_kn(const float *w, const float *x, const float *bias, float *y, long n, long k, int threads,
                float *part, int slots) {
    if (threads > slots) threads = slots;
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long k0 = k * t / nt, k1 = k * (t + 1) / nt;
        float *restrict acc = part + (size_t)t * n;
        memset(acc, 0, (size_t)n * sizeof(float));
        for (long i = k0; i < k1; i++) {
            const float xi = x[i];
            const float *restrict wr = w + i * n;
#pragma omp simd
            for (long j = 0; j < n; j++) acc[j] += xi * wr[j];
        }
#pragma omp barrier
        long j0 = n * t / nt, j1 = n * (t + 1) / nt;
        for (long j = j0; j < j1; j++) {
            float s = part[j];
            for (int q = 1; q < nt; q++) s += part[(size_t)q * n + j];
            y[j] = bias ? s + bias[j] : s;
        }
    }
}
