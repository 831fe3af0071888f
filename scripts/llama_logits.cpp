// llama.cpp's logits at every position of a token sequence, one line of floats per position:
//     llama-logits MODEL.gguf TOKEN_ID...      (STEP=1: one token per decode, the recurrent path)
// Used by scripts/check_gguf_hybrid.py --llama-logits. Build against a CPU build of llama.cpp (the tree
// that scripts/build_llama_cpp.sh unpacks, configured with -DGGML_CUDA=OFF):
//     g++ -O1 -std=c++17 scripts/llama_logits.cpp -I$SRC/include -I$SRC/ggml/include -o llama-logits \
//         $BUILD/src/libllama.a $BUILD/ggml/src/libggml.a $BUILD/ggml/src/libggml-cpu.a \
//         $BUILD/ggml/src/libggml-base.a -fopenmp -lpthread -ldl
// KV cache in F32 and one thread, so the numbers are llama.cpp's graph and nothing else.
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <vector>
int main(int argc, char ** argv) {
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.use_extra_bufts = false;  // CPU repacking crashes on these tiny Q8_0 shapes
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 2; }
    int n = argc - 2;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256; cp.n_batch = 256; cp.n_ubatch = 256; cp.n_threads = 1; cp.n_threads_batch = 1; cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32;
    if (getenv("NOFA")) cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;  // CPU flash attention rounds (~0.002)
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "ctx failed\n"); return 3; }
    int V = llama_vocab_n_tokens(llama_model_get_vocab(model));
    bool step = getenv("STEP") != nullptr;  // one token per decode: the recurrent (autoregressive) path
    llama_batch b = llama_batch_init(n, 0, 1);
    for (int start = 0; start < n; start += step ? 1 : n) {
        int m = step ? 1 : n;
        for (int i = 0; i < m; i++) {
            b.token[i] = atoi(argv[start + i + 2]); b.pos[i] = start + i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0;
            b.logits[i] = 1;
        }
        b.n_tokens = m;
        if (llama_decode(ctx, b)) { fprintf(stderr, "decode failed\n"); return 4; }
        for (int i = 0; i < m; i++) {
            float * l = llama_get_logits_ith(ctx, i);
            for (int v = 0; v < V; v++) printf("%.7g%c", l[v], v + 1 < V ? ' ' : '\n');
        }
    }
    return 0;
}
