"""KVFlash: a bounded set of resident KV blocks per sequence, the rest backed in host memory.

view.py        KVView: the resident blocks of a sequence's block table as attention reads them
choose.py      which chunks stay resident (sinks, tail, best scores)
score.py       chunk scores: mean-pooled keys per chunk against the latest queries
host_store.py  host copies of whole KV blocks (every cache type), async on CUDA
The engine's KVPool (engine/kv_pool.py) ties them to the block pool and the step plan.
"""
