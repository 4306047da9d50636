"""kimi-convert: stream a sharded safetensors MoE checkpoint into a pre-packed NVFP4 checkpoint.

Data flow, one module per stage: ``source`` (read headers, config, memory-mapped tensors) ->
``plan`` (pure: what goes where, no tensor data) -> ``compute`` (fuse, decode, quantize with
``kimi_convert.kernels``) -> ``write`` (shards, index, configs) and ``manifest``.
"""

import os

__version__ = "0.1.0"

# numpy's OpenBLAS starts a thread for each CPU when numpy is imported, and each spins for about 0.1 s of CPU before it
# sleeps; nothing here calls numpy's BLAS (the kernels are C, Triton or torch), so on 2 CPUs that spin only takes CPU
# from the start-up's reads and hashes (benchmarks/RESULTS.md, issue 38's session 33 section). Set before any module
# of the package imports numpy; a value the user set stands.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
