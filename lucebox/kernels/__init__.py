"""Ops: a plain-torch reference per op, with faster device kernels dispatched from the same module."""
