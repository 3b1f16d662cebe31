"""Random token batches in the PPO layout that the trainer's forwards expect."""

from __future__ import annotations

import torch


def ppo_layout_batch(
    g: torch.Generator,
    vocab: int,
    prompt_len: list[int],
    response_len: list[int],
    P: int,
    T: int,
    pad: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts left-padded to P, responses right-padded to T (EOS then pads).

    Returns ``input_ids`` and ``attention_mask`` (N, P + T) and a float ``response_mask``
    (N, T); the token ids are the generator's first draw.
    """
    ids = torch.randint(3, vocab, (len(prompt_len), P + T), generator=g)
    prompt = torch.tensor(prompt_len)[:, None]
    response = torch.tensor(response_len)[:, None]
    cols = torch.arange(P + T)
    mask = ((cols >= P - prompt) & (cols < P + response)).long()
    response_mask = (torch.arange(T) < response).float()
    return ids.masked_fill(mask == 0, pad), mask, response_mask
