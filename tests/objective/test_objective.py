"""The objective: closed-form numbers, agreement with the loop reference, invariances."""

import math

import pytest
import torch

from srpo.objective import LOSSES, LossInputs, LossSettings, group_advantages, policy_loss, set_log_ratio
from srpo.objective.reference import reference_loss, sequence_ppo_clip

JUNK = 123.0  # a value at masked positions that must never matter



def _loss(name, **kw):
    """policy_loss with its keyword arguments split into the inputs and the settings."""
    settings = {k: kw.pop(k) for k in list(kw) if k in LossSettings.__dataclass_fields__}
    return policy_loss(name, LossInputs(**kw), LossSettings(**settings))

def closed_form_batch():
    """One K=1 event (A=+1, ratio e^0.3 — above 1.2, clipped) and one K=3 event (A=−0.5,
    log-ratios 0.15 + 0.2 + 0.1 = 0.45, negative advantage so never clipped above)."""
    old = torch.zeros(4, 4, dtype=torch.float64) - 1.0
    delta = torch.tensor(
        [
            [0.1, 0.2, JUNK, JUNK],  # event 0, K=1, 2 action tokens
            [0.1, 0.05, JUNK, JUNK],  # event 1, member 0
            [0.2, JUNK, JUNK, JUNK],  # event 1, member 1
            [0.05, JUNK, 0.05, JUNK],  # event 1, member 2 (tool token at position 1)
        ],
        dtype=torch.float64,
    )
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 0, 1, 0]], dtype=torch.float64)
    lp = (old + delta).requires_grad_(True)
    return dict(
        logprobs=lp, old_logprobs=old, mask=mask,
        event_index=torch.tensor([0, 1, 1, 1]),
        advantages=torch.tensor([1.0, -0.5], dtype=torch.float64),
    )


@pytest.mark.parametrize("reduction, c", [("sqrt", 1 / math.sqrt(3)), ("sum", 1.0), ("mean", 1 / 3)])
def test_closed_form_srpo(reduction, c):
    b = closed_form_batch()
    loss, metrics = _loss("srpo", **b, set_reduction=reduction)
    rho3 = math.exp(c * 0.45)
    # J = ½ [ min(e^0.3·1, 1.2·1) + min(ρ3·(−0.5), clip(ρ3)·(−0.5)) ] = ½ [1.2 − 0.5 ρ3]
    expected = -0.5 * (1.2 - 0.5 * rho3)
    assert abs(loss.item() - expected) <= 1e-6
    loss.backward()
    g = b["logprobs"].grad
    assert torch.all(g[0] == 0), "the clipped K=1 set gets no gradient"
    # unclipped set: d(−½ A ρ)/d lp = −½ A ρ c on every action token of every member
    expected_grad = 0.25 * rho3 * c
    action = b["mask"][1:] > 0
    assert torch.allclose(g[1:][action], torch.full_like(g[1:][action], expected_grad), atol=1e-9)
    assert torch.all(g[1:][~action] == 0)
    assert metrics["clip_frac"].item() == 0.5
    assert metrics["by_k/clip_frac/k1"].item() == 1.0 and metrics["by_k/clip_frac/k3"].item() == 0.0
    assert metrics["clip_frac_high"].item() == 0.5 and metrics["clip_frac_low"].item() == 0.0
    assert abs(metrics["set_log_ratio/max"].item() - max(0.3, 0.45 * c)) < 1e-9


def random_batch(seed, dtype=torch.float64, num_events=6, max_k=4, T=7):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, max_k + 1, (num_events,), generator=g)
    event_index = torch.repeat_interleave(torch.arange(num_events), sizes)
    event_index = event_index[torch.randperm(len(event_index), generator=g)]  # members interleaved
    M = len(event_index)
    lengths = torch.randint(1, T + 1, (M,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(dtype)
    mask = mask * (torch.rand(M, T, generator=g) > 0.15).to(dtype)  # tool tokens inside
    mask[:, 0] = 1
    old = -torch.rand(M, T, generator=g, dtype=dtype) * 3
    lp = old + torch.randn(M, T, generator=g, dtype=dtype) * 0.15
    ref = old + torch.randn(M, T, generator=g, dtype=dtype) * 0.1
    adv = torch.randn(num_events, generator=g, dtype=dtype)
    return dict(logprobs=lp, old_logprobs=old, mask=mask, event_index=event_index, advantages=adv), ref


OPTION_SETS = [
    dict(),
    dict(set_reduction="sum"),
    dict(set_reduction="mean", member_reduction="mean"),
    dict(member_reduction="mean", clip_eps=0.1, clip_eps_high=0.28),
    dict(kl_coef=0.05, with_ref=True),
    dict(normalizer=17.0, clip_eps=0.05),
]


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("opts", OPTION_SETS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_matches_loop_reference(name, opts, seed):
    opts = dict(opts)
    b, ref = random_batch(seed)
    if opts.pop("with_ref", False):
        opts["ref_logprobs"] = ref
    lp1 = b["logprobs"].clone().requires_grad_(True)
    lp2 = b["logprobs"].clone().requires_grad_(True)
    loss, _ = _loss(name, **{**b, "logprobs": lp1}, **opts)
    expected = reference_loss(name, **{**b, "logprobs": lp2}, **opts)
    loss.backward()
    expected.backward()
    assert torch.allclose(loss, expected, atol=1e-10, rtol=1e-9)
    assert torch.allclose(lp1.grad, lp2.grad, atol=1e-10, rtol=1e-9)


def loss_and_grad(name, b, **opts):
    lp = b["logprobs"].detach().clone().requires_grad_(True)
    loss, metrics = _loss(name, **{**b, "logprobs": lp}, **opts)
    loss.backward()
    return loss.detach(), lp.grad, metrics


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_permuting_members_changes_nothing(name):
    b, _ = random_batch(3)
    loss, grad, _ = loss_and_grad(name, b)
    perm = torch.randperm(len(b["event_index"]), generator=torch.Generator().manual_seed(9))
    pb = {k: (v[perm] if k != "advantages" else v) for k, v in b.items()}
    ploss, pgrad, _ = loss_and_grad(name, pb)
    assert torch.allclose(loss, ploss, atol=1e-12)
    assert torch.allclose(grad[perm], pgrad, atol=1e-12)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_masked_and_padded_values_change_nothing(name):
    b, ref = random_batch(4)
    loss, grad, _ = loss_and_grad(name, b, ref_logprobs=ref, kl_coef=0.1)
    off = b["mask"] == 0
    noisy = dict(b)
    for key in ("logprobs", "old_logprobs"):
        t = b[key].clone()
        t[off] = torch.tensor([float("nan"), float("inf"), -float("inf"), 55.0])[torch.arange(int(off.sum())) % 4].to(t.dtype)
        noisy[key] = t
    ref2 = ref.clone()
    ref2[off] = float("nan")
    nloss, ngrad, _ = loss_and_grad(name, noisy, ref_logprobs=ref2, kl_coef=0.1)
    assert torch.isfinite(nloss)
    assert torch.allclose(loss, nloss, atol=1e-12)
    assert torch.allclose(grad, ngrad, atol=1e-12)
    assert torch.all(ngrad[off] == 0)


def split_by_events(b, event_groups):
    """Micro-batches holding whole events; event ids re-indexed locally."""
    parts = []
    for events in event_groups:
        rows = torch.tensor([i for i, e in enumerate(b["event_index"].tolist()) if e in events])
        remap = {e: j for j, e in enumerate(events)}
        parts.append((rows, {
            "logprobs": b["logprobs"][rows], "old_logprobs": b["old_logprobs"][rows], "mask": b["mask"][rows],
            "event_index": torch.tensor([remap[e] for e in b["event_index"][rows].tolist()]),
            "advantages": b["advantages"][list(events)],
        }))
    return parts


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_micro_batches_with_global_normalizer_equal_whole_batch(name):
    b, _ = random_batch(5, num_events=7)
    loss, grad, _ = loss_and_grad(name, b)
    unit = {"srpo": 7, "gspo": len(b["event_index"]), "grpo": int(b["mask"].sum())}[name]
    total = torch.zeros((), dtype=loss.dtype)
    total_grad = torch.zeros_like(grad)
    for rows, part in split_by_events(b, [[0, 4], [1, 2, 6], [3, 5]]):
        l, g, _ = loss_and_grad(name, part, normalizer=unit)
        total += l
        total_grad[rows] += g
    assert torch.allclose(loss, total, atol=1e-12)
    assert torch.allclose(grad, total_grad, atol=1e-12)


def test_clipped_set_gives_zero_gradient_to_every_member():
    b, _ = random_batch(6, num_events=3, max_k=4)
    # push event 0's set ratio far above 1 + ε with a positive advantage
    rows = b["event_index"] == 0
    b["logprobs"] = b["logprobs"].clone()
    b["logprobs"][rows] = b["old_logprobs"][rows] + 0.5
    b["advantages"] = b["advantages"].clone()
    b["advantages"][0] = 1.0
    _, grad, m = loss_and_grad("srpo", b)
    assert torch.all(grad[rows] == 0)
    assert grad[~rows].abs().sum() > 0
    assert m["clip_frac_high"] > 0


def test_srpo_with_singletons_equals_gspo_and_sequence_ppo():
    b, _ = random_batch(7, num_events=8, max_k=1)
    lg, gg, _ = loss_and_grad("gspo", b)
    ls, gs, _ = loss_and_grad("srpo", b, member_reduction="mean")
    assert torch.allclose(lg, ls, atol=1e-12) and torch.allclose(gg, gs, atol=1e-12)
    order = torch.argsort(b["event_index"])
    lp = b["logprobs"].detach().clone().requires_grad_(True)
    ppo = sequence_ppo_clip(logprobs=lp[order], old_logprobs=b["old_logprobs"][order], mask=b["mask"][order],
                            advantages=b["advantages"])
    ppo.backward()
    lsum, gsum, _ = loss_and_grad("srpo", b, member_reduction="sum")
    assert torch.allclose(ppo, lsum, atol=1e-12) and torch.allclose(lp.grad, gsum, atol=1e-12)


def test_overflow_guard_keeps_loss_finite_and_counts():
    b, _ = random_batch(8, num_events=3)
    b["logprobs"] = b["old_logprobs"] + 40.0 * b["mask"]
    b["advantages"] = torch.tensor([-1.0, -1.0, 1.0], dtype=torch.float64)
    loss, grad, m = loss_and_grad("srpo", b, set_reduction="sum")
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert m["overflow_guard"].item() == 3


def test_metrics_are_detached():
    b, _ = random_batch(9)
    b["logprobs"] = b["logprobs"].clone().requires_grad_(True)
    for name in LOSSES:
        _, metrics = _loss(name, **b)
        assert all(not v.requires_grad for v in metrics.values())
        for key in ("set_log_ratio/mean", "set_ratio/max", "clip_frac", "clip_frac_low", "clip_frac_high",
                    "approx_kl", "num_events", "overflow_guard"):
            assert key in metrics


def test_set_log_ratio_helper():
    b = closed_form_batch()
    L, K = set_log_ratio(b["logprobs"], b["old_logprobs"], b["mask"], b["event_index"], 2)
    assert K.tolist() == [1, 3]
    assert torch.allclose(L.detach(), torch.tensor([0.3, 0.45 / math.sqrt(3)], dtype=torch.float64))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="ppo"), "valid: grpo, gspo, srpo"),
        (dict(set_reduction="max"), "valid: mean, sqrt, sum"),
        (dict(member_reduction="median"), "valid: mean, sum"),
        (dict(clip_eps=-0.1), "non-negative"),
    ],
)
def test_bad_options_name_the_valid_ones(kwargs, message):
    b = closed_form_batch()
    name = kwargs.pop("name", "srpo")
    with pytest.raises(ValueError, match=message):
        _loss(name, **b, **kwargs)


def test_shape_errors_are_clear():
    b = closed_form_batch()
    with pytest.raises(ValueError, match="event_index"):
        _loss("srpo", **{**b, "event_index": torch.tensor([0, 1])})
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        _loss("srpo", **{**b, "event_index": torch.tensor([0, 1, 1, 5])})


# --- group advantages -------------------------------------------------------------------------

def test_group_advantages_closed_form():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 2.0, 2.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 9, 9])
    adv = group_advantages(rewards, groups, eps=0.0)
    std = math.sqrt(((0.5**2) * 4) / 3)  # Bessel: Σ(r − 0.5)² / (n − 1)
    assert torch.allclose(adv[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std)
    assert adv[4] == 0, "a group of one gets advantage 0"
    assert torch.all(adv[5:] == 0), "equal rewards: zero advantage, not NaN"
    none = group_advantages(rewards, groups, scale="none")
    assert torch.allclose(none, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0]))


def test_group_advantages_match_a_loop():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(40, generator=g)
    groups = torch.randint(0, 6, (40,), generator=g)
    adv = group_advantages(rewards, groups)
    for gid in groups.unique():
        sel = groups == gid
        r = rewards[sel]
        expected = (r - r.mean()) / (r.std(unbiased=True) + 1e-6) if sel.sum() > 1 else torch.zeros_like(r)
        assert torch.allclose(adv[sel], expected, atol=1e-6)


def test_group_advantages_bad_scale():
    with pytest.raises(ValueError, match="valid: std, none"):
        group_advantages(torch.zeros(2), torch.zeros(2), scale="minmax")


# ------------------------------------------------------------- truncated importance sampling

def _tis_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    M, T, E = 7, 5, 3
    event_index = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    mask = (torch.rand(M, T, generator=g) > 0.2).float()
    mask[:, 0] = 1
    old = -torch.rand(M, T, generator=g) * 2
    cur = (old + 0.1 * torch.randn(M, T, generator=g)).requires_grad_(True)
    beh = old + 0.4 * torch.randn(M, T, generator=g)
    adv = torch.randn(E, generator=g)
    return cur, old, beh, mask, event_index, adv


@pytest.mark.parametrize("name", ["srpo", "grpo", "gspo"])
def test_tis_with_behaviour_equal_to_old_changes_nothing(name):
    cur, old, _, mask, idx, adv = _tis_batch()
    plain, _ = policy_loss(name, LossInputs(logprobs=cur, old_logprobs=old, mask=mask, event_index=idx, advantages=adv))
    tis, m = policy_loss(name, LossInputs(
        logprobs=cur, old_logprobs=old, mask=mask, event_index=idx, advantages=adv, behaviour_logprobs=old.clone()),
        LossSettings(tis_cap=2.0))
    assert torch.allclose(plain, tis) and float(m["tis/weight_mean"]) == pytest.approx(1.0)


@pytest.mark.parametrize("reduction", ["sqrt", "sum", "mean"])
def test_tis_weights_each_set_by_its_truncated_setwise_ratio(reduction):
    """By hand: w_e = min(exp(c(K_e) Σ_j Σ_t (old − beh)), C), one weight per event, detached."""
    cur, old, beh, mask, idx, adv = _tis_batch(1)
    cap = 1.5
    loss, m = policy_loss("srpo", LossInputs(
        logprobs=cur, old_logprobs=old, mask=mask, event_index=idx, advantages=adv, behaviour_logprobs=beh),
        LossSettings(set_reduction=reduction, tis_cap=cap))
    total = 0.0
    weights = []
    for e in range(3):
        rows = (idx == e).nonzero().flatten()
        k = len(rows)
        c = {"sqrt": k ** -0.5, "sum": 1.0, "mean": 1.0 / k}[reduction]
        log_rho = c * sum(((cur[r] - old[r]) * mask[r]).sum() for r in rows)
        log_w = c * sum(((old[r] - beh[r]) * mask[r]).sum() for r in rows)
        w = min(math.exp(float(log_w)), cap)
        weights.append(w)
        rho = torch.exp(log_rho)
        surrogate = torch.maximum(-adv[e] * rho, -adv[e] * rho.clamp(0.8, 1.2))
        total = total + w * surrogate
    expected = total / 3
    assert torch.allclose(loss, expected, atol=1e-6)
    assert float(m["tis/weight_mean"]) == pytest.approx(sum(weights) / 3, rel=1e-5)
    assert float(m["tis/capped_frac"]) == pytest.approx(sum(w == cap for w in weights) / 3)
    loss.backward()
    g_tis = cur.grad.clone()
    cur.grad = None
    # The weight is a constant: the gradient is the weighted sum of the plain per-event gradients.
    per_event = []
    for e in range(3):
        sel = torch.zeros(3)
        sel[e] = 1.0
        l, _ = policy_loss("srpo", LossInputs(
            logprobs=cur, old_logprobs=old, mask=mask, event_index=idx, advantages=adv * sel, normalizer=3),
            LossSettings(set_reduction=reduction))
        per_event.append(torch.autograd.grad(l, cur)[0])
    assert torch.allclose(g_tis, sum(w * g for w, g in zip(weights, per_event)), atol=1e-6)


def test_tis_per_token_for_grpo():
    cur, old, beh, mask, idx, adv = _tis_batch(2)
    loss, _ = policy_loss("grpo", LossInputs(
        logprobs=cur, old_logprobs=old, mask=mask, event_index=idx, advantages=adv, behaviour_logprobs=beh),
        LossSettings(tis_cap=2.0))
    w = torch.exp(old - beh).clamp(max=2.0)
    ratio = torch.exp(cur - old)
    a = adv[idx][:, None]
    per_token = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)) * w
    assert torch.allclose(loss, (per_token * mask).sum() / mask.sum(), atol=1e-6)


def test_tis_cap_below_one_is_refused():
    cur, old, beh, mask, idx, adv = _tis_batch()
    with pytest.raises(ValueError, match="tis_cap must be ≥ 1"):
        policy_loss("srpo", LossInputs(
            logprobs=cur, old_logprobs=old, mask=mask, event_index=idx, advantages=adv, behaviour_logprobs=beh),
            LossSettings(tis_cap=0.5))


def test_group_advantages_stay_finite_for_any_finite_rewards():
    """Rewards of ±1e308 (finite) overflowed the group sums: 3 of 4 steps were skipped as
    non-finite.  The statistics are taken on rewards scaled by a power of two; std-scaled
    advantages are the same as at any scale, centred ones are scaled back."""
    import torch

    from srpo.objective import LossInputs, LossSettings, group_advantages

    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    huge = torch.tensor([1e308, -1e308, 1e308, 0.0, 5.0, 7.0], dtype=torch.float64)
    small = huge / 1e300
    a, b = group_advantages(huge, groups), group_advantages(small, groups)
    assert torch.isfinite(a).all() and torch.allclose(a[:4], b[:4])
    centred = group_advantages(huge, groups, scale="none")
    assert torch.isfinite(centred).all() and centred[1] == -1.25e308
    plain = torch.tensor([1.0, 0.0, 1.0, 0.0, 5.0, 7.0])
    assert torch.equal(group_advantages(plain, groups), group_advantages(plain.clone(), groups))


def test_the_readme_objective_snippet_runs_as_written():
    """The README's objective block, executed on a small batch: two events (K = 2 and K = 1)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "policy_loss(" in b]
    M, T = 3, 4
    scope = {"rewards": torch.tensor([1.0, 0.0]), "group_ids": torch.tensor([0, 0]),
             "logprobs": torch.randn(M, T, requires_grad=True), "old_logprobs": torch.randn(M, T),
             "mask": torch.ones(M, T), "event_index": torch.tensor([0, 0, 1]),
             "num_events_in_the_whole_optimizer_step": 2}
    exec(block, scope)
    scope["loss"].backward()
    assert torch.isfinite(scope["loss"]) and scope["logprobs"].grad is not None
    assert int(scope["metrics"]["num_events"]) == 2
