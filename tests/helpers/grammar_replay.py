"""What a constrained sample's behaviour log-probs must be, recomputed by hand: for each token, the
model's unmasked log-prob (π_old) and log Z_t, the mass its grammar allowed at that step — so the
masked, renormalised log-prob is their difference.  For the sampler's and the vLLM engine's tests."""

import torch

from srpo.policies.grammar import GrammarRows
from srpo.policies.decoding import eos_token_ids


def replayed(model, tokenizer, prompt: list[int], completion: list[int], params) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, log_z), each (T,): per completion token, log p(y_t) at the row's temperature and
    log Σ_{allowed} p — from one teacher-forced pass and the grammar replayed token by token."""
    ids = torch.tensor([prompt + completion], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float().cpu()
    full = torch.log_softmax(logits / (params.temperature or 1.0), -1)
    rows = GrammarRows(tokenizer, [params], logits.shape[-1], eos_token_ids(model, tokenizer))
    old, log_z = [], []
    for t, token in enumerate(completion):
        allowed = rows.masked(torch.zeros(1, logits.shape[-1]), [0])[0] == 0
        old.append(float(full[t, token]))
        log_z.append(float(torch.logsumexp(full[t][allowed], -1)))
        rows.advance(0, token)
    return torch.tensor(old), torch.tensor(log_z)
