"""LM head + cross-entropy in chunks of tokens, without ever holding [tokens, vocab] logits.

For a 16384-token sequence and a 151936-word vocabulary the fp32 logits alone are 10 GB,
and autograd would keep them (and their softmax) for the backward. Here the forward walks
the tokens in chunks: per chunk it computes the logits (in the hidden states' dtype, as the
LM head's matmul would), their log-sum-exp and the loss in fp32, and at once the gradient of
the summed loss w.r.t. the chunk's hidden states and its share of the head's weight
gradient. Only those gradients ([tokens, hidden] and [vocab, hidden]) are kept for the
backward, which just scales them by the incoming gradient.

Between the chunk's matmuls, the loss and the logits' gradient (softmax - one_hot, in fp32,
rounded once to the logits' dtype) come from one of two implementations of the same math:
"eager" (PyTorch ops over an fp32 copy of the chunk's logits: about six passes over it) and
"compiled" (the same function through torch.compile, which fuses it into a reduction and a
pointwise pass that read the bf16 logits and write the bf16 gradient). "auto" picks the
compiled one on CUDA and the eager one elsewhere (a CPU run then needs no C++ compiler).
"""

from __future__ import annotations

import functools
import warnings

import torch

from .config import LOSS_IMPLEMENTATIONS as IMPLEMENTATIONS

IGNORE_INDEX = -100


def _chunk_loss(x: torch.Tensor, labels: torch.Tensor, ignore_index: int):
    """(valid rows, their labels (0 elsewhere), log-sum-exp, sum of the valid rows' losses)
    of logits x, in x's dtype."""
    valid = labels != ignore_index
    target = torch.where(valid, labels, 0)
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, target[:, None]).squeeze(1)
    return valid, target, lse, torch.where(valid, lse - picked, 0).sum()


def _loss_and_grad_eager(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                         accumulate: torch.dtype, want_grad: bool):
    """(sum of the chunk's token losses, d(that sum)/d logits in `accumulate` or None)."""
    logits = logits.to(accumulate)
    valid, target, lse, total = _chunk_loss(logits, labels, ignore_index)
    if not want_grad:
        return total, None
    # d(sum of losses)/d logits = softmax - one_hot(label), zero for ignored rows; computed
    # in place over the chunk's fp32 logits.
    grad = logits.sub_(lse[:, None]).exp_()
    grad[torch.arange(len(labels), device=labels.device), target] -= 1
    grad.mul_(valid[:, None])
    return total, grad


def _loss_and_grad_fusable(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                           accumulate: torch.dtype, want_grad: bool):
    """The eager function's math written out of place, for torch.compile to fuse: the fp32
    copy of the logits then never reaches memory. The gradient is in the logits' dtype."""
    x = logits.to(accumulate)
    valid, target, lse, total = _chunk_loss(x, labels, ignore_index)
    if not want_grad:
        return total, None
    columns = torch.arange(x.shape[1], device=x.device)
    one_hot = (columns[None, :] == target[:, None]).to(accumulate)
    grad = torch.where(valid[:, None], torch.exp(x - lse[:, None]) - one_hot, 0)
    return total, grad.to(logits.dtype)


@functools.cache
def _compiled():
    # dynamic=False: the vocabulary (the reduction's length) stays a constant of the kernel;
    # the row count is marked dynamic per call, so the last, shorter chunk reuses the code.
    # Inductor's deterministic mode picks each reduction's block sizes by its heuristics
    # instead of timing candidates on the device: the timed pick may differ between
    # processes, and with it the summation order, so two identical runs would no longer
    # give bitwise-equal losses.
    return torch.compile(_loss_and_grad_fusable, dynamic=False, fullgraph=True,
                         options={"deterministic": True})


def _loss_and_grad_compiled(logits, labels, ignore_index, accumulate, want_grad):
    torch._dynamo.maybe_mark_dynamic(logits, 0)
    torch._dynamo.maybe_mark_dynamic(labels, 0)
    return _compiled()(logits, labels, ignore_index, accumulate, want_grad)


_compile_failures: list[str] = []  # why 'auto' fell back to the eager ops (once a process)


def _loss_and_grad_auto(logits, labels, ignore_index, accumulate, want_grad):
    """'auto' on CUDA: the compiled function, unless torch.compile cannot build code on this
    machine (e.g. Triton finds no C compiler for its launcher): then the eager ops, said
    once. An explicit 'compiled' raises instead."""
    if not _compile_failures:
        try:
            return _loss_and_grad_compiled(logits, labels, ignore_index, accumulate, want_grad)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            reason = f"{type(error.inner_exception).__name__}: {error.inner_exception}"
            _compile_failures.append(reason)
            warnings.warn("chunked_linear_cross_entropy (train.loss_implementation = 'auto'): "
                          f"torch.compile failed ({reason.splitlines()[0]}); running the eager "
                          "ops instead ('compiled' makes this an error, 'eager' skips the "
                          "attempt)", RuntimeWarning, stacklevel=2)
    return _loss_and_grad_eager(logits, labels, ignore_index, accumulate, want_grad)


def resolve_implementation(implementation: str, device: torch.device) -> str:
    """'compiled' or 'eager': what `implementation` runs on `device` ('auto' may still fall
    back to eager when compiling fails)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"chunked_linear_cross_entropy: implementation must be one of "
                         f"{', '.join(IMPLEMENTATIONS)}, got {implementation!r}")
    if implementation == "auto":
        return "compiled" if device.type == "cuda" else "eager"
    return implementation


def _chunk_function(implementation: str, device: torch.device):
    kind = resolve_implementation(implementation, device)
    if kind == "eager":
        return _loss_and_grad_eager
    return _loss_and_grad_auto if implementation == "auto" else _loss_and_grad_compiled


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                chunk_size: int, ignore_index: int, loss_and_grad):
        needs_hidden, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_grad = needs_hidden or needs_weight
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        # Each chunk's weight-gradient GEMM rounds to the weight's dtype, as the plain
        # backward's single GEMM would; the sum over chunks is kept in fp32 (fp64 for fp64).
        accumulate = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) \
            if needs_weight else None
        total = torch.zeros((), dtype=accumulate, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start:start + chunk_size]
            chunk_total, grad_logits = loss_and_grad(h @ weight.t(),
                                                     labels[start:start + chunk_size],
                                                     ignore_index, accumulate, want_grad)
            total += chunk_total
            if not want_grad:
                continue
            grad_logits = grad_logits.to(hidden.dtype)
            if needs_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[start:start + chunk_size])
            if needs_weight:
                grad_weight += grad_logits.t() @ h
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        # Scaled in fp32: rounding the incoming factor to bf16 first would bias every
        # gradient by up to 2^-8 of its size.
        dh = (grad_hidden.to(grad_total.dtype) * grad_total).to(grad_hidden.dtype) \
            if grad_hidden is not None else None
        dw = (grad_weight * grad_total).to(ctx.weight_dtype) if grad_weight is not None else None
        return dh, dw, None, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                                 labels: torch.Tensor, chunk_size: int = 2048,
                                 ignore_index: int = IGNORE_INDEX,
                                 implementation: str = "auto") -> torch.Tensor:
    """sum over tokens of cross_entropy(hidden @ weight.T, labels), ignore_index rows
    skipped, as a scalar (fp32; fp64 for fp64 inputs). hidden [N, H], weight [V, H],
    labels [N] int64. Divide by the number of counted tokens for the mean.
    `implementation`: 'auto', 'compiled' or 'eager' (the module docstring says which)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"chunked_linear_cross_entropy: expected hidden [N, H] and weight "
                         f"[V, H], got {list(hidden.shape)} and {list(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"chunked_linear_cross_entropy: expected labels [N={hidden.shape[0]}], "
                         f"got {list(labels.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunked_linear_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk_size, ignore_index,
                                            _chunk_function(implementation, hidden.device))
