"""Check the Triton kernel's fast division against the full IEEE division on the GPU, exhaustively
over x: every finite bf16 value, for ~1M divisors d = v * s2 (every e4m3 block scale v in
[2^-9, 448] times random global scales s2 across [2^-80, 2^80], the range the fast path serves).

Counted for quotients up to 2^22 (a real one is at most amax / (2^-9 s2) = 2688 * 512 < 2^21),
tiny ones (sign only) included.

    python benchmarks/gpu_division_check.py [N]   # N random global scales (default 8192)

Prints how many E2M1 codes (sign included) differ: must be 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_convert.kernels.nvfp4_triton import _e2m1, _fast_code

X_BLOCK = 4096


@triton.jit
def _check(d_ptr, bad_code_ptr, XB: tl.constexpr):
    d = tl.load(d_ptr + tl.program_id(0))
    r = tl.math.div_rn(1.0, d)
    d_low = d * 9.313225746154785e-10
    bad_c = 0
    for start in range(0, 65536, XB):
        bits = start + tl.arange(0, XB)
        x = (bits << 16).to(tl.float32, bitcast=True)
        finite = (bits & 0x7F80) != 0x7F80
        exact = tl.math.div_rn(x, d)
        used = finite & (tl.abs(exact) <= 4194304.0)
        bad_c += tl.sum((used & (_e2m1(exact) != _fast_code(x, d * 0.25, r * 4.0, d_low))).to(tl.int32))
    tl.store(bad_code_ptr + tl.program_id(0), bad_c)


def divisors(n_s2: int) -> torch.Tensor:
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[(e4m3 >= 2.0**-9) & (e4m3 <= 448)]
    g = torch.Generator().manual_seed(0)
    s2 = torch.ldexp(1 + torch.rand(n_s2, generator=g), torch.randint(-80, 80, (n_s2,), generator=g).float())
    s2 = torch.cat([s2, torch.ldexp(torch.ones(161), torch.arange(-80, 81).float())])  # powers of two too
    return (e4m3[:, None] * s2[None, :]).reshape(-1).float()


def mismatches(d: torch.Tensor) -> int:
    """How many E2M1 codes of every finite bf16 value over each divisor of ``d`` (fp32, on the GPU; on the CPU
    under TRITON_INTERPRET=1: tests/test_gpu.py) differ from the IEEE division's."""
    bad_c = torch.zeros(d.numel(), dtype=torch.int32, device=d.device)
    _check[(d.numel(),)](d, bad_c, XB=X_BLOCK, enable_fp_fusion=False)
    return int(bad_c.sum())


def main() -> None:
    import sys

    d = divisors(int(sys.argv[1]) if len(sys.argv) > 1 else 8192).cuda()
    bad = mismatches(d)
    n = d.numel() * 65536
    print(f"{d.numel()} divisors x 65536 bf16 values = {n / 1e9:.1f}G quotients: {bad} E2M1 codes differ from "
          "div_rn's")


if __name__ == "__main__":
    main()
