"""The training check's model and data: a decoder-only transformer of the Llama family.

Blocks of RMSNorm → causal self-attention with rotary positions (through
``scaled_dot_product_attention``) → RMSNorm → SwiGLU feed-forward, each with its residual; a
final RMSNorm and an output projection not tied to the embedding, as Llama 3's. Sized by the
``training`` config section (``dim``, ``layers``, ``heads``, ``vocab``, ``seq_len`` and the
feed-forward width ``ffn``). Initialised from a seed, so that every rank and the reference
hold the same weights.

The tokens are synthetic and learnable: a fixed permutation ``perm`` of the vocabulary (drawn
from the seed) is the language. Each token is, with probability ``FOLLOW``, ``perm`` of the one
before, else a draw from Zipf's law over the vocabulary (exponent ``ZIPF_EXPONENT``, the ranks
shuffled by ``perm``), as word frequencies go. Loss starts at about ln(vocab) and falls within
a few steps as the model learns the frequencies, then the successions (measured on the CPU
model, lr 3e-3: 6.26 at the first step, 5.2-5.5 from the fifth); no download, and every rank
can make any rank's batch from ``(seed, step, rank)``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

FOLLOW = 0.5
ZIPF_EXPONENT = 1.1


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.w1 = nn.Linear(dim, ffn, bias=False)   # gate
        self.w3 = nn.Linear(dim, ffn, bias=False)   # up
        self.w2 = nn.Linear(ffn, dim, bias=False)   # down

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).view(b, t, 3, self.heads,
                                                         d // self.heads).unbind(2)
        q, k = _rotate(q, rope), _rotate(k, rope)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, d))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, ffn: int, seq_len: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.rope = _frequencies(dim // heads, seq_len)  # not a parameter: never sharded

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        rope = tuple(f[:tokens.shape[1]].to(x.device) for f in self.rope)
        for block in self.layers:
            x = block(x, rope)
        return self.output(self.norm(x))


def build(cfg: dict, seed: int, device: torch.device) -> Transformer:
    """The model of config section ``cfg``, its weights drawn from ``seed`` on ``device`` (the
    same numbers on every rank of one device type). Made on the meta device first: a billion
    parameters drawn on one CPU thread take minutes, on a GPU well under a second."""
    with torch.device("meta"):
        model = Transformer(cfg["vocab"], cfg["dim"], cfg["layers"], cfg["heads"], cfg["ffn"],
                            cfg["seq_len"])
    model.to_empty(device=device)
    model.rope = _frequencies(cfg["dim"] // cfg["heads"], cfg["seq_len"])
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # RMSNorm's scale
                continue
            # Llama's scale: std 0.02, the residual outputs scaled down by depth
            std = 0.02 / math.sqrt(2 * cfg["layers"]) if name.endswith(("wo.weight",
                                                                      "w2.weight")) else 0.02
            nn.init.trunc_normal_(p, std=std, a=-3 * std, b=3 * std, generator=gen)
    return model


def _frequencies(head_dim: int, seq_len: int, theta: float = 500000.0):
    """Rotary embedding's cos and sin per position and frequency (Llama 3's base 500,000)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate each (even, odd) pair of ``x`` (batch, time, heads, head_dim) by its angle."""
    cos, sin = (f[None, :, None, :] for f in rope)
    even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos),
                       dim=-1).flatten(-2).type_as(x)


def language(vocab: int, seed: int) -> torch.Tensor:
    """The permutation that is the synthetic language: token t is followed by perm[t]."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))


def batch(perm: torch.Tensor, rows: int, seq_len: int, seed: int, step: int, rank: int):
    """``(inputs, targets)`` of ``rows`` sequences for ``rank`` at ``step``, on CPU: the same
    on every rank that asks for the same triple."""
    gen = torch.Generator().manual_seed(((seed * 1000003 + step) * 1000003 + rank) % (1 << 63))
    vocab = len(perm)
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float32) ** ZIPF_EXPONENT
    tokens = perm[torch.multinomial(zipf.expand(rows, vocab), seq_len + 1, replacement=True,
                                    generator=gen)]
    follows = torch.rand(rows, seq_len + 1, generator=gen) < FOLLOW
    for i in range(seq_len):
        tokens[:, i + 1] = torch.where(follows[:, i + 1], perm[tokens[:, i]], tokens[:, i + 1])
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def parameters(model: nn.Module) -> tuple[int, int]:
    """``(all parameters, parameters without the embedding)``."""
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.tok_embeddings.weight.numel()


def flops_per_token(cfg: dict, non_embedding: int) -> int:
    """Model FLOPs per trained token, forward and backward: ``6 N + 12 L H Q T`` — N the
    parameters without the embedding, L layers, H heads, Q the head dimension, T the sequence
    length. The formula of PaLM (Chowdhery et al. 2022, arXiv 2204.02311, appendix B) that
    TorchTitan's MFU uses too: 6 FLOPs per parameter and token (2 forward, 4 backward) plus
    the attention's score and value products, causal masking not discounted; recomputation
    not counted."""
    return (6 * non_embedding + 12 * cfg["layers"] * cfg["heads"]
            * (cfg["dim"] // cfg["heads"]) * cfg["seq_len"])
