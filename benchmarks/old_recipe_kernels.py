"""Session 5's MXFP4 -> NVFP4 cast kernel (kernels/recipe_triton.py at commit 0c546a9), kept only so that
benchmarks/recipe_kernels.py --variants times it beside the current kernels in the same run (the pipeline never
calls it). Tiles of BLOCK_R rows x BLOCK_B 32-blocks; the flag over the tile's E8M0 bytes decides, before the codes
are loaded, between the closed form and the long path (a row at a time); one atomic_add a program for the count."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimi_convert.kernels.recipe_triton import _cast_codes, _cast_scale


@triton.jit
def _cast_tile_kernel(p_ptr, e_ptr, out_ptr, sb_ptr, count_ptr, R, KB, own, shared, BLOCK_R: tl.constexpr,
                 BLOCK_B: tl.constexpr, ROWWISE: tl.constexpr):
    """p_ptr / out_ptr: codes as int32 words [R, 4 KB]; e_ptr: E8M0 bytes [R, KB]; sb_ptr: e4m3 byte pairs as
    int16 [R, KB] (both 16-blocks of a 32-block share their scale); count_ptr: int32 lossless count.
    ROWWISE: a tile with a block off the closed form is computed a row at a time (compiled kernels), else at once
    (the interpreter); the same functions of the same values either way."""
    pid_r = tl.program_id(0)
    pid_b = tl.program_id(1)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    blk = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    mask2 = (rows[:, None] < R) & (blk[None, :] < KB)
    e = tl.load(e_ptr + rows[:, None] * KB + blk[None, :], mask=mask2, other=0).to(tl.int32)
    widx = (rows[:, None] * KB + blk[None, :])[:, :, None] * 4 + tl.arange(0, 4)[None, None, :]
    k = e - 127
    m = shared - 8
    kmm = k - m
    in_range = (k >= own - 17) & (k <= own)
    # closed form: a power-of-two scale 2^(k-m) in e4m3's range, codes kept with -0 made 0
    fast = in_range & (e > 0) & (kmm >= -9) & (kmm <= 8) & (k < 126)
    byte = tl.where(kmm >= -6, (kmm + 7) << 3, tl.where(kmm == -7, 4, tl.where(kmm == -8, 2, 1)))
    slow = tl.max(tl.max(((~fast) & mask2).to(tl.int32), axis=1), axis=0)
    if slow == 0:
        w = tl.load(p_ptr + widx, mask=mask2[:, :, None], other=0)
        z = ((w & 0x77777777) + 0x77777777) & -0x77777778  # bit 3 of each nibble: its magnitude is not 0
        tl.store(out_ptr + widx, w & (z | 0x77777777), mask=mask2[:, :, None])
        tl.store(sb_ptr + rows[:, None] * KB + blk[None, :], (byte | (byte << 8)).to(tl.int16), mask=mask2)
    elif ROWWISE:  # the long way, a row at a time (few registers: the fast path keeps the occupancy)
        shifts = (tl.arange(0, 8) * 4)[None, None, :]
        for i in range(BLOCK_R):
            row = pid_r.to(tl.int64) * BLOCK_R + i
            bmask = blk < tl.where(row < R, KB, 0)
            er = tl.load(e_ptr + row * KB + blk, mask=bmask, other=0).to(tl.int32)
            kr = er - 127
            kmr = kr - m
            widr = (row * KB + blk)[:, None] * 4 + tl.arange(0, 4)[None, :]
            wmask = bmask[:, None] & (tl.arange(0, 4) < 4)[None, :]
            wr = tl.load(p_ptr + widr, mask=wmask, other=0)
            c = (wr[:, :, None] >> shifts) & 15  # [BLOCK_B, 4, 8]: the 32 codes of each block
            mx = tl.max(tl.max(c & 7, axis=2), axis=1)
            sbv, br, exact = _cast_scale(er, kr, kmr, (kr >= own - 17) & (kr <= own), mx)
            codes = _cast_codes(c, kr[:, None, None], kmr[:, None, None], sbv[:, None, None], m)
            zr = ((wr & 0x77777777) + 0x77777777) & -0x77777778
            outr = tl.where(exact[:, None], wr & (zr | 0x77777777), tl.sum(codes << shifts, axis=2))
            tl.store(out_ptr + widr, outr, mask=wmask)
            tl.store(sb_ptr + row * KB + blk, (br | (br << 8)).to(tl.int16), mask=bmask)
    lossless = ((k >= shared - 17) | (e == 0)) & mask2
    tl.atomic_add(count_ptr, tl.sum(tl.sum(lossless.to(tl.int32), axis=1), axis=0))


def launch_cast_tiled(packed, scale, out, sb, count, own: int, shared: int, tile=(32, 16, 4)) -> None:
    """The old kernel (compiled only): 2-D contiguous operands, ``count`` (int32 [1]) zeroed by the caller."""
    br, bb, warps = tile
    rows, kb = scale.shape
    grid = (triton.cdiv(rows, br), triton.cdiv(kb, bb))
    _cast_tile_kernel[grid](packed.view(torch.int32), scale, out.view(torch.int32), sb.view(torch.int16), count,
                            rows, kb, own, shared, BLOCK_R=br, BLOCK_B=bb, ROWWISE=True, num_warps=warps)
