"""A source encoding that is not built in, written as a new encoding is: one module, the interface of
``kimi_convert.encodings.base`` and nothing else (tests/test_encodings.py registers it). A 2-D weight
stored transposed: ``<module>.weight_t`` [K, N] holds the logical ``<module>.weight`` [N, K]."""

from __future__ import annotations

from kimi_convert.encodings.base import Claim, SourceEncoding, SourceTensor, module_of, refused


class Transposed(SourceEncoding):
    name = "transposed"
    label = "transposed BF16"
    anchors = frozenset({"weight_t"})

    def claim(self, name, tensors, config):
        mod, _ = module_of(name)
        t = tensors[name]
        self.check((t,), config)
        return (Claim(mod, "weight", SourceTensor(mod, f"{mod}.weight", self.name, t.dtype, t.shape[::-1], (t,))),)

    def check(self, parts, config):
        (t,) = parts
        if len(t.shape) != 2 or t.dtype != "BF16":
            raise refused(t, f"a transposed weight must be BF16 [K, N], is {t.dtype}{list(t.shape)}")

    def decode(self, src, parts, block):
        return parts[0].t().contiguous()  # exact: the stored BF16 values, rows and columns swapped
