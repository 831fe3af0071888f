"""Text in and out: tokenizers, GGUF vocabularies, chat templates and stop strings."""
