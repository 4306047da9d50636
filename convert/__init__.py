"""kimi-convert: stream a sharded safetensors MoE checkpoint into a pre-packed NVFP4 checkpoint.

Data flow, one module per stage: ``source`` (read headers, config, memory-mapped tensors) ->
``plan`` (pure: what goes where, no tensor data) -> ``compute`` (fuse, decode, quantize with
``kimi_convert.kernels``) -> ``write`` (shards, index, configs) and ``manifest``.
"""

__version__ = "0.1.0"
