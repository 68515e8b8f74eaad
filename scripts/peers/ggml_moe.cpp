// One ggml MUL_MAT_ID (the op llama.cpp runs for an MoE projection), timed: our peer's number for
// `scripts/peer-ggml.sh`. Weights are random values quantized by ggml itself and placed in the
// buffer type named (CPU, or CPU_REPACK: the interleaved rows llama.cpp loads weights into);
// each token picks K distinct experts at random, as `kt bench` routes.
//
// usage: ggml_moe TYPE BUFT TOKENS ROWS COLS EXPERTS K THREADS SECONDS
// prints: TYPE BUFT n=.. rows=.. cols=..: best .. ms median .. ms .. GOP/s (runs)
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

static ggml_type type_named(const char * name) {
    for (int i = 0; i < GGML_TYPE_COUNT; i++) {
        const char * n = ggml_get_type_traits((ggml_type) i)->type_name;
        if (n && strcmp(n, name) == 0) {
            return (ggml_type) i;
        }
    }
    fprintf(stderr, "ggml_moe: unknown ggml type %s\n", name);
    exit(2);
}

int main(int argc, char ** argv) {
    if (argc != 10) {
        fprintf(stderr, "usage: %s TYPE BUFT TOKENS ROWS COLS EXPERTS K THREADS SECONDS\n", argv[0]);
        return 2;
    }
    const ggml_type t = type_named(argv[1]);
    const char * buft_name = argv[2];
    const int n = atoi(argv[3]), rows = atoi(argv[4]), cols = atoi(argv[5]);
    const int experts = atoi(argv[6]), k = atoi(argv[7]), threads = atoi(argv[8]);
    const double seconds = atof(argv[9]);

    ggml_backend_t be = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(be, threads);
    ggml_backend_dev_t dev = ggml_backend_get_device(be);
    ggml_backend_buffer_type_t wbt = ggml_backend_cpu_buffer_type();
    auto extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts");
    for (auto p = extra ? extra(dev) : nullptr; p && *p; p++) {
        if (strcmp(ggml_backend_buft_name(*p), buft_name) == 0) {
            wbt = *p;
        }
    }
    if (strcmp(ggml_backend_buft_name(wbt), buft_name) != 0) {
        fprintf(stderr, "ggml_moe: no buffer type %s in this build\n", buft_name);
        return 2;
    }

    ggml_init_params ip = { 16 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context * cw = ggml_init(ip);
    ggml_context * cx = ggml_init(ip);
    ggml_tensor * a = ggml_new_tensor_3d(cw, t, cols, rows, experts);
    ggml_tensor * b = ggml_new_tensor_3d(cx, GGML_TYPE_F32, cols, 1, n);
    ggml_tensor * ids = ggml_new_tensor_2d(cx, GGML_TYPE_I32, k, n);
    ggml_tensor * out = ggml_mul_mat_id(cx, a, b, ids);
    ggml_backend_buffer_t bw = ggml_backend_alloc_ctx_tensors_from_buft(cw, wbt);
    ggml_backend_buffer_set_usage(bw, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_buffer_t bx = ggml_backend_alloc_ctx_tensors(cx, be);
    if (!bw || !bx) {
        fprintf(stderr, "ggml_moe: allocation failed\n");
        return 1;
    }

    std::mt19937 rng(1);
    std::normal_distribution<float> g(0, 1);
    // The repacking buffer takes a tensor in one piece.
    const size_t per = ggml_row_size(t, cols) * rows;
    std::vector<float> f((size_t) cols * rows);
    std::vector<uint8_t> q(per * experts);
    for (int e = 0; e < experts; e++) {
        for (auto & v : f) {
            v = 0.02f * g(rng);
        }
        ggml_quantize_chunk(t, f.data(), q.data() + e * per, 0, rows, cols, nullptr);
    }
    ggml_backend_tensor_set(a, q.data(), 0, q.size());
    std::vector<float> x((size_t) cols * n);
    for (auto & v : x) {
        v = g(rng);
    }
    ggml_backend_tensor_set(b, x.data(), 0, x.size() * sizeof(float));
    std::vector<int> id((size_t) k * n), perm(experts);
    for (int i = 0; i < experts; i++) {
        perm[i] = i;
    }
    for (int j = 0; j < n; j++) {
        std::shuffle(perm.begin(), perm.end(), rng);
        std::copy(perm.begin(), perm.begin() + k, id.begin() + (size_t) j * k);
    }
    ggml_backend_tensor_set(ids, id.data(), 0, id.size() * sizeof(int));

    ggml_cgraph * graph = ggml_new_graph(cx);
    ggml_build_forward_expand(graph, out);
    std::vector<double> ts;
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (ts.size() < 5 || std::chrono::steady_clock::now() < end) {
        const auto t0 = std::chrono::steady_clock::now();
        if (ggml_backend_graph_compute(be, graph) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "ggml_moe: compute failed\n");
            return 1;
        }
        ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin(), ts.end());
    const double ops = 2.0 * rows * cols * k * n;
    printf("%s %s n=%d rows=%d cols=%d: best %.3f ms median %.3f ms %.1f GOP/s (%zu runs)\n", argv[1], buft_name, n,
           rows, cols, ts[0] * 1e3, ts[ts.size() / 2] * 1e3, ops / ts[0] / 1e9, ts.size());
    return 0;
}
