"""The GEMMs of a training step: fp32 outputs from bf16 operands, the CPU's bf16 GEMMs, FP8.

z = gemm.mm_f32(x, W.T)                 # (n, V) fp32 logits from bf16 operands
xg = gemm.gemm_operand(x, torch.bfloat16)   # a CPU's bf16 GEMM operand, rows padded
with gemm.teacher_blas(device): ...     # the teacher's GEMMs under cuBLASLt on CUDA
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from eyas.training.kernels import fusable

FP32_OUT = {
    "mm": True,
    "addmm": True,
}  # CUDA bf16 GEMMs with fp32 output (torch >= 2.8); probed once


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 output, from the fp32 accumulator where the backend allows."""
    if a.dtype != torch.float32 and a.is_cuda and FP32_OUT["mm"]:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            FP32_OUT["mm"] = False
    return (a @ b).float()


@contextmanager
def teacher_blas(device: torch.device, cublaslt: bool = True):
    """The BLAS the teacher's GEMMs run under: cuBLASLt on CUDA, which runs its fp32-output GEMMs
    ~7% faster than cuBLAS (bench/results/2026-12-03_h200_train-step.md); elsewhere, or without
    `cublaslt` (KernelOptions.teacher_cublaslt), as it is."""
    if device.type != "cuda" or not cublaslt:
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b in the GEMM's epilogue (beta = 1) where the backend allows."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if a.is_cuda and FP32_OUT["addmm"]:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError):
            FP32_OUT["addmm"] = False
    acc.add_((a @ b).float())


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (/proc/cpuinfo); empty where it does not."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return set()
    return {
        flag
        for line in text.splitlines()
        if line.startswith("flags")
        for flag in line.split(":", 1)[1].split()
    }


def cpu_bf16_gemm() -> bool:
    """Whether this CPU multiplies bf16 in hardware, where bf16 GEMMs beat fp32 ones on the
    drafter's shapes: AMX tiles (Intel Xeon since Sapphire Rapids) or AVX512-BF16 dot products (AMD
    EPYC since Zen 4, Intel Cooper Lake), both with fp32 accumulation. The embedded default's step
    then takes 0.70 (AMX) and 0.59 (a Zen 5) of its fp32 time (docs/performance.md, "Training on a
    CPU"); without either, bf16 GEMMs are emulated and slower."""
    init = getattr(torch._C._cpu, "_init_amx", None)  # also asks Linux for the AMX tile state
    try:
        amx = bool(init()) if init is not None else False
    except RuntimeError:
        amx = False
    return amx or "avx512_bf16" in cpu_flags()


#: CPU bf16 GEMMs take their row count rounded up to this: oneDNN builds (JIT) a kernel for each new
#: shape, ~2.5 ms for one of the drafter's GEMMs, more than the GEMM itself; training's sequence
#: lengths vary every step, so unpadded every step would pay it again
#: (bench/results/2026-12-03_cpu2_cpu-train-step.md).
ROW_MULTIPLE = 128


def rows_padded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (M, K) cast to dtype, with zero rows below up to a multiple of ROW_MULTIPLE (one pass)."""
    M = x.shape[0]
    Mp = -(-M // ROW_MULTIPLE) * ROW_MULTIPLE
    out = torch.empty((Mp, *x.shape[1:]), dtype=dtype, device=x.device)
    out[:M] = x
    out[M:] = 0
    return out


def gemm_operand(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (M, K) in a GEMM's dtype: on a CPU in reduced precision with its rows padded (rows_padded),
    elsewhere as it is. Callers take the first M rows of the product."""
    if x.device.type == "cpu" and dtype != torch.float32:
        return rows_padded(x, dtype)
    return x.to(dtype)


# ----------------------------------------------------------------------------- FP8 GEMMs
# Row-wise scaled FP8 (e4m3) GEMMs through torch._scaled_mm: each operand quantized with one scale
# per row along the contraction, so one outlier token or channel costs precision only in its own
# row. A weight-gradient GEMM contracts over tokens, so its operands are quantized per channel and
# laid out transposed (_scaled_mm wants the first operand row-major and the second column-major).

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
FP8_MULTIPLE = 16  # _scaled_mm wants every dimension a multiple of 16 on CUDA


def _quant_rows(x):
    """x (M, K) -> (fp8 (M, K), fp32 scale (M, 1)): x ~= fp8 * scale, row by row."""
    amax = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).to(FP8), scale


def _quant_cols_t(x):
    """x (M, K) -> (fp8 (K, M) contiguous, fp32 scale (K, 1)): x.T quantized row by row."""
    xt = x.t()
    amax = xt.abs().amax(-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (xt.float() / scale).to(FP8).contiguous(), scale


def mm_fp8(a8, sa, b8, sb, out_dtype) -> torch.Tensor:
    """(a8 * sa) @ (b8 * sb).T: a8 (M, K), b8 (N, K) row-major fp8, sa (M, 1), sb (N, 1) -> (M, N)
    out_dtype."""
    return torch._scaled_mm(a8, b8.t(), sa, sb.view(1, -1), out_dtype=out_dtype)


def fp8_pad(n: int) -> int:
    return -(-n // FP8_MULTIPLE) * FP8_MULTIPLE


@fusable
def quant_both(x):
    """x (M, K) -> _quant_rows(x) + _quant_cols_t(x): one read of x when compiled."""
    return (*_quant_rows(x), *_quant_cols_t(x))
