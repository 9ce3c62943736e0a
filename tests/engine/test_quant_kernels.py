"""The integer kernels over GGUF block weights (engine/backends/cpu/quant_kernel.py): a row's
result does not depend on the rows computed with it (why speculation over quantized weights
equals plain decoding), the arithmetic is the Q8-activation product llama.cpp computes, and the
variant this CPU gets is right next to the portable build (chosen where the CPU lacks AVX2),
every variant reads weights repacked at load from each format."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from multiguess.engine.backends.cpu import bf16_kernel, quant_kernel
from multiguess.engine.quantized import FORMATS, dequantize, quantize

needs_kernel = pytest.mark.skipif(
    quant_kernel.library() is None, reason="the quantized kernels need a C compiler"
)


def runnable_variants() -> list[str]:
    """Every variant of the library whose instructions this CPU has."""
    flags = bf16_kernel.cpu_flags()
    return [name for name, variant in quant_kernel.QUANT.variants.items() if variant.needs <= flags]


def reset() -> None:
    """Forget the chosen variant and the opened libraries (read again on next use)."""
    for cached in (quant_kernel.library, quant_kernel.variant_library, quant_kernel.chosen_variant):
        cached.cache_clear()


@pytest.fixture(params=runnable_variants())
def variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test on every variant this CPU runs (the portable one stands for a CPU without AVX2)."""
    monkeypatch.setenv(quant_kernel.VARIANT, request.param)
    reset()
    assert quant_kernel.library() is not None and quant_kernel.chosen_variant() == request.param
    yield request.param
    reset()


def weights(
    kind: str, outputs: int, inputs: int, seed: int
) -> tuple[torch.Tensor, quant_kernel.Packed, torch.Tensor]:
    """Quantized blocks of a random weight, the same repacked for the kernel, and a bias."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(outputs, inputs, generator=generator) * torch.rand(inputs, generator=generator)
    blocks = quantize(weight, kind)
    return blocks, quant_kernel.repack(blocks, kind), torch.randn(outputs, generator=generator)


def q8_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows of x as the kernel takes them: per block of 32, int8 at scale max|x| / 127 (rounded
    to nearest even), decoded back to floats."""
    blocks = x.view(*x.shape[:-1], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale == 0, 0.0, 1 / scale)
    return (torch.round(blocks * inverse) * scale).view(x.shape)


@needs_kernel
@pytest.mark.parametrize("kind", list(FORMATS))
def test_rows_do_not_depend_on_the_row_count(kind: str, variant: str) -> None:
    """Every row alone and inside batches of 2..19 rows, at every position: the same bits."""
    _, packed, bias = weights(kind, 67, 1536, seed=1)
    x = torch.randn(19, 1536)
    together = quant_kernel.matmul(packed, x, bias)
    for rows in range(1, 20):
        for first in range(0, 20 - rows, 5):
            assert torch.equal(
                quant_kernel.matmul(packed, x[first : first + rows], bias), together[first : first + rows]
            )
    assert torch.equal(quant_kernel.matmul(packed, x[7], bias), together[7])  # one row, 1-D


@needs_kernel
@pytest.mark.parametrize("kind", list(FORMATS))
def test_the_product_of_q8_rows_and_the_weight_blocks(kind: str, variant: str) -> None:
    """The kernel's product is the dequantized weight times the Q8-quantized rows (fp32 sums:
    within 1e-5 of it); against the plain fp32 product, within the error Q8 rows bring."""
    blocks, packed, bias = weights(kind, 130, 512, seed=2)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.1, 4, 512)
    x[1, :32] = 0.0  # an all-zero block
    weight = dequantize(blocks, kind).double()
    y = quant_kernel.matmul(packed, x, bias).double()
    exact = q8_rows(x).double() @ weight.T + bias.double()
    torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-4)
    plain = x.double() @ weight.T + bias.double()
    error = (y - plain).abs().max() / plain.abs().max()
    assert 0 < error < 0.02


@needs_kernel
def test_bf16_outputs_are_the_fp32_ones_rounded_as_torch_rounds(variant: str) -> None:
    """bf16 rows in, bf16 out: the fp32 result of the same rows (and residual) rounded to nearest
    even, in whole tiles and in the last, partial one; NaN stays NaN."""
    _, packed, bias = weights("q4_1", 67, 256, seed=6)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(5, 256, generator=generator).bfloat16()
    residual = (torch.randn(5, 67, generator=generator) * 3).bfloat16()
    residual[2, 5] = float("nan")
    for extra in (None, residual):
        half = quant_kernel.matmul(packed, x, bias, residual=extra)
        wide = quant_kernel.matmul(packed, x.float(), bias, residual=None if extra is None else extra.float())
        torch.testing.assert_close(half, wide.bfloat16(), rtol=0, atol=0, equal_nan=True)
    assert half[2, 5].isnan()


@needs_kernel
@pytest.mark.parametrize("fused", ["norm", "gated", "residual"])
def test_fused_inputs_and_residual(fused: str, variant: str) -> None:
    """RMSNorm, SiLU gating and the residual in the call: bf16 rows stay independent of the row
    count, and in fp32 the result is the product of the prepared rows (torch's ops) within the
    Q8 rows' rounding."""
    blocks, packed, bias = weights("q4_1", 96, 256, seed=3)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(11, 512 if fused == "gated" else 256, generator=generator)
    norm = (torch.rand(256, generator=generator) + 0.5, 1e-5) if fused == "norm" else None
    residual = torch.randn(11, 96, generator=generator) if fused == "residual" else None
    gated = fused == "gated"
    half = (x.bfloat16(), None if norm is None else (norm[0].bfloat16(), norm[1]), residual)
    together = quant_kernel.matmul(packed, half[0], bias, half[1], gated, half[2])
    for rows in (1, 2, 5, 8):
        part = None if residual is None else half[2][3 : 3 + rows]
        alone = quant_kernel.matmul(packed, half[0][3 : 3 + rows], bias, half[1], gated, part)
        assert torch.equal(alone, together[3 : 3 + rows])
    y = quant_kernel.matmul(packed, x, bias, norm, gated, residual).double()
    prepared = x
    if norm is not None:
        prepared = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm[1]) * norm[0]
    if gated:
        prepared = torch.nn.functional.silu(x[:, :256]) * x[:, 256:]
    exact = q8_rows(prepared).double() @ dequantize(blocks, "q4_1").double().T + bias.double()
    if residual is not None:
        exact += residual.double()
    torch.testing.assert_close(y, exact, rtol=1e-3, atol=2e-2)


def test_the_portable_build_serves_cpus_without_avx2(monkeypatch: pytest.MonkeyPatch) -> None:
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"}
    for cpu, expected in (
        (avx512, "avx512_vnni"),
        ({"avx2", "fma", "f16c", "avx_vnni"}, "avx_vnni"),
        ({"avx2", "fma", "f16c"}, "avx2"),
        ({"avx2", "fma"}, "portable"),
        (set(), "portable"),
    ):
        monkeypatch.setattr(bf16_kernel, "cpu_flags", lambda cpu=cpu: frozenset(cpu))
        assert bf16_kernel.cpu_variant(quant_kernel.QUANT) == expected


def test_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MULTIGUESS_QUANT_KERNEL", "0")
    reset()
    try:
        assert quant_kernel.library() is None and not quant_kernel.usable("q4_1")
    finally:
        reset()  # recomputed with the switch back on


def test_the_variant_is_measured_among_the_vector_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU runs more than one vector build, the faster at a streamed product is
    chosen (here made to be AVX2); one named in the environment is taken as it is, and one
    the CPU cannot run is refused."""
    monkeypatch.setattr(bf16_kernel, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx_vnni"}))
    timed = {"avx_vnni": 2.0, "avx2": 1.0}
    monkeypatch.setattr(quant_kernel, "product_seconds", lambda names: {n: timed[n] for n in names})
    reset()
    try:
        assert quant_kernel.chosen_variant() == "avx2"
        monkeypatch.setenv(quant_kernel.VARIANT, "portable")
        reset()
        assert quant_kernel.chosen_variant() == "portable"
        monkeypatch.setenv(quant_kernel.VARIANT, "avx512_vnni")
        reset()
        with pytest.raises(ValueError, match="does not run here; this CPU runs: avx_vnni, avx2, portable"):
            quant_kernel.chosen_variant()
    finally:
        monkeypatch.delenv(quant_kernel.VARIANT)
        reset()
