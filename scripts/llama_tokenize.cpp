// llama.cpp's token ids of a text (special tokens parsed, <bos> as the vocabulary says), one line; the
// end-of-generation ids on stderr ("eog ID" lines):
//     llama-tokenize MODEL.gguf TEXT
// Build as scripts/llama_logits.cpp. Used to check lucebox's gemma4 vocabularies (2026-12-04: llama.cpp's
// ids equal the HF tokenizer's and lucebox's GGUF tokenizer's on tests/text/test_gguf_gemma4_vocab.py's
// texts, and its end tokens are lucebox's: <eos>, <turn|>, <|tool_response>).
#include "llama.h"
#include <cstdio>
#include <cstring>
#include <vector>
int main(int argc, char ** argv) {
    if (argc != 3) { fprintf(stderr, "usage: %s MODEL.gguf TEXT\n", argv[0]); return 1; }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 2; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::vector<llama_token> ids(strlen(argv[2]) + 8);
    int n = llama_tokenize(vocab, argv[2], strlen(argv[2]), ids.data(), ids.size(), true, true);
    for (int i = 0; i < n; i++) printf("%d%c", ids[i], i + 1 < n ? ' ' : '\n');
    for (int i = 0; i < llama_vocab_n_tokens(vocab); i++) {
        if (llama_vocab_is_eog(vocab, i)) fprintf(stderr, "eog %d\n", i);
    }
    return n < 0 ? 3 : 0;
}
