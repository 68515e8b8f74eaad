// Why packed weights live in huge-page arenas (kt_x86::memory): two threads stream 24 random
// 1.5 MB matrices (qwen3-30b-a3b's int8 gate/up at one decode token) from DRAM, out of 400
// allocated one by one (2 MB-aligned and advised, as the buffers per matrix were: no huge page
// fits inside one) or laid one after another in one advised range (huge pages), the two
// alternated rep by rep so that the VM's drift hits both alike. Prints best and mean times.
//
//   gcc -O2 -mavx2 -pthread scripts/hugepages.c -o /tmp/hugepages && /tmp/hugepages
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define N 400
#define MB (1 << 20)
static const size_t LEN = 1536 * 1024;
static char *sep[N], *arena[N];
static int order[N];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// Sum a matrix's bytes as 32-bit words, prefetching as the decode kernels do (2 KB into L1,
// 6 KB into L2).
static __m256i readm(const char *p, size_t len) {
    __m256i s = _mm256_setzero_si256();
    for (size_t i = 0; i < len; i += 128) {
        _mm_prefetch(p + i + 2048, _MM_HINT_T0);
        _mm_prefetch(p + i + 6144, _MM_HINT_T1);
        for (int j = 0; j < 128; j += 32) s = _mm256_add_epi32(s, _mm256_load_si256((const __m256i *) (p + i + j)));
    }
    return s;
}

struct job {
    char **m;
    int start, cnt;
    volatile long sink;
};
static void *run(void *a) {
    struct job *j = a;
    __m256i s = _mm256_setzero_si256();
    for (int i = 0; i < j->cnt; i++) s = _mm256_add_epi32(s, readm(j->m[order[(j->start + i) % N]], LEN));
    j->sink = _mm256_extract_epi32(s, 0);
    return 0;
}

int main(void) {
    const int per = 12;  // matrices per thread and rep
    for (int i = 0; i < N; i++) {
        sep[i] = aligned_alloc(2 * MB, LEN);
        madvise(sep[i], LEN, MADV_HUGEPAGE);
        memset(sep[i], 1, LEN);
    }
    char *a = aligned_alloc(2 * MB, (size_t) N * LEN);
    madvise(a, (size_t) N * LEN, MADV_HUGEPAGE);
    for (int i = 0; i < N; i++) {
        arena[i] = a + (size_t) i * LEN;
        memset(arena[i], 1, LEN);
    }
    srand(1);
    for (int i = 0; i < N; i++) order[i] = i;
    double best[2] = {1e9, 1e9}, tot[2] = {0, 0};
    const int reps = 2000;
    for (int r = 0; r < reps; r++) {
        for (int i = N - 1; i > 0; i--) {
            int j = rand() % (i + 1), t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        for (int v = 0; v < 2; v++) {
            int w = (r & 1) ? 1 - v : v;
            pthread_t th[2];
            struct job jb[2];
            double t0 = now();
            for (int t = 0; t < 2; t++) {
                jb[t] = (struct job){w ? arena : sep, t * per, per, 0};
                pthread_create(&th[t], 0, run, &jb[t]);
            }
            for (int t = 0; t < 2; t++) pthread_join(th[t], 0);
            double dt = now() - t0;
            if (dt < best[w]) best[w] = dt;
            tot[w] += dt;
        }
    }
    double bytes = 2.0 * per * LEN;
    printf("one allocation a matrix (4K pages): best %.3f ms (%.1f GB/s), mean %.3f ms\n", best[0] * 1e3,
           bytes / best[0] / 1e9, tot[0] / reps * 1e3);
    printf("one advised range (huge pages):     best %.3f ms (%.1f GB/s), mean %.3f ms\n", best[1] * 1e3,
           bytes / best[1] / 1e9, tot[1] / reps * 1e3);
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    char l[256];
    while (f && fgets(l, sizeof l, f))
        if (strstr(l, "AnonHuge")) fputs(l, stdout);
    return 0;
}
