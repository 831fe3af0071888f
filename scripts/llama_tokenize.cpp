// llama.cpp's token ids of stdin's text with a GGUF's vocabulary (special tokens parsed), one line on stdout;
// with --bos, <bos> added as the vocabulary says; the end-of-generation ids on stderr ("eog ID" lines):
//     llama-tokenize MODEL.gguf [--bos] < TEXT
// Built like scripts/llama_logits.cpp; used by scripts/check_gguf_laguna.py --llama-tokenize and to check the
// gemma4 vocabularies (llama.cpp's ids and end tokens equal lucebox's: tests/text/test_gguf_gemma4_vocab.py).
#include "llama.h"
#include <cstdio>
#include <cstring>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>
int main(int argc, char ** argv) {
    bool bos = argc == 3 && strcmp(argv[2], "--bos") == 0;
    if (argc != 2 && !bos) { fprintf(stderr, "usage: %s MODEL.gguf [--bos] < TEXT\n", argv[0]); return 1; }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 2; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    std::vector<llama_token> ids(text.size() + 16);
    int n = llama_tokenize(vocab, text.data(), text.size(), ids.data(), ids.size(), bos, true);
    if (n < 0) { fprintf(stderr, "tokenize failed\n"); return 3; }
    for (int i = 0; i < n; i++) printf("%d%c", ids[i], i + 1 < n ? ' ' : '\n');
    for (int i = 0; i < llama_vocab_n_tokens(vocab); i++) {
        if (llama_vocab_is_eog(vocab, i)) fprintf(stderr, "eog %d\n", i);
    }
    return 0;
}
