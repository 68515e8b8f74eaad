// One ggml MoE projection (what llama.cpp runs), timed: our peers' numbers for
// `scripts/peer-ggml.sh`. Weights are random values quantized by ggml itself and placed in the
// buffer type named: CPU, or CPU_REPACK (the interleaved rows mainline llama.cpp loads weights
// into), both through MUL_MAT_ID; or AMX (mainline's AMX buffer type, which serves MUL_MAT only:
// one MUL_MAT per expert with tokens, on the tokens routed to it, gathered beforehand, in its
// favour). Built against ik_llama.cpp's ggml (`-DPEER_IK`) it has the CPU buffer only, and its
// row-interleaved types (`q4_0_r8`, `q4_k_r4`, ...) are asked for by name. Each token picks K
// distinct experts at random, as `kt bench` routes; where the tokens touch fewer pairs than
// there are experts, the reps sweep the experts in turn, so that decode reads its weights from
// DRAM as `kt bench`'s does, not from the cache.
//
// usage: ggml_moe TYPE BUFT TOKENS ROWS COLS EXPERTS K THREADS SECONDS
// prints: TYPE BUFT n=.. rows=.. cols=..: best .. ms median .. ms .. GOP/s (runs)
#include "ggml-alloc.h"
#include "ggml-backend.h"
#ifndef PEER_IK
#include "ggml-cpu.h"
#endif
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
        const char * n = ggml_type_name((ggml_type) i);
        if (n && strcmp(n, name) == 0) {
            return (ggml_type) i;
        }
    }
    fprintf(stderr, "ggml_moe: unknown ggml type %s\n", name);
    exit(2);
}

// The buffer type named, or null where this build has none of that name.
static ggml_backend_buffer_type_t buffer_type_named(ggml_backend_t be, const char * name) {
    if (strcmp(name, "CPU") == 0) {
        return ggml_backend_cpu_buffer_type();
    }
#ifndef PEER_IK
    ggml_backend_dev_t dev = ggml_backend_get_device(be);
    auto extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts");
    for (auto p = extra ? extra(dev) : nullptr; p && *p; p++) {
        if (strcmp(ggml_backend_buft_name(*p), name) == 0) {
            return *p;
        }
    }
#else
    (void) be;
#endif
    return nullptr;
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
    ggml_backend_buffer_type_t wbt = buffer_type_named(be, buft_name);
    if (!wbt) {
        fprintf(stderr, "ggml_moe: no buffer type %s in this build\n", buft_name);
        return 2;
    }
    const bool per_expert = strcmp(buft_name, "AMX") == 0;

    std::mt19937 rng(1);
    std::normal_distribution<float> g(0, 1);
    // Routings: K distinct random experts a token; where the tokens touch fewer pairs than there
    // are experts, a new routing each rep that sweeps the experts in turn (every expert once
    // before any again), so that decode reads its weights from DRAM as kt bench's does, not
    // from the cache (random picks would find a quarter of them there).
    const int routings = n * k < experts ? (experts + n * k - 1) / (n * k) : 1;
    std::vector<std::vector<int>> ids_of(routings, std::vector<int>((size_t) k * n));
    std::vector<int> perm(experts);
    for (int i = 0; i < experts; i++) {
        perm[i] = i;
    }
    for (int r = 0; r < routings; r++) {
        for (int j = 0; j < n; j++) {
            if (routings == 1) {
                std::shuffle(perm.begin(), perm.end(), rng);
            }
            for (int s = 0; s < k; s++) {
                ids_of[r][(size_t) j * k + s] = routings == 1 ? perm[s] : ((r * n + j) * k + s) % experts;
            }
        }
    }
    const std::vector<int> & id = ids_of[0];
    std::vector<float> x((size_t) cols * n);
    for (auto & v : x) {
        v = g(rng);
    }

    // Copies of the weights (layers) the reps rotate through where they sweep the experts: as
    // many as make 2.5 GB, the size of kt bench's DRAM probe here, since this VM's host caches
    // more than its L3 (a 113 MB working set would partly stay there).
    const size_t per = ggml_row_size(t, cols) * rows;
    const int layers = !per_expert && routings > 1 ? std::max<int>(1, (int) (2.5e9 / (double) (per * experts))) : 1;
    const size_t tensors = per_expert ? 3 * (size_t) experts + 16 : 16 + 2 * (size_t) layers;
    ggml_init_params ip = { tensors * ggml_tensor_overhead() + layers * ggml_graph_overhead(), nullptr, true };
    ggml_context * cw = ggml_init(ip);
    ggml_context * cx = ggml_init(ip);
    std::vector<ggml_cgraph *> graphs = { ggml_new_graph(cx) };
    ggml_cgraph * graph = graphs[0];
    // Weights: one [cols, rows, experts] tensor for MUL_MAT_ID, or one [cols, rows] per expert.
    std::vector<ggml_tensor *> ws, bs;
    std::vector<std::vector<float>> xs(experts);
    ggml_tensor * b = nullptr, * ids = nullptr;
    if (per_expert) {
        for (int j = 0; j < n; j++) {
            for (int s = 0; s < k; s++) {
                auto & xe = xs[id[(size_t) j * k + s]];
                xe.insert(xe.end(), x.begin() + (size_t) j * cols, x.begin() + (size_t) (j + 1) * cols);
            }
        }
        for (int e = 0; e < experts; e++) {
            ws.push_back(ggml_new_tensor_2d(cw, t, cols, rows));
            const int ne = (int) (xs[e].size() / cols);
            bs.push_back(ne ? ggml_new_tensor_2d(cx, GGML_TYPE_F32, cols, ne) : nullptr);
            if (ne) {
                ggml_build_forward_expand(graph, ggml_mul_mat(cx, ws[e], bs[e]));
            }
        }
    } else {
        b = ggml_new_tensor_3d(cx, GGML_TYPE_F32, cols, 1, n);
        ids = ggml_new_tensor_2d(cx, GGML_TYPE_I32, k, n);
        for (int l = 0; l < layers; l++) {
            ws.push_back(ggml_new_tensor_3d(cw, t, cols, rows, experts));
            if (l > 0) {
                graphs.push_back(ggml_new_graph(cx));
            }
            ggml_build_forward_expand(graphs[l], ggml_mul_mat_id(cx, ws[l], b, ids));
        }
    }
    ggml_backend_buffer_t bw = ggml_backend_alloc_ctx_tensors_from_buft(cw, wbt);
    ggml_backend_buffer_set_usage(bw, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_buffer_t bx = ggml_backend_alloc_ctx_tensors(cx, be);
    if (!bw || !bx) {
        fprintf(stderr, "ggml_moe: allocation failed\n");
        return 1;
    }

    // The repacking buffers take a tensor in one piece.
    // The lattice types (iq1_s, iq2_xxs, iq2_xs) take an importance matrix (all ones here) and
    // quantize slowly: a few experts are quantized and the rest copy them (what is timed reads
    // each expert's own bytes all the same).
    std::vector<float> f((size_t) cols * rows), ones(cols, 1.0f);
    std::vector<uint8_t> q(per * experts);
    const float * imatrix = ggml_quantize_requires_imatrix(t) ? ones.data() : nullptr;
    const int distinct = imatrix ? std::min(experts, 4) : experts;
    for (int e = 0; e < experts; e++) {
        for (auto & v : f) {
            v = 0.02f * g(rng);
        }
        if (e >= distinct) {
            memcpy(q.data() + e * per, q.data() + (e % distinct) * per, per);
        } else {
#ifdef PEER_IK
            ggml_quantize_chunk(t, f.data(), q.data() + e * per, 0, rows, cols, imatrix, nullptr);
#else
            ggml_quantize_chunk(t, f.data(), q.data() + e * per, 0, rows, cols, imatrix);
#endif
        }
        if (per_expert) {
            ggml_backend_tensor_set(ws[e], q.data() + e * per, 0, per);
        }
    }
    if (per_expert) {
        for (int e = 0; e < experts; e++) {
            if (bs[e]) {
                ggml_backend_tensor_set(bs[e], xs[e].data(), 0, xs[e].size() * sizeof(float));
            }
        }
    } else {
        for (auto * w : ws) {
            ggml_backend_tensor_set(w, q.data(), 0, q.size());
        }
        ggml_backend_tensor_set(b, x.data(), 0, x.size() * sizeof(float));
        ggml_backend_tensor_set(ids, id.data(), 0, id.size() * sizeof(int));
    }

    std::vector<double> ts;
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (ts.size() < 5 || std::chrono::steady_clock::now() < end) {
        if (!per_expert && routings > 1) {
            const auto & r = ids_of[ts.size() % routings];
            ggml_backend_tensor_set(ids, r.data(), 0, r.size() * sizeof(int));
        }
        const auto t0 = std::chrono::steady_clock::now();
        if (ggml_backend_graph_compute(be, graphs[ts.size() / routings % layers]) != GGML_STATUS_SUCCESS) {
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
