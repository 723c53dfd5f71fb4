"""The 8-bit blockwise quantization of optimizer_state='8bit' from Python
(zeroshard._core.quantize_8bit and friends): against an independent evaluation of the published
algorithm, and against bitsandbytes' quantize_blockwise where bitsandbytes is installed."""

import pytest

torch = pytest.importorskip("torch")

from zeroshard import _core  # noqa: E402
from zs_testutil import dynamic_code  # noqa: E402

BLOCKS = (256, 2048)


def ours(x, block, signed):
    n = x.numel()
    codes = torch.empty(n, dtype=torch.uint8)
    absmax = torch.empty((n + block - 1) // block, dtype=torch.float32)
    _core.quantize_8bit(x, codes, absmax, block, signed)
    back = torch.empty(n, dtype=torch.float32)
    _core.dequantize_8bit(codes, absmax, back, block, signed)
    return codes, absmax, back


def sample(signed, n=3 * 2048 + 77, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 1e-3
    x[100:140] = 0.0  # zeros inside a block
    x[2048:2048 + 256] = 0.0  # an all-zero block of 256
    return x if signed else x.abs()


@pytest.mark.parametrize("signed", [True, False])
def test_code_and_blocks_are_the_published_algorithm(signed):
    code, mid = dynamic_code(signed)
    assert torch.equal(torch.tensor(_core.dynamic_code_points(signed)), code)
    x = sample(signed)
    for block in BLOCKS:
        codes, absmax, back = ours(x, block, signed)
        for b in range(0, x.numel(), block):
            xb = x[b:b + block]
            am = xb.abs().max()
            assert absmax[b // block] == am
            if am == 0:
                want = torch.full_like(codes[b:b + block], int(torch.nonzero(code == 0)))
            else:  # the count of midpoints below x * (1 / absmax): the nearest code point
                want = torch.searchsorted(mid, xb * (torch.tensor(1.0) / am)).to(torch.uint8)
            assert torch.equal(codes[b:b + block], want), (block, b)
        assert torch.equal(back, code[codes.long()] * absmax.repeat_interleave(block)[:x.numel()])


def test_bad_arrays_are_refused_with_their_names():
    x = torch.zeros(10)
    with pytest.raises(_core.InvalidArgumentError, match="codes has 9 elements"):
        _core.quantize_8bit(x, torch.empty(9, dtype=torch.uint8), torch.empty(1), 16, True)
    with pytest.raises(_core.InvalidArgumentError, match="codes must have 1-byte"):
        _core.quantize_8bit(x, torch.empty(10), torch.empty(1), 16, True)
    with pytest.raises(_core.InvalidArgumentError, match="absmax has 1 elements, not 2"):
        _core.quantize_8bit(x, torch.empty(10, dtype=torch.uint8), torch.empty(1), 8, True)
    with pytest.raises(_core.InvalidArgumentError, match="block must be at least 1"):
        _core.quantize_8bit(x, torch.empty(10, dtype=torch.uint8), torch.empty(1), 0, True)


@pytest.mark.parametrize("signed", [True, False])
def test_against_bitsandbytes(signed):
    # bitsandbytes builds the same map, but from f32 means scaled in double and rounded again,
    # so a point may differ from ours by up to 2 ulps (measured: 72 signed points by 1 ulp, 100
    # unsigned by 1 or 2). Its CPU quantize_blockwise snaps x * (1 / absmax) to a grid of 65536
    # steps over [-1, 1] before it looks up the nearest code, so it picks the nearest code of a
    # value within d = 1 / 65535 of x's (and maps 0 to the point nearest 0 on that grid, not to
    # 0). Ours is the nearest code of the value itself. Bounds per element, from those facts
    # (e = |dequantized - x| / absmax; u = 2^-21 covers the tables' 2 ulps and the rounding of
    # each code x absmax product):
    #   e_ours <= e_bnb + u          (ours is the nearest)
    #   e_bnb  <= e_ours + 2 d + u   (bnb's is the nearest of a value d away)
    # and the absmax arrays are equal (max |x| per block on both sides).
    bnb = pytest.importorskip("bitsandbytes")
    F = bnb.functional
    theirs_code = F.create_dynamic_map(signed=signed).float()
    code, _ = dynamic_code(signed)
    ulps = (theirs_code.view(torch.int32).long() - code.view(torch.int32).long()).abs()
    assert ulps.max() <= 2
    u = 2.0 ** -21
    x = sample(signed)
    d = 1.0 / 65535
    for block in BLOCKS:
        codes, absmax, back = ours(x, block, signed)
        q, state = F.quantize_blockwise(x, code=theirs_code, blocksize=block)
        theirs = F.dequantize_blockwise(q, state)
        assert torch.equal(state.absmax.float(), absmax)
        am = absmax.repeat_interleave(block)[:x.numel()].clamp(min=1e-30)
        e_ours = ((back - x).abs() / am).double()
        e_bnb = ((theirs - x).abs() / am).double()
        assert (e_ours <= e_bnb + u).all()
        assert (e_bnb <= e_ours + 2 * d + u).all()
        nz = x != 0
        same = (q.flatten() == codes)[nz].double().mean().item()
        print(f"signed={signed} block={block}: codes of nonzero x equal to bitsandbytes' "
              f"{same:.4%}; mean error / absmax ours {e_ours.mean():.4e}, bitsandbytes "
              f"{e_bnb.mean():.4e}; zeros: ours {e_ours[~nz].max():.1e}, bitsandbytes "
              f"{e_bnb[~nz].max():.1e}")
