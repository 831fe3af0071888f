"""Checkpoint loading: safetensors and GGUF readers, quantised tensor types."""
