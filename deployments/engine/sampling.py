"""Token sampling for a batch of rows, each with its own parameters and generator.

Vectorized over rows (one sort / softmax for the whole batch); only the random
draw is per row, so that a seeded request gives the same tokens whatever else
is in the batch. The draw uses the exponential race (argmax p / E, E ~ Exp(1)),
which samples exactly from p with a single argmax.

A row whose largest logit is not finite (the model overflowed its dtype: a NaN or +inf
anywhere, or every logit -inf) gets None instead of a token: an argmax over NaN picks
an arbitrary token, which would stream as if it were an answer. Some -inf logits beside
finite ones (tokens a checkpoint bans) are fine.
"""

from __future__ import annotations

from typing import Sequence

import torch

from deployments.engine.request import GREEDY_BELOW


def sample(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_p: Sequence[float],
    top_k: Sequence[int],
    generators: Sequence[torch.Generator | None],
) -> list[int | None]:
    """logits: [R, V]; one entry per row in the other arguments. A temperature below
    ``GREEDY_BELOW`` (0 among them) is greedy.

    Returns the sampled token ids, None for a row whose largest logit is not finite (one
    device->host sync).
    """
    return tokens(sample_on_device(logits, temperature, top_p, top_k, generators).tolist())


def tokens(ids: list[int]) -> list[int | None]:
    """``sample_on_device``'s ids on the host: None where a row's logits were not finite."""
    return [None if t < 0 else t for t in ids]


def sample_on_device(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_p: Sequence[float],
    top_k: Sequence[int],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """``sample`` without waiting for the device: the ids as an int64 tensor [R] on logits'
    device, -1 for a row whose largest logit is not finite."""
    R, V = logits.shape
    finite = torch.isfinite(logits.amax(dim=-1))  # [R]; amax propagates NaN
    out = logits.argmax(dim=-1)  # [R]; greedy rows are done
    rows = [i for i in range(R) if temperature[i] >= GREEDY_BELOW]
    if not rows:
        return torch.where(finite, out, -1)
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    x = logits.index_select(0, idx).float()  # [r, V]
    x = x / torch.tensor([temperature[i] for i in rows], device=dev).unsqueeze(1)
    ks = [top_k[i] if 0 < top_k[i] < V else V for i in rows]
    if min(ks) < V:
        kt = torch.tensor(ks, device=dev)
        vals = torch.topk(x, max(ks), dim=-1).values  # [r, kmax], descending
        thresh = vals.gather(1, (kt - 1).unsqueeze(1))  # k-th largest per row
        x = x.masked_fill(x < thresh, float("-inf"))
    ps = [top_p[i] for i in rows]
    if min(ps) < 1.0:
        sx, si = torch.sort(x, dim=-1, descending=True)
        sp = torch.softmax(sx, dim=-1)
        # drop a token once the mass before it already reaches top_p (the first always stays)
        drop = (sp.cumsum(-1) - sp) > torch.tensor(ps, device=dev).unsqueeze(1)
        x = torch.empty_like(x).scatter_(1, si, sx.masked_fill(drop, float("-inf")))
    probs = torch.softmax(x, dim=-1)
    noise = torch.empty_like(probs)
    for j, i in enumerate(rows):
        noise[j].exponential_(generator=generators[i])
    out[idx] = (probs / noise).argmax(dim=-1)
    return torch.where(finite, out, -1)
