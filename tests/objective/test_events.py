"""Event records, validation, event-atomic splitting/sharding and collation."""

import pytest
import torch

from srpo.events import Event, Member, collate, global_normalizer, shard_events, split_minibatches, validate_events
from srpo.objective import LossInputs, policy_loss


def member(role="worker", prompt=(1, 2, 3), completion=(4, 5), mask=None, lp=None, index=0):
    completion = list(completion)
    return Member(
        role=role, policy_id=role, policy_version=0, prompt_ids=list(prompt), completion_ids=completion,
        action_mask=list(mask) if mask is not None else [1] * len(completion),
        behaviour_logprobs=list(lp) if lp is not None else [-1.0] * len(completion), member_index=index,
    )


def event(i, k, expected=None, reward=1.0):
    return Event(
        event_id=f"e{i}", episode_id=f"ep{i}", task_id="t", prior_state_id=f"s{i}", event_type="workers",
        turn=0, expected_size=k if expected is None else expected,
        members=[member(index=j, completion=tuple(range(4, 4 + (i + j) % 3 + 1))) for j in range(k)], reward=reward,
    )


def test_member_lengths_must_agree():
    with pytest.raises(ValueError, match="same length"):
        member(completion=(4, 5), mask=(1,))


def test_event_with_missing_member_is_dropped_whole_and_counted():
    events = [event(0, 3), event(1, 2, expected=3), event(2, 1)]
    valid, dropped = validate_events(events)
    assert [e.event_id for e in valid] == ["e0", "e2"]
    assert dropped == 1


def test_missing_member_is_dropped_before_the_loss():
    events = [event(0, 3), event(1, 2, expected=3)]
    valid, dropped = validate_events(events)
    batch = collate(valid, pad_token_id=0)
    lp = batch.behaviour_logprobs.clone().requires_grad_(True)
    loss, metrics = policy_loss("srpo", LossInputs(
        logprobs=lp, old_logprobs=batch.behaviour_logprobs, mask=batch.action_mask, event_index=batch.event_index,
        advantages=torch.ones(1)))
    assert dropped == 1 and metrics["num_events"].item() == 1 and batch.event_index.tolist() == [0, 0, 0]


@pytest.mark.parametrize("parts", [1, 2, 3, 5, 12])
def test_split_and_shard_never_cut_an_event(parts):
    events = [event(i, 1 + i % 4) for i in range(9)]
    pieces, norm = split_minibatches(events, parts, "srpo")
    assert norm == 9
    seen = [e.event_id for p in pieces for e in p]
    assert sorted(seen) == sorted(e.event_id for e in events) and len(seen) == len(set(seen))
    shards = [shard_events(events, r, parts, "grpo") for r in range(parts)]
    assert all(n == sum(sum(m.action_mask) for e in events for m in e.members) for _, n in shards)
    covered = [e.event_id for s, _ in shards for e in s]
    assert sorted(covered) == sorted(e.event_id for e in events)


def test_global_normalizer_counts_the_loss_unit():
    events = [event(0, 3), event(1, 1)]
    assert global_normalizer(events, "srpo") == 2
    assert global_normalizer(events, "gspo") == 4
    assert global_normalizer(events, "grpo") == sum(len(m.completion_ids) for e in events for m in e.members)
    with pytest.raises(ValueError, match="valid: grpo, gspo, srpo"):
        global_normalizer(events, "ppo")


def test_collate_pads_prompt_left_and_completion_right():
    e = Event("e", "ep", "t", "s", "x", 0, 2, members=[
        member(prompt=(7, 8), completion=(9,), lp=(-0.5,)),
        member(prompt=(1, 2, 3, 4), completion=(5, 6, 7), mask=(1, 0, 1), lp=(-1.0, -2.0, -3.0)),
    ])
    b = collate([e], pad_token_id=0)
    assert b.prompt_length == 4
    assert b.input_ids.tolist() == [[0, 0, 7, 8, 9, 0, 0], [1, 2, 3, 4, 5, 6, 7]]
    assert b.attention_mask.tolist() == [[0, 0, 1, 1, 1, 0, 0], [1] * 7]
    assert b.action_mask.tolist() == [[1, 0, 0], [1, 0, 1]]
    assert b.behaviour_logprobs.tolist() == [[-0.5, 0, 0], [-1.0, 0.0, -3.0]]
    assert b.completion_ids.tolist() == [[9, 0, 0], [5, 6, 7]]
    assert b.set_sizes.tolist() == [2] and b.event_index.tolist() == [0, 0]
