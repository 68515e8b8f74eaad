// The parts of BLIS's API that are inline functions or macros in blis.h, as symbols Rust can
// call: the context of the running CPU's configuration, its native f32 microkernel and block
// sizes, and one microkernel call with its auxiliary information set up.
#include <stdlib.h>
#include <string.h>

#include <blis.h>

typedef void (*kt_sgemm_ukr_t)(dim_t m, dim_t n, dim_t k, float* alpha, float* a, float* b, float* beta, float* c,
                               inc_t rs_c, inc_t cs_c, auxinfo_t* data, cntx_t* cntx);

const char* kt_blis_version(void) { return bli_info_get_version_str(); }

// The configuration BLIS_ARCH_TYPE forces, read as BLIS reads it (strtol), without asking BLIS
// to take it: NULL where it forces none (unset or -1), "" where the id is past BLIS's list
// (BLIS would abort), else the configuration's name.
const char* kt_blis_forced_arch(void) {
    const char* s = getenv("BLIS_ARCH_TYPE");
    long id = s == NULL ? -1 : strtol(s, NULL, 10);
    if (id == -1) return NULL;
    if (id < 0 || id >= BLIS_NUM_ARCHS) return "";
    return bli_arch_string((arch_t)id);
}

const char* kt_blis_arch(void) { return bli_arch_string(bli_arch_query_id()); }

// The running configuration's context, its f32 microkernel and MR, NR, KC; returns 0 where
// BLIS has no context here.
int kt_blis_query(void** cntx_out, void** ukr_out, long* mr, long* nr, long* kc, int* row_pref) {
    cntx_t* cntx = bli_gks_query_cntx();
    if (cntx == NULL) return 0;
    *cntx_out = cntx;
    *ukr_out = (void*)bli_cntx_get_l3_nat_ukr_dt(BLIS_FLOAT, BLIS_GEMM_UKR, cntx);
    *mr = (long)bli_cntx_get_blksz_def_dt(BLIS_FLOAT, BLIS_MR, cntx);
    *nr = (long)bli_cntx_get_blksz_def_dt(BLIS_FLOAT, BLIS_NR, cntx);
    *kc = (long)bli_cntx_get_blksz_def_dt(BLIS_FLOAT, BLIS_KC, cntx);
    *row_pref = bli_cntx_get_l3_nat_ukr_prefs_dt(BLIS_FLOAT, BLIS_GEMM_UKR, cntx) ? 1 : 0;
    return *ukr_out != NULL && *mr > 0 && *nr > 0 && *kc > 0;
}

// c[m×n] (row stride rs_c, column stride cs_c) = beta·c + a·b over k: `a` an MR-row micropanel
// (MR values per k), `b` an NR-column one (NR values per k), as BLIS packs them.
void kt_blis_sgemm(void* ukr, void* cntx, long m, long n, long k, const float* a, const float* b, float beta,
                   float* c, long rs_c, long cs_c, const float* next_a, const float* next_b) {
    float one = 1.0f;
    auxinfo_t aux;
    memset(&aux, 0, sizeof aux);
    bli_auxinfo_set_next_a((void*)next_a, &aux);
    bli_auxinfo_set_next_b((void*)next_b, &aux);
    bli_auxinfo_set_is_a(1, &aux);
    bli_auxinfo_set_is_b(1, &aux);
    bli_auxinfo_set_ps_a(0, &aux);
    bli_auxinfo_set_ps_b(0, &aux);
    bli_auxinfo_set_ukr(NULL, &aux);
    bli_auxinfo_set_params(NULL, &aux);
    ((kt_sgemm_ukr_t)ukr)((dim_t)m, (dim_t)n, (dim_t)k, &one, (float*)a, (float*)b, &beta, c, (inc_t)rs_c,
                          (inc_t)cs_c, &aux, (cntx_t*)cntx);
}

// BLIS's own sgemm, c[m×n] = a[m×k] · b[n×k]ᵀ (all row-major), on `threads` of BLIS's threads:
// what `kt bench` compares the blis backend with.
void kt_blis_sgemm_full(long m, long n, long k, const float* a, const float* b, float* c, long threads) {
    float one = 1.0f, zero = 0.0f;
    bli_thread_set_num_threads((dim_t)threads);
    bli_sgemm(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, (dim_t)m, (dim_t)n, (dim_t)k, &one, (float*)a, (inc_t)k, 1,
              (float*)b, 1, (inc_t)k, &zero, c, (inc_t)n, 1);
    bli_thread_set_num_threads(1);
}
