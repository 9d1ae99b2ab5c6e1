// llama.cpp's intermediate tensors of one llama_decode, for benchmarks/fidelity/compare_tensors.py.
//   dump_tensors MODEL OUTDIR FLASH(0|1) N_THREADS TOKEN...
// One llama_decode of the tokens (n_ctx = n_batch = n_ubatch = 512, f16 K/V cache, every logit
// requested) with an eval callback that writes every contiguous f32 graph node to
// OUTDIR/NNNN_<name>.f32 (raw little-endian floats, ggml's [ne0, ne1, ...] order) and lists
// them in OUTDIR/index.txt ("NNNN name op ne0 ne1 ne2 ne3"; non-f32 or strided nodes as
// "skip name type"), then the logits [n_tokens, n_vocab] to OUTDIR/logits.f32.
// Build (against the llama.cpp build the comparison is made with):
//   g++ -O2 -std=c++17 -I$LLAMA/include -I$LLAMA/ggml/include benchmarks/fidelity/dump_tensors.cpp \
//       -o dump_tensors -L$LLAMA/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$LLAMA/build/bin
#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

static std::string g_dir;
static int g_count = 0;
static FILE * g_index = nullptr;

static bool on_tensor(struct ggml_tensor * t, bool ask, void *) {
    if (ask) return true;  // yes, every node
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) {
        fprintf(g_index, "skip %s %s\n", t->name, ggml_type_name(t->type));
        return true;
    }
    std::vector<float> buf(ggml_nelements(t));
    ggml_backend_tensor_get(t, buf.data(), 0, ggml_nbytes(t));
    std::string name(t->name);
    for (auto & c : name) if (c == ' ' || c == '/' || c == '(' || c == ')') c = '_';
    char path[1024];
    snprintf(path, sizeof path, "%s/%04d_%s.f32", g_dir.c_str(), g_count, name.c_str());
    FILE * f = fopen(path, "wb");
    fwrite(buf.data(), sizeof(float), buf.size(), f);
    fclose(f);
    fprintf(g_index, "%04d %s %s %lld %lld %lld %lld\n", g_count, name.c_str(), ggml_op_desc(t), (long long) t->ne[0],
            (long long) t->ne[1], (long long) t->ne[2], (long long) t->ne[3]);
    g_count++;
    return true;
}

int main(int argc, char ** argv) {
    if (argc < 6) { fprintf(stderr, "usage: %s MODEL OUTDIR FLASH(0|1) N_THREADS TOKEN...\n", argv[0]); return 2; }
    g_dir = argv[2];
    const int flash = atoi(argv[3]), n_threads = atoi(argv[4]);
    std::vector<llama_token> toks;
    for (int i = 5; i < argc; i++) toks.push_back(atoi(argv[i]));
    g_index = fopen((g_dir + "/index.txt").c_str(), "w");
    if (!g_index) { fprintf(stderr, "cannot write %s/index.txt\n", g_dir.c_str()); return 1; }
    llama_backend_init();
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512; cp.n_batch = 512; cp.n_ubatch = 512;
    cp.n_threads = n_threads; cp.n_threads_batch = n_threads;
    cp.flash_attn_type = flash ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.cb_eval = on_tensor;
    cp.cb_eval_user_data = nullptr;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "context failed\n"); return 1; }
    const int n = (int) toks.size();
    llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = toks[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1;
    }
    b.n_tokens = n;
    if (llama_decode(ctx, b)) { fprintf(stderr, "decode failed\n"); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE * f = fopen((g_dir + "/logits.f32").c_str(), "wb");
    for (int i = 0; i < n; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, f);
    fclose(f);
    fclose(g_index);
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
