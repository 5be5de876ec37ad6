"""policy/grad_ops.use_fused_torch_adam: torch's fused AdamW kernel takes the same steps as torch's default AdamW."""
from types import SimpleNamespace

import torch

from megatron_rl.policy.grad_ops import use_fused_torch_adam


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(64, 32), (32,), (7, 5, 3)]]


def _run(opt, params, steps=4):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        opt.step()


def test_fused_adamw_takes_the_default_implementations_steps():
    ref_p, fused_p = _params(0), _params(0)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_p, **kw)
    fused = torch.optim.AdamW(fused_p, **kw)
    assert use_fused_torch_adam(SimpleNamespace(optimizer=fused)) == 1
    assert all(g["fused"] and not g["foreach"] for g in fused.param_groups)
    _run(ref, ref_p)
    _run(fused, fused_p)
    for a, b, start in zip(ref_p, fused_p, _params(0)):
        assert (a - start).abs().max() > 1e-3  # the steps moved the weights
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    for a, b in zip(ref_p, fused_p):  # same state layout: a checkpoint of one loads into the other
        sa, sb = ref.state[a], fused.state[b]
        assert sa.keys() == sb.keys()
        torch.testing.assert_close(sb["exp_avg_sq"], sa["exp_avg_sq"], rtol=1e-6, atol=1e-12)
        assert float(sb["step"]) == float(sa["step"]) == 4


def test_chained_optimizers_are_all_switched_and_others_left_alone():
    adam = torch.optim.Adam(_params(2), lr=1e-3)
    sgd = torch.optim.SGD(_params(3), lr=1e-3)
    chain = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam), SimpleNamespace(optimizer=sgd),
                                                SimpleNamespace(optimizer=None)])
    assert use_fused_torch_adam(chain) == 1
    assert adam.param_groups[0]["fused"] is True
    assert "fused" not in sgd.param_groups[0] or not sgd.param_groups[0]["fused"]


def test_low_precision_params_keep_the_default_implementation():
    # torch's fused kernel updates a bf16 parameter in bf16; megatron keeps fp32 main params for that reason
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], lr=1e-3)
    assert use_fused_torch_adam(SimpleNamespace(optimizer=opt)) == 0
    assert not opt.param_groups[0]["fused"]
