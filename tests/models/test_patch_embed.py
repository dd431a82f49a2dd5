"""The patch embedding as a matrix product (raggedvl.models.patch_embed): the Conv3d's function,
weights and state dict, for every Qwen-VL family, through a whole retriever and its gradients."""

import copy
import pickle

import pytest
import torch
from torch import nn

from raggedvl.models import TinySizes, WholePatchConv3d, build_retriever, install_linear_patch_embed
from tests.models.helpers import make_batch, tiny_tokenizer

SMALL = TinySizes(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                  vision_depth=2, vision_embed_dim=32, vision_heads=2)


def _patch_convs(model: nn.Module) -> list[nn.Conv3d]:
    return [m.proj for m in model.modules() if type(m).__name__.endswith("PatchEmbed")]


def _as_plain_conv(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose patch embeddings are ordinary Conv3d modules again."""
    plain = copy.deepcopy(model)
    for conv in _patch_convs(plain):
        conv.__class__ = nn.Conv3d
    return plain


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    weights = torch.linspace(-1.0, 1.0, out.embeddings.shape[-1], dtype=out.embeddings.dtype)
    loss = (out.embeddings * weights).sum()
    loss.backward()
    return out.embeddings.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_retriever_patch_embedding_is_the_convolution_as_a_matrix_product(family):
    fast = build_retriever("tiny", processor=tiny_tokenizer(), tiny_family=family, tiny_sizes=SMALL, seed=0).double()
    convs = _patch_convs(fast)
    assert len(convs) == 1 and type(convs[0]) is WholePatchConv3d  # switched when the retriever was built
    plain = _as_plain_conv(fast)
    assert type(_patch_convs(plain)[0]) is nn.Conv3d
    patch_dim = convs[0].weight[0].numel()
    batch = make_batch(["sample quantiles", "an introduction to R", "biplot"], [[(1, 4, 6)], [(1, 8, 4), (1, 2, 2)], []],
                       patch_dim=patch_dim, dtype=torch.float64)
    emb_fast, grads_fast = _loss_and_grads(fast, batch)
    emb_plain, grads_plain = _loss_and_grads(plain, batch)
    torch.testing.assert_close(emb_fast, emb_plain, rtol=1e-12, atol=1e-12)
    assert grads_fast.keys() == grads_plain.keys()
    conv_weight = next(n for n in grads_fast if n.endswith("patch_embed.proj.weight"))
    assert torch.count_nonzero(grads_fast[conv_weight]) > 0  # the patch embedding trains
    for name in grads_fast:
        torch.testing.assert_close(grads_fast[name], grads_plain[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("bias", [False, True])  # Qwen2/2.5-VL: no bias; Qwen3-VL: bias
def test_float32_outputs_and_weight_gradients_match_the_convolution_to_rounding(bias):
    torch.manual_seed(0)
    conv = nn.Conv3d(3, 48, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=bias)
    fast = copy.deepcopy(conv)
    fast.__class__ = WholePatchConv3d
    x = torch.randn(500, 3, 2, 14, 14)
    grad_out = torch.randn(500, 48, 1, 1, 1)
    y_conv, y_fast = conv(x), fast(x)
    assert y_fast.shape == y_conv.shape == (500, 48, 1, 1, 1)
    (y_conv * grad_out).sum().backward()
    (y_fast * grad_out).sum().backward()
    torch.testing.assert_close(y_fast, y_conv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.weight.grad, conv.weight.grad, rtol=1e-5, atol=1e-4)
    if bias:
        torch.testing.assert_close(fast.bias.grad, conv.bias.grad)


def test_other_inputs_run_the_convolution():
    torch.manual_seed(0)
    conv = nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 4, 4))
    fast = copy.deepcopy(conv)
    fast.__class__ = WholePatchConv3d
    video = torch.randn(2, 3, 4, 8, 12)  # several windows per input: a real convolution
    torch.testing.assert_close(fast(video), conv(video))


def test_state_dict_pickling_and_idempotence():
    model = build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=SMALL, seed=0)
    plain = _as_plain_conv(model)
    assert list(model.state_dict()) == list(plain.state_dict())  # checkpoints unchanged
    assert install_linear_patch_embed(model) == 1  # already switched: still one, nothing else touched
    again = pickle.loads(pickle.dumps(model))
    assert type(_patch_convs(again)[0]) is WholePatchConv3d
    batch = make_batch(["sample quantiles"], [[(1, 4, 4)]])
    with torch.no_grad():
        torch.testing.assert_close(again(**batch).embeddings, model(**batch).embeddings, rtol=0, atol=0)


def test_convolutions_that_are_not_whole_patch_products_are_left_alone():
    class PatchEmbed(nn.Module):
        def __init__(self, proj):
            super().__init__()
            self.proj = proj

    overlapping = PatchEmbed(nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 2, 2)))
    padded = PatchEmbed(nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 4, 4), padding=1))
    not_a_conv = PatchEmbed(nn.Linear(96, 8))  # e.g. a peft layer in its place
    other_name = nn.Sequential(nn.Conv3d(3, 8, kernel_size=2, stride=2))
    model = nn.ModuleList([overlapping, padded, not_a_conv, other_name])
    assert install_linear_patch_embed(model) == 0
    assert type(overlapping.proj) is nn.Conv3d and type(padded.proj) is nn.Conv3d
    assert type(other_name[0]) is nn.Conv3d


def test_empty_input_and_torchscript_behave_as_the_convolution():
    torch.manual_seed(0)
    conv = nn.Conv3d(3, 16, kernel_size=(2, 14, 14), stride=(2, 14, 14))
    fast = copy.deepcopy(conv)
    fast.__class__ = WholePatchConv3d
    empty = torch.empty(0, 3, 2, 14, 14)
    assert fast(empty).shape == conv(empty).shape == (0, 16, 1, 1, 1)
    scripted = torch.jit.script(fast)
    x = torch.randn(5, 3, 2, 14, 14)
    torch.testing.assert_close(scripted(x), conv(x), rtol=1e-5, atol=1e-5)
    video = torch.randn(1, 3, 4, 28, 28)  # the convolution path inside the scripted module too
    torch.testing.assert_close(scripted(video), conv(video))


def test_bfloat16_weight_gradient_stays_within_bfloat16_rounding_of_float64():
    torch.manual_seed(0)
    conv = nn.Conv3d(3, 64, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False)
    x, grad_out = torch.randn(2000, 3, 2, 14, 14), torch.randn(2000, 64, 1, 1, 1)
    reference = copy.deepcopy(conv).double()
    reference(x.double()).backward(grad_out.double())
    fast = copy.deepcopy(conv).bfloat16()
    fast.__class__ = WholePatchConv3d
    fast(x.bfloat16()).backward(grad_out.bfloat16())
    error = (fast.weight.grad.double() - reference.weight.grad).abs().max() / reference.weight.grad.abs().max()
    assert error < 0.02  # bf16 rounding of inputs and product (0.4 % here; the CPU Conv3d's was 13-17 %)
