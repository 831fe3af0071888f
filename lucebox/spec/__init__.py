"""Speculative decoding: proposers (DFlash, draft model, n-gram), verification, adaptive draft length."""
