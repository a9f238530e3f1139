"""What the vLLM tests compare an engine with: the trainer's teacher-forced log-probs of the
engine's own samples (used by tests/rollout/test_vllm.py and by its torchrun ranks, tests/helpers/vllm_fsdp_worker.py;
needs no vLLM itself)."""

import torch

from srpo.events import Event, Member, collate


def trainer_logprobs(policies, requests, samples, grad=False) -> list[torch.Tensor]:
    """Per sample, the (completion length,) log-probs of its tokens under its role's policy — a
    log-prob pass per sample through ``policies`` (under FSDP a collective: every rank passes the
    same requests)."""
    out = []
    for i, (r, s) in enumerate(zip(requests, samples)):
        pid = policies.policy_of(r.role)
        e = Event(event_id=f"e{i}", episode_id="x", task_id="t", prior_state_id="s", event_type="t", turn=0,
                  expected_size=1)
        e.members.append(Member(role=r.role, policy_id=pid, policy_version=0, prompt_ids=r.prompt_ids,
                                completion_ids=s.completion_ids, action_mask=[1] * len(s.completion_ids),
                                behaviour_logprobs=s.logprobs, member_index=0, text=s.text, truncated=s.truncated,
                                temperature=r.params.temperature))
        b = collate([e], policies.tokenizer.pad_token_id)
        with torch.set_grad_enabled(grad):
            lp = policies.logprobs(pid, b.input_ids, b.attention_mask, b.prompt_length, action_mask=b.action_mask,
                                   temperature=b.temperatures)
        out.append(lp[0, :len(s.completion_ids)])
    return out


def max_gap(policies, requests, samples, ref=None) -> float:
    """The largest |engine − trainer| per-token log-prob over the samples (``ref``: the trainer's,
    when already computed)."""
    ref = trainer_logprobs(policies, requests, samples) if ref is None else ref
    return max(float((torch.tensor(s.logprobs) - r).abs().max()) for s, r in zip(samples, ref) if s.completion_ids)
