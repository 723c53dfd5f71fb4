"""The 8-bit blockwise quantization of optimizer_state='8bit' from Python
(zeroshard._core.quantize_8bit and friends): against an independent evaluation of its definition
(zeroshard/quantize.hpp), and against bitsandbytes' quantize_blockwise where bitsandbytes is
installed."""

import pytest

torch = pytest.importorskip("torch")

from zeroshard import _core  # noqa: E402
from zs_testutil import code_8bit, codes_8bit  # noqa: E402

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
def test_code_and_blocks_are_the_definition(signed):
    points, _, _ = code_8bit(signed)
    assert torch.equal(torch.tensor(_core.code_points_8bit(signed)), points)
    x = sample(signed)
    for block in BLOCKS:
        codes, absmax, back = ours(x, block, signed)
        for b in range(0, x.numel(), block):
            xb = x[b:b + block]
            am = xb.abs().max()
            assert absmax[b // block] == am
            if am == 0:
                want = torch.zeros_like(codes[b:b + block])
            else:
                want = codes_8bit(xb * (torch.tensor(1.0) / am), signed)
            assert torch.equal(codes[b:b + block], want), (block, b)
        assert torch.equal(back, points[codes.long()] * absmax.repeat_interleave(block)[:x.numel()])
        # A dequantized block comes back as the same codes and absmax.
        again, absmax2, _ = ours(back, block, signed)
        assert torch.equal(again, codes) and torch.equal(absmax2, absmax)


@pytest.mark.parametrize("signed", [True, False])
def test_the_edges_of_the_code(signed):
    """Ties, the smallest point and half of it, values below it, the top, NaN: in a block whose
    absmax is 1, so each value is its own normalised value."""
    _, mags, mid = code_8bit(signed)
    f32 = torch.float32
    tiny = mags[1].item()
    vals = [1.0, mid[-1].item(), mid[40].item(), tiny, tiny / 2,
            torch.nextafter(torch.tensor(tiny / 2), torch.tensor(0.0)).item(), tiny / 4, 0.0,
            1e-40, float("nan")]
    x = torch.tensor(vals, dtype=f32)
    codes, absmax, back = ours(x, 16, signed)
    assert absmax.item() == 1.0
    top = 127 if signed else 255
    assert codes.tolist() == [top, top, 41, 1, 1, 0, 0, 0, 0, top]
    if signed:
        neg, _, _ = ours(-x, 16, True)
        assert neg.tolist()[:-1] == [c + 128 if c else 0 for c in codes.tolist()[:-1]]
    # Each value's point is within half a step: 1/16 of its binade's lowest point.
    assert ((back[:4] - x[:4]).abs() <= x[:4] / 16).all()


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
    # bitsandbytes stores the dynamic map of "8-bit Optimizers via Block-wise Quantization": 7
    # decimal exponents, and in the top decade [0.1, 1] 64 (signed) or 128 evenly spaced
    # points, fewer below; its CPU path also snaps x / absmax to a grid of 65536 steps first.
    # Ours has 8 points per binade everywhere. So near a block's absmax theirs is finer (about
    # 1.4 % mean relative error against our 2.2 %), and below a thousandth of it ours is: what
    # matters for a second moment, whose square root divides the step. What this bounds, on
    # gradient-like data (normal; for the unsigned code, absolute values, and squares as a
    # second moment's are):
    #   - both absmax arrays are max |x| per block, equal;
    #   - ours is within 1/16 of each value from our smallest point up (half a step);
    #   - below a thousandth of the absmax, ours has the smaller mean relative error.
    bnb = pytest.importorskip("bitsandbytes")
    F = bnb.functional
    _, mags, _ = code_8bit(signed)
    x = sample(signed)
    datasets = {"normal": x} if signed else {"|normal|": x, "normal^2": x * x / 1e-3}
    for name, x in datasets.items():
        for block in BLOCKS:
            codes, absmax, back = ours(x, block, signed)
            q, state = F.quantize_blockwise(x, code=F.create_dynamic_map(signed=signed),
                                            blocksize=block)
            theirs = F.dequantize_blockwise(q, state)
            assert torch.equal(state.absmax.float(), absmax)
            am = absmax.repeat_interleave(block)[:x.numel()]
            nz = x != 0
            rel = (x.abs() / am.clamp(min=1e-30)).double()
            big = nz & (rel >= mags[1])
            assert ((back - x).abs()[big] <= x.abs()[big] / 16).all()
            r_ours = ((back - x).abs() / x.abs().clamp(min=1e-30)).double()
            r_bnb = ((theirs - x).abs() / x.abs().clamp(min=1e-30)).double()
            bands = [(0.1, 2.0), (0.01, 0.1), (1e-3, 0.01), (0.0, 1e-3)]
            row = []
            for lo, hi in bands:
                sel = nz & (rel >= lo) & (rel < hi)
                row.append(f"[{lo:g}, {hi:g}): {int(sel.sum())} values, ours "
                           f"{r_ours[sel].mean():.4f}, bitsandbytes {r_bnb[sel].mean():.4f}")
            small = nz & (rel < 1e-3)
            assert small.sum() > 0 and r_ours[small].mean() < r_bnb[small].mean()
            print(f"signed={signed} {name} block={block}: mean relative error by |x| / absmax: "
                  + "; ".join(row))
