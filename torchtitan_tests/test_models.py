import pytest
import torch

from titanlite.models import MODEL_REGISTRY, build_model, get_model_args
from titanlite.ops.attention import BACKENDS


def count(name, flavor):
    args = get_model_args(name, flavor)
    with torch.device("meta"):
        model = build_model(args)
    # Tied weights appear once in parameters(), as they are stored once.
    return sum(p.numel() for p in model.parameters()), args


def test_llama_1_36b_param_count_and_flops():
    n, args = count("llama", "1.36B")
    assert n == 1_294_159_104 == args.num_params()
    embedding = 32000 * 2304
    expected = 6 * (1_294_159_104 - embedding) + 12 * 18 * 18 * 128 * 2048
    assert args.flops_per_token(2048) == expected == 8_341_802_496


def test_llama_134m_param_count():
    n, args = count("llama", "134M")
    embeddings = 2 * 32000 * 768  # untied input and output
    block = 4 * 768 * 768 + 3 * 768 * 2048 + 2 * 768  # attention, SwiGLU, two norms
    assert n == embeddings + 12 * block + 768 == 134_105_856 == args.num_params()


def test_qwen3_1_8b_param_count():
    n, args = count("qwen3", "1.8B")
    assert n == 1_830_395_904 == args.num_params()
    assert args.num_params(exclude_embedding=True) == 1_830_395_904 - 151936 * 2048
    assert args.flops_per_token(2048) == 6 * 1_519_230_976 + 12 * 24 * 16 * 128 * 2048


def test_qwen3_8b_param_count():
    """Qwen3-8B's shape: 36 layers of attention (32 query and 8 KV heads of 128 over dim 4096), QK-norm,
    SwiGLU of 12288, two norms; untied embeddings of 151936."""
    n, args = count("qwen3", "8B")
    block = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    assert n == 2 * 151936 * 4096 + 36 * block + 4096 == 8_190_735_360 == args.num_params()


def test_every_flavors_formula_count_matches_its_built_module():
    """ModelArgs.num_params (what estimation and MFU use) against the parameters of the module built on
    meta, for every registered flavor."""
    for name, spec in MODEL_REGISTRY.items():
        for flavor in spec.flavors:
            n, args = count(name, flavor)
            assert n == args.num_params(), (name, flavor)


def test_tied_embedding_flops_keep_output_matmul():
    args = get_model_args("qwen3", "debug")
    assert args.tie_embeddings
    assert args.num_params(exclude_embedding=True) == args.num_params()


def test_meta_build_then_init_is_deterministic():
    args = get_model_args("qwen3", "debug")
    outs = []
    for _ in range(2):
        with torch.device("meta"):
            m = build_model(args, "manual", 32)
        m.to_empty(device="cpu")
        torch.manual_seed(0)
        m.init_weights()
        assert m.output.weight is m.tok_embeddings.weight
        outs.append(m(torch.arange(32).view(1, 32)))
    assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[0]).all()


def test_causality():
    args = get_model_args("llama", "debug")
    torch.manual_seed(0)
    with torch.device("meta"):
        m = build_model(args, "manual", 16)
    m.to_empty(device="cpu")
    m.init_weights()
    x = torch.randint(0, args.vocab_size, (1, 16))
    y = x.clone()
    y[0, 10] = (y[0, 10] + 1) % args.vocab_size
    a, b = m(x), m(y)
    assert torch.allclose(a[:, :10], b[:, :10]) and not torch.allclose(a[:, 10:], b[:, 10:])


def test_cpu_backends_agree_with_manual():
    torch.manual_seed(0)
    q = torch.randn(2, 16, 4, 32, requires_grad=True)
    k = torch.randn(2, 16, 2, 32, requires_grad=True)
    v = torch.randn(2, 16, 2, 32, requires_grad=True)
    ref = BACKENDS["manual"]()(q, k, v)
    gref = torch.autograd.grad(ref.sum(), (q, k, v))
    out = BACKENDS["sdpa"]()(q, k, v)
    g = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.allclose(out, ref, atol=1e-5)
    for a, b in zip(g, gref):
        assert torch.allclose(a, b, atol=1e-5)


def test_chunked_loss_without_autograd_matches():
    from titanlite.ops.loss import chunked_linear_cross_entropy, cross_entropy

    torch.manual_seed(0)
    h, w, y = torch.randn(2, 37, 16), torch.randn(50, 16), torch.randint(0, 50, (2, 37))
    ref = cross_entropy(h @ w.t(), y)
    with torch.no_grad():
        assert torch.allclose(chunked_linear_cross_entropy(h, w, y, chunk_tokens=10), ref, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_chunked_loss_gradients_match_the_full_loss(compiled):
    """The chunked loss's own gradients (computed in its forward, chunk by chunk, the last chunk
    short) are autograd's through the full logits, eager and compiled."""
    from titanlite.ops.loss import chunked_linear_cross_entropy, cross_entropy

    torch.manual_seed(0)
    h, w = torch.randn(2, 37, 16, requires_grad=True), (0.3 * torch.randn(50, 16)).requires_grad_()
    y = torch.randint(0, 50, (2, 37))
    loss = chunked_linear_cross_entropy(h, w, y, chunk_tokens=10, compiled=compiled)
    (2.5 * loss).backward()  # the incoming gradient scales both
    ref = cross_entropy(h @ w.t(), y)
    rh, rw = torch.autograd.grad(2.5 * ref, (h, w))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, rh, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad, rw, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chunked_loss_gradients_on_cuda():
    """The CUDA path adds each chunk's output-weight gradient with one fp32-output GEMM (addmm with
    out_dtype, into the accumulator): gradients of the autograd reference, at bf16 input precision."""
    from titanlite.ops.loss import chunked_linear_cross_entropy, cross_entropy

    torch.manual_seed(0)
    h = torch.randn(2, 300, 64, device="cuda", requires_grad=True)
    w = (0.1 * torch.randn(500, 64, device="cuda")).requires_grad_()
    y = torch.randint(0, 500, (2, 300), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):  # fp32 weight, bf16 matmuls: the default path
        loss = chunked_linear_cross_entropy(h, w, y, chunk_tokens=128)
    gh, gw = torch.autograd.grad(loss, (h, w))
    hr, wr = h.detach().bfloat16().float().requires_grad_(), w.detach().bfloat16().float().requires_grad_()
    ref = cross_entropy(hr @ wr.t(), y)
    rh, rw = torch.autograd.grad(ref, (hr, wr))
    assert gw.dtype == torch.float32 and loss.item() == pytest.approx(ref.item(), rel=1e-3)
    torch.testing.assert_close(gw, rw, rtol=2e-2, atol=2e-5)
    torch.testing.assert_close(gh, rh, rtol=2e-2, atol=2e-5)


def test_init_schemes_draw_their_stated_scales():
    """model.init: 'scaled' keeps small embeddings and one depth scale; 'per_layer' (the Llama reference
    scheme) draws unit embeddings and shrinks wo, w2 and w3 with each block's own depth."""
    import math

    from titanlite.models import build_model
    from titanlite.models.args import ModelArgs

    args = ModelArgs(dim=256, n_layers=4, n_heads=4, vocab_size=512, ffn_dim=512)
    std = lambda t: t.float().std().item()
    models = {}
    for init in ("scaled", "per_layer"):
        torch.manual_seed(0)
        models[init] = m = build_model(args, init=init)
        m.init_weights()
    s, p = models["scaled"], models["per_layer"]
    assert std(s.tok_embeddings.weight) == pytest.approx(0.02, rel=0.05)
    assert std(p.tok_embeddings.weight) == pytest.approx(1.0, rel=0.05)
    for i, block in enumerate(p.layers.values()):
        want = 0.02 / math.sqrt(2 * (i + 1))
        for lin in (block.attention.wo, block.feed_forward.w2, block.feed_forward.w3):
            assert std(lin.weight) == pytest.approx(want, rel=0.1)
    for block in s.layers.values():
        assert std(block.attention.wo.weight) == pytest.approx(0.02 / math.sqrt(8), rel=0.1)
        assert std(block.feed_forward.w3.weight) == pytest.approx(0.02, rel=0.1)


def initial_loss_flavors():
    """(name, flavor, args) for every registered flavor. One over 200M parameters is reduced to 2 blocks
    of 2 heads, a 256-wide FFN and a 4,096-token vocabulary, keeping what sets the logits' scale at
    init (its width, head size and whether its embeddings are tied): it is never materialised whole."""
    import dataclasses

    for name, spec in MODEL_REGISTRY.items():
        for flavor, args in spec.flavors.items():
            if args.num_params() > 200e6:
                args = dataclasses.replace(args, n_layers=2, n_heads=2, n_kv_heads=min(args.kv_heads, 2),
                                           head_dim=args.hdim, ffn_dim=256, vocab_size=4096)
            yield pytest.param(args, id=f"{name}-{flavor}")


@pytest.mark.parametrize("init", ["scaled", "per_layer"])
@pytest.mark.parametrize("args", initial_loss_flavors())
def test_every_flavor_starts_near_the_uniform_guess(args, init):
    """On uniform random tokens the first step's loss is within 0.5 nats of ln(vocab), what a model
    guessing uniformly scores: the init neither favours the input token (tied embeddings) nor spreads
    the logits wide."""
    import math

    torch.manual_seed(0)
    model = build_model(args, "manual", 64, init=init)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (4, 65))
    with torch.no_grad():
        loss = model(tokens[:, :-1], tokens[:, 1:]).item()
    assert abs(loss - math.log(args.vocab_size)) < 0.5, loss
