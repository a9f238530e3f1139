"""SRPO inside verl, checked against verl's own pure functions (skipped where verl is absent)."""

import numpy as np
import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="pip install srpo[verl] to run the verl checks")

import srpo.integrations.verl as srpo_verl  # noqa: E402


def actor_config(clip=0.2):
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", clip_ratio=clip, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4,
                       rollout_n=1)


def batch(seed, bs=6, T=9):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None] < torch.randint(2, T + 1, (bs,), generator=g)[:, None]).float()
    old = -torch.rand(bs, T, generator=g, dtype=torch.float64) * 2
    lp = (old + torch.randn(bs, T, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True)
    adv = torch.randn(bs, 1, generator=g, dtype=torch.float64).expand(bs, T) * mask
    return old, lp, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_srpo_k1_mean_equals_verl_gspo(seed):
    srpo_verl.register(member_reduction="mean")
    srpo_verl._OPTIONS.update(member_reduction="mean")
    cfg = actor_config()
    old, lp, adv, mask = batch(seed)
    ours, _ = core_algos.get_policy_loss_fn("srpo")(old, lp, adv, mask, "seq-mean-token-mean", cfg)
    (g_ours,) = torch.autograd.grad(ours, lp)
    theirs, _ = core_algos.get_policy_loss_fn("gspo")(old, lp, adv, mask, "seq-mean-token-mean", cfg)
    (g_theirs,) = torch.autograd.grad(theirs, lp)
    assert torch.allclose(ours, theirs, atol=1e-10)
    assert torch.allclose(g_ours, g_theirs, atol=1e-10)


def test_srpo_sets_in_verl_match_our_objective():
    """Rows 0-1, 2 and 3-5 are three events; verl broadcasts each event's advantage over tokens."""
    srpo_verl.register()
    srpo_verl._OPTIONS.update(set_reduction="sqrt", member_reduction="sum")
    cfg = actor_config()
    old, lp, _, mask = batch(5)
    events = torch.tensor([0, 0, 1, 2, 2, 2])
    event_adv = torch.tensor([0.7, -1.2, 0.4], dtype=torch.float64)
    adv = event_adv[events][:, None] * mask
    with srpo_verl.event_context(events, num_events=3):
        ours, metrics = core_algos.get_policy_loss_fn("srpo")(old, lp, adv, mask, "token-mean", cfg)
    (g_ours,) = torch.autograd.grad(ours, lp)
    from srpo.objective import LossInputs, policy_loss

    expected, _ = policy_loss("srpo", LossInputs(
        logprobs=lp, old_logprobs=old, mask=mask, event_index=events, advantages=event_adv, normalizer=3))
    (g_expected,) = torch.autograd.grad(expected, lp)
    assert torch.allclose(ours, expected, atol=1e-10) and torch.allclose(g_ours, g_expected, atol=1e-10)
    assert metrics["actor/srpo/num_events"] == 3
    srpo_verl._OPTIONS.update(member_reduction="sum")


def test_group_advantages_equal_verl_grpo():
    srpo_verl.register()
    g = torch.Generator().manual_seed(3)
    bs, T = 12, 5
    mask = torch.ones(bs, T)
    rewards = torch.zeros(bs, T)
    rewards[:, -1] = torch.randint(0, 2, (bs,), generator=g).float() + torch.rand(bs, generator=g)
    index = np.array(["a", "a", "a", "b", "b", "c", "c", "c", "c", "d", "e", "e"], dtype=object)
    theirs, _ = core_algos.get_adv_estimator_fn("grpo")(rewards, mask, index)
    ours, _ = core_algos.get_adv_estimator_fn("srpo_event")(rewards, mask, index)
    grouped = torch.tensor([list(index).count(i) > 1 for i in index])
    assert torch.allclose(ours[grouped], theirs[grouped], atol=1e-6)
    # The one deliberate difference: a group of one has no peer; SRPO gives it 0, while verl
    # passes its raw score through (mean 0, std 1).
    assert torch.all(ours[~grouped] == 0)
    assert torch.allclose(theirs[~grouped], rewards[~grouped].sum(-1, keepdim=True).expand(-1, T), atol=1e-5)
