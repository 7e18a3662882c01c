"""What backends make of log-prob rows: a token drawn from one, the greedy flags of a score."""

from __future__ import annotations

import torch

from shared.errors import InvalidRequest


def with_greedy(rows: torch.Tensor, continuation: list[int]) -> torch.Tensor:
    """``[n, 2]`` from the ``[n, V]`` log-prob rows of a continuation's positions: each
    token's log-prob, and 1.0 where it is the row's argmax (``torch.argmax``: the lowest id of
    a tie), as lm-evaluation-harness's ``is_greedy`` asks."""
    index = torch.tensor(continuation, device=rows.device)
    picked = rows.gather(1, index[:, None])[:, 0].float()
    top = (rows.argmax(dim=-1) == index).float()
    return torch.stack([picked, top], dim=1).cpu()


def draw(logprobs: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """One token from ``softmax(logprobs / temperature)`` (genlm-backend's rule); temperature
    0 takes the most likely token."""
    if temperature == 0:
        return int(torch.argmax(logprobs).item())
    row = logprobs.float().cpu()
    probs = torch.softmax(row / temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        # a temperature so small that logprobs / temperature overflowed: its limit, the most
        # likely tokens (in float64, shifted to 0 first, the rest fall to -inf, not NaN)
        probs = torch.softmax((row.double() - row.max()) / temperature, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            raise InvalidRequest(f"temperature {temperature!r} gives no distribution to draw from")
    return int(torch.multinomial(probs, num_samples=1, generator=generator).item())
