"""The chunked LM head + cross-entropy against the plain one, in float64."""

import pytest
import torch

from megamoe.train.loss import IGNORE_INDEX, chunked_linear_cross_entropy, resolve_implementation
from moe_testing import BASE_SEED, rel_err


def _plain(hidden, weight, labels):
    logits = hidden @ weight.t()
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX,
                                             reduction="sum")


@pytest.mark.parametrize("tokens, chunk", [(37, 8), (64, 64), (50, 1000), (1, 4)])
def test_chunked_matches_plain_fp64(tokens, chunk):
    generator = torch.Generator().manual_seed(BASE_SEED + tokens)
    H, V = 24, 97
    hidden = torch.randn(tokens, H, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, generator=generator, requires_grad=True)
    labels = torch.randint(0, V, (tokens,), generator=generator)
    labels[torch.rand(tokens, generator=generator) < 0.2] = IGNORE_INDEX  # some ignored rows
    scale = torch.rand((), dtype=torch.float64, generator=generator) + 0.5

    loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)
    (loss * scale).backward()
    dh, dw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    expected = _plain(hidden, weight, labels)
    (expected * scale).backward()

    assert loss.dtype == torch.float64
    assert abs(loss.item() - expected.item()) <= 1e-12 * max(1.0, abs(expected.item()))
    assert rel_err(dh, hidden.grad) < 1e-12
    assert rel_err(dw, weight.grad) < 1e-12
    ignored = labels == IGNORE_INDEX
    assert torch.equal(dh[ignored], torch.zeros_like(dh[ignored]))


def test_chunked_bf16_close_to_fp64():
    generator = torch.Generator().manual_seed(BASE_SEED + 1)
    hidden = torch.randn(70, 32, generator=generator)
    weight = torch.randn(300, 32, generator=generator) * 0.2
    labels = torch.randint(0, 300, (70,), generator=generator)
    h16 = hidden.bfloat16().requires_grad_()
    w16 = weight.bfloat16().requires_grad_()
    loss = chunked_linear_cross_entropy(h16, w16, labels, chunk_size=16)
    loss.backward()
    h64 = h16.detach().double().requires_grad_()
    w64 = w16.detach().double().requires_grad_()
    expected = _plain(h64, w64, labels)
    expected.backward()
    assert loss.dtype == torch.float32 and h16.grad.dtype == torch.bfloat16
    assert abs(loss.item() - expected.item()) < 1e-2 * abs(expected.item())
    assert rel_err(h16.grad, h64.grad) < 2e-2
    assert rel_err(w16.grad, w64.grad) < 2e-2


def test_chunked_checks_shapes():
    with pytest.raises(ValueError, match="labels"):
        chunked_linear_cross_entropy(torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="weight"):
        chunked_linear_cross_entropy(torch.zeros(4, 8), torch.zeros(10, 7), torch.zeros(4, dtype=torch.long))


def _loss_and_grads(hidden, weight, labels, chunk, implementation):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = chunked_linear_cross_entropy(h, w, labels, chunk_size=chunk,
                                        implementation=implementation)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def test_compiled_matches_eager_bf16():
    # torch.compile's CPU code (C++): the same fused function that runs as Triton on CUDA.
    # 70 tokens in chunks of 16: the last chunk is shorter and reuses the compiled code.
    generator = torch.Generator().manual_seed(BASE_SEED + 2)
    tokens, H, V = 70, 32, 300
    hidden = torch.randn(tokens, H, generator=generator).bfloat16()
    weight = (torch.randn(V, H, generator=generator) * 0.3).bfloat16()
    labels = torch.randint(0, V, (tokens,), generator=generator)
    labels[torch.rand(tokens, generator=generator) < 0.2] = IGNORE_INDEX
    eager = _loss_and_grads(hidden, weight, labels, 16, "eager")
    compiled = _loss_and_grads(hidden, weight, labels, 16, "compiled")
    assert compiled[0].dtype == torch.float32
    assert compiled[0].item() == pytest.approx(eager[0].item(), rel=1e-6)
    # The same fp32 values rounded once to bf16 (a compiler may round an exp differently):
    # far closer than one bf16 step (2^-8 relative).
    for got, want in zip(compiled[1:], eager[1:]):
        assert got.dtype == torch.bfloat16
        assert rel_err(got, want) < 2**-10
    ignored = labels == IGNORE_INDEX
    assert torch.equal(compiled[1][ignored], torch.zeros_like(compiled[1][ignored]))
    # And both against float64 on the same bf16 inputs.
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    expected = _plain(h64, w64, labels)
    expected.backward()
    assert abs(compiled[0].item() - expected.item()) < 1e-3 * abs(expected.item())  # bf16 logits
    assert rel_err(compiled[1], h64.grad) < 2e-2 and rel_err(compiled[2], w64.grad) < 2e-2
    # Without gradients wanted, the compiled loss alone (another graph) is the same.
    with torch.no_grad():
        alone = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=16,
                                             implementation="compiled")
    assert alone.item() == pytest.approx(compiled[0].item(), rel=1e-6)


def test_implementation_choice():
    with pytest.raises(ValueError, match="implementation"):
        chunked_linear_cross_entropy(torch.zeros(4, 8), torch.zeros(10, 8),
                                     torch.zeros(4, dtype=torch.long), implementation="fused")
    assert resolve_implementation("auto", torch.device("cpu")) == "eager"
    assert resolve_implementation("auto", torch.device("cuda")) == "compiled"
    assert resolve_implementation("eager", torch.device("cuda")) == "eager"


def test_auto_falls_back_to_eager_when_compiling_fails(monkeypatch):
    # 'auto' on CUDA compiles; where torch.compile cannot build code it warns once and runs
    # the eager ops, while an explicit 'compiled' raises. Simulated on CPU: the chunk
    # function of a CUDA 'auto' with a compiler that fails.
    from megamoe.train import loss as loss_mod

    calls = []

    def failing(*args):
        calls.append(1)
        raise torch._dynamo.exc.BackendCompilerFailed(failing, RuntimeError("no C compiler"), None)

    monkeypatch.setattr(loss_mod, "_compiled", lambda: failing)
    monkeypatch.setattr(loss_mod, "_compile_failures", [])
    generator = torch.Generator().manual_seed(BASE_SEED + 3)
    logits = torch.randn(6, 11, generator=generator).bfloat16()
    labels = torch.tensor([1, 2, IGNORE_INDEX, 4, 5, 10])
    auto = loss_mod._chunk_function("auto", torch.device("cuda"))
    with pytest.warns(RuntimeWarning, match=r"'auto'.*no C compiler.*eager"):
        total, grad = auto(logits, labels, IGNORE_INDEX, torch.float32, True)
    want_total, want_grad = loss_mod._loss_and_grad_eager(logits, labels, IGNORE_INDEX,
                                                          torch.float32, True)
    assert torch.equal(total, want_total) and torch.equal(grad, want_grad)
    auto(logits, labels, IGNORE_INDEX, torch.float32, True)  # no second attempt or warning
    assert len(calls) == 1
    strict = loss_mod._chunk_function("compiled", torch.device("cuda"))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
        strict(logits, labels, IGNORE_INDEX, torch.float32, True)
