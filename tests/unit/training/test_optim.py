"""The optimizer step: the clip inside fused AdamW takes clip_grad_norm_'s step; with the clip out
of the kernel (KernelOptions.fused_clip off) it is clip_grad_norm_'s."""

import torch

from eyas.training.optim import clip_and_step, make_optimizer

torch.set_num_threads(1)


def test_fused_clip_takes_the_same_step_as_clip_then_step():
    """The clip factor as fused AdamW's grad_scale (CPU AdamW has the fused kernel too) against
    clip_grad_norm_ then step; eps 0.1, so the step depends on the gradients' scale and a missing
    clip shows."""

    def params_after(how: str, fused_adamw: bool = True):
        g = torch.Generator().manual_seed(5)
        ps = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (100, 300)]
        opt = torch.optim.AdamW(
            ps, lr=1e-2, betas=(0.9, 0.95), eps=0.1, weight_decay=0.01, fused=fused_adamw
        )
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g) * 3  # norm ~60: clipped to 0.5
            if how == "none":
                opt.step()
            elif how == "plain":
                torch.nn.utils.clip_grad_norm_(ps, 0.5)
                opt.step()
            elif how == "out of the kernel":
                clip_and_step(ps, opt, 0.5, in_kernel=False)
            else:
                clip_and_step(ps, opt, 0.5)
            assert (
                getattr(opt, "grad_scale", None) is None
            )  # the scale applies to its own step only
        return torch.cat([p.detach() for p in ps])

    plain = params_after("plain")
    assert torch.equal(params_after("out of the kernel"), plain)
    torch.testing.assert_close(params_after("fused"), plain, atol=1e-6, rtol=1e-6)
    assert (params_after("none") - plain).abs().max() > 1e-3  # not clipping would have shown
    # not fused (make_optimizer on a CPU): the same two passes, bit for bit
    assert torch.equal(
        params_after("fused", fused_adamw=False), params_after("plain", fused_adamw=False)
    )
    assert not make_optimizer([torch.nn.Parameter(torch.ones(2))], 1e-3, 0.0).defaults["fused"]
