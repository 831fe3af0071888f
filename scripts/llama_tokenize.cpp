// llama.cpp's tokenization of stdin's text with a GGUF's vocabulary (special tokens parsed), ids on one line:
//     llama-tokenize MODEL.gguf < TEXT
// Used by scripts/check_gguf_laguna.py --llama-tokenize; built like scripts/llama_logits.cpp.
#include "llama.h"
#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>
int main(int argc, char ** argv) {
    if (argc != 2) { fprintf(stderr, "usage: %s MODEL.gguf < TEXT\n", argv[0]); return 1; }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 2; }
    std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    std::vector<llama_token> ids(text.size() + 16);
    int n = llama_tokenize(llama_model_get_vocab(model), text.data(), text.size(), ids.data(), ids.size(), false, true);
    if (n < 0) { fprintf(stderr, "tokenize failed\n"); return 3; }
    for (int i = 0; i < n; i++) printf("%d%c", ids[i], i + 1 < n ? ' ' : '\n');
    return 0;
}
