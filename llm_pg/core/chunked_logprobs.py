"""Target log-probs through the language-model head in chunks of positions: no `[n, V]` logits tensor is held.

For hidden states `h` `[n, H]` (already through the final norm), head weight `W` `[V, H]` and targets `y` `[n]`:

    z = h W^T / T                                   # [n, V], one chunk of positions at a time
    logp_i = z_{i, y_i} - logsumexp_j z_ij          # [n] float32
    entropy_i = -sum_j p_ij log p_ij,  p = softmax(z)   # [n] float32 (a gradient only with `entropy_grad`)

The backward recomputes each chunk's logits and uses `d logp_i / d z_ij = 1[j = y_i] - p_ij` (and, with
`entropy_grad`, `d entropy_i / d z_ij = -p_ij (log p_ij + entropy_i)`), so with `G = g (onehot - p) + g_H (-p (log p
+ entropy))`: `dL/dh = (G / T) W` and `dL/dW = (G / T)^T h`, chunk by chunk. Only `h`, the logsumexp
`[n]` and the targets are saved. Under autocast the head's matmul runs in the autocast dtype and its logits are upcast
to float32, as `losses.target_logprobs` does with a plain head: the same values and gradients to float rounding.
Core math: imports nothing of ours.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _chunk_logits(hidden: Tensor, weight: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:
    """`[c, V]` float32 logits over temperature of one chunk, the matmul in `dtype` (autocast's, as a plain head)."""
    with torch.autocast(hidden.device.type, enabled=False):
        logits = torch.nn.functional.linear(hidden.to(dtype), weight.to(dtype)).float()
    return logits / temperature if temperature != 1.0 else logits


def _head_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype a plain `lm_head` call computes in here: the autocast dtype when autocast is on, else the weight's."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


class _ChunkedTargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy, entropy_grad=False):
        dtype = _head_dtype(hidden, weight)
        logp = hidden.new_empty(len(hidden), dtype=torch.float32)  # [n]
        lse = torch.empty_like(logp)
        entropy = torch.zeros_like(logp)
        for start in range(0, len(hidden), chunk_size):
            stop = start + chunk_size
            logits = _chunk_logits(hidden[start:stop], weight, temperature, dtype)  # [c, V]
            lse[start:stop] = torch.logsumexp(logits, dim=-1)
            logp[start:stop] = logits.gather(-1, targets[start:stop, None]).squeeze(-1) - lse[start:stop]
            if with_entropy:  # exact: the full distribution of each position, one chunk at a time (in place)
                log_probs = logits.sub_(lse[start:stop, None])
                entropy[start:stop] = -log_probs.exp().mul_(log_probs).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        ctx.entropy_grad = entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        temperature, chunk_size, dtype = ctx.temperature, ctx.chunk_size, ctx.dtype
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        # A frozen head (LoRA) gets no [V, H] buffer: zeroing one costs as much as a chunk's matmul
        needs_weight = ctx.needs_input_grad[1]
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight else None
        for start in range(0, len(hidden), chunk_size):
            stop = start + chunk_size
            chunk = hidden[start:stop]
            with torch.no_grad():
                logits = _chunk_logits(chunk, weight, temperature, dtype)  # [c, V] recomputed
                log_probs = logits.sub_(lse[start:stop, None])  # in place of the logits
                entropy_term = None
                if ctx.entropy_grad and grad_entropy is not None:  # g_H * -p (log p + H), before p overwrites them
                    entropy_term = (log_probs + entropy[start:stop, None]).mul_(log_probs.exp()).neg_()
                    entropy_term *= grad_entropy[start:stop, None]
                grad = log_probs.exp_().neg_()  # -p
                grad.scatter_add_(-1, targets[start:stop, None], torch.ones_like(grad[:, :1]))  # onehot - p
                if entropy_term is None:
                    grad *= grad_logp[start:stop, None] / temperature
                else:
                    grad = (grad * grad_logp[start:stop, None] + entropy_term) / temperature
                grad = grad.to(dtype)  # the plain head's backward runs its matmuls in the logits' dtype
                if grad_hidden is not None:
                    grad_hidden[start:stop] = grad @ weight.to(dtype)
                if grad_weight is not None:
                    grad_weight += (grad.t() @ chunk.to(dtype)).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def chunked_target_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 256,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """`log_softmax(hidden @ weight.T / T)[targets]` and, with `with_entropy`, the entropy of each position.

    Args:
        hidden: `[..., H]` final hidden states (after the model's last norm).
        weight: `[V, H]` the head's weight (a head without bias: Llama, Qwen2).
        targets: `[...]` long, the token each position scores.
        temperature: divides the logits before the softmax.
        chunk_size: positions per chunk of `[chunk_size, V]` logits.
        with_entropy: also return each position's entropy; `entropy_grad`: differentiable (the entropy bonus).

    Returns:
        log-probs `[...]` float32 (differentiable in `hidden` and `weight`), and the entropy `[...]` float32 (with a
        gradient only with `entropy_grad`) or None.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    shape = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [n, H]
    logp, entropy = _ChunkedTargetLogprobs.apply(
        flat_hidden,
        weight,
        targets.reshape(-1),
        float(temperature),
        int(chunk_size),
        with_entropy or entropy_grad,
        entropy_grad,
    )
    return logp.view(shape), entropy.view(shape) if with_entropy or entropy_grad else None
