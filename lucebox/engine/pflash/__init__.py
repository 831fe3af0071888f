"""PFlash speculative prefill (lossy, off by default): a small scorer model reads the whole prompt,
scores each token by the attention its last queries pay it (score.py), the best 32-token chunks are
kept (select.py), and the target prefills only those, at their original RoPE positions (positions.py).
"""
