// llama.cpp's outputs on a token sequence, as JSON on stdout (tests/refgen/make_odd_shape_refs.py).
//   tokens_ref MODEL N_GEN TOKEN_ID...
// One llama_decode of the tokens with every logit requested (n_ctx 512, n_batch = n_ubatch = 512,
// F32 K/V cache, flash attention off, 1 thread: the tiny references' settings), then the top-10
// log-probs (log-softmax over the whole vocabulary, in double) of every position, then N_GEN
// greedy tokens, one llama_decode each.
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <vector>

static void top10(const float * logits, int n_vocab, bool comma) {
    double m = -INFINITY;
    for (int i = 0; i < n_vocab; i++) m = std::max(m, (double) logits[i]);
    double s = 0.0;
    for (int i = 0; i < n_vocab; i++) s += std::exp((double) logits[i] - m);
    const double lse = m + std::log(s);
    std::vector<int> idx(n_vocab);
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + 10, idx.end(), [&](int a, int b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    printf("%s[", comma ? "," : "");
    for (int k = 0; k < 10; k++) printf("%s[%d,%.9g]", k ? "," : "", idx[k], (double) logits[idx[k]] - lse);
    printf("]");
}

static int argmax(const float * logits, int n_vocab) {
    int best = 0;
    for (int i = 1; i < n_vocab; i++) if (logits[i] > logits[best]) best = i;
    return best;
}

int main(int argc, char ** argv) {
    if (argc < 4) { fprintf(stderr, "usage: %s MODEL N_GEN TOKEN...\n", argv[0]); return 2; }
    const int n_gen = atoi(argv[2]);
    std::vector<llama_token> toks;
    for (int i = 3; i < argc; i++) toks.push_back(atoi(argv[i]));
    llama_backend_init();
    if (!getenv("TOKENS_REF_LOG")) llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512; cp.n_batch = 512; cp.n_ubatch = 512; cp.n_threads = 1; cp.n_threads_batch = 1;
    cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "context failed\n"); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const int n = (int) toks.size();
    llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = toks[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1;
    }
    b.n_tokens = n;
    if (llama_decode(ctx, b)) { fprintf(stderr, "decode failed\n"); return 1; }
    printf("{\"positions\":[");
    for (int i = 0; i < n; i++) top10(llama_get_logits_ith(ctx, i), n_vocab, i > 0);
    printf("],\"greedy\":[");
    int tok = argmax(llama_get_logits_ith(ctx, n - 1), n_vocab);
    for (int g = 0; g < n_gen; g++) {
        printf("%s%d", g ? "," : "", tok);
        if (g + 1 == n_gen) break;
        llama_batch one = llama_batch_get_one(&tok, 1);
        if (llama_decode(ctx, one)) { fprintf(stderr, "decode failed\n"); return 1; }
        tok = argmax(llama_get_logits_ith(ctx, -1), n_vocab);
    }
    printf("]}\n");
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
