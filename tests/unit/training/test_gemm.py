"""The step's GEMM helpers: the teacher's BLAS, the CPU's padded bf16 operands, FP8 quantization."""

import torch

from eyas.training import gemm

torch.set_num_threads(1)


def test_teacher_blas_is_left_alone_off_cuda():
    before = torch.backends.cuda.preferred_blas_library()
    with gemm.teacher_blas(torch.device("cpu")):
        assert torch.backends.cuda.preferred_blas_library() == before
    assert torch.backends.cuda.preferred_blas_library() == before


def test_cpu_gemm_operands_are_padded_to_a_few_shapes():
    x = torch.randn(130, 7)
    p = gemm.gemm_operand(x, torch.bfloat16)
    assert p.shape == (256, 7) and p.dtype == torch.bfloat16 and not p[130:].any()
    torch.testing.assert_close(p[:130].float(), x, atol=0.02, rtol=0.01)
    assert gemm.gemm_operand(x, torch.float32) is x  # fp32 GEMMs take it as it is


def test_fp8_quantization_keeps_three_mantissa_bits_per_row_and_column():
    g = torch.Generator().manual_seed(3)
    x = (
        torch.randn(37, 48, generator=g) * torch.logspace(-3, 3, 37)[:, None]
    )  # rows of very different sizes
    x8, s = gemm.quant_both.eager(x)[:2]
    assert x8.dtype == torch.float8_e4m3fn and s.shape == (37, 1)
    back = x8.float() * s
    assert (
        (back - x).abs() <= x.abs() * 2**-4 + s * 2**-9
    ).all()  # e4m3: 3 mantissa bits, subnormals
    assert torch.equal(
        x8.float().abs().amax(1), torch.full((37,), 448.0)
    )  # each row's largest maps to 448
    c8, cs = gemm.quant_both.eager(x)[2:]
    r8, rs = gemm.quant_both.eager(x.t().contiguous())[:2]
    assert (
        c8.shape == (48, 37)
        and c8.is_contiguous()
        and torch.equal(c8.float(), r8.float())
        and torch.equal(cs, rs)
    )
    w = torch.randn(32, 48, generator=g)
    w8, ws = gemm.quant_both.eager(w)[:2]
    got = gemm.mm_fp8(x8, s, w8, ws, torch.float32)
    torch.testing.assert_close(got, (x8.float() * s) @ (w8.float() * ws).T, rtol=1e-5, atol=1e-4)
