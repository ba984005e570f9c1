"""The model and data of ``examples/train_gpt.py``: a small GPT and a deterministic character-level corpus.

Kept apart from the training script so that the script reads as what it demonstrates (checkpointing,
failure, resume) and this file as an ordinary, minimal GPT:

- ``GPT``: token and position embeddings, ``n_layer`` pre-norm transformer blocks (causal multi-head
  self-attention and a GELU MLP, both with dropout) and a linear LM head. Attention is written out with
  matmuls and an explicit causal mask rather than ``scaled_dot_product_attention``, whose fused GPU
  kernels are not deterministic in their backward pass.
- ``TextBatches``: next-character prediction windows over ``CORPUS``. The sample at position ``p`` of the
  stream depends only on ``p`` (and the seed), and a step consumes exactly one global batch, so the data
  a step sees depends only on the step. Its position is part of the checkpoint (``state_dict``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

# A small original text (no external download): enough characters for a few hundred distinct windows.
CORPUS = (
    "The keeper of the lighthouse wrote the state of the lamp into a small book every evening. "
    "When a storm broke the glass, he did not start again from the first page: he opened the book at "
    "the last line he had written, trimmed the wick to the length it had, set the lens to the angle it "
    "had, and the light went on turning as if nothing had happened.\n"
    "A ship that watched the coast that night counted the flashes and found no gap in them. "
    "The keeper knew why. A note that is half written is no note at all, so he wrote each line whole or "
    "not at all, and kept the two most recent pages close at hand, in a drawer by the lamp, where a "
    "hand can reach them in the dark.\n"
    "Once a month a boat came and carried a copy of the book to the town, where the harbour master "
    "kept it in a dry room. If the lighthouse burned down, the new keeper would read the copy from "
    "the town and begin where the old one had stopped, a little later than the drawer would have "
    "allowed, but never from nothing.\n"
    "Children who visited asked him why he wrote so often. He said that a lamp forgets everything "
    "when it goes out, and that the cost of writing a line is small when the book is near, and the cost "
    "of forgetting is a whole night of darkness at sea.\n"
)


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model: vocabulary, context length, depth, width, heads and dropout."""

    vocab_size: int
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t attends to positions <= t only."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be a multiple of n_head ({cfg.n_head})")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (k.size(-1) ** -0.5)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()  # made here: no buffer to sync
        att = att.masked_fill(~causal, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """A pre-norm transformer block: x + attention(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer language model (GPT-2 style, untied LM head)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases (drawn from the global RNG)."""
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy of ``idx`` (batch, time) against ``targets``."""
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class TextBatches:
    """Global batches of (input, next-character target) windows over a text, as a position in a stream.

    Stream position ``p`` is window ``perm_e[p mod n]`` where ``e = p // n``, ``n`` is the number of
    windows and ``perm_e`` a permutation seeded by (seed, e): a fresh shuffle each epoch, fixed by the
    seed. ``next_batch`` takes the ``global_batch`` positions from ``position`` on, keeps this rank's share
    (every ``world``-th, from ``rank``) and advances ``position``; ``state_dict``/``load_state_dict``
    carry that position through a checkpoint.
    """

    def __init__(
        self, text: str, block_size: int, global_batch: int, seed: int, rank: int, world: int
    ) -> None:
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} does not split evenly over {world} ranks")
        self.vocab = sorted(set(text))
        index = {ch: i for i, ch in enumerate(self.vocab)}
        self.tokens = torch.tensor([index[ch] for ch in text], dtype=torch.long)
        self.block_size, self.global_batch, self.seed = block_size, global_batch, seed
        self.rank, self.world = rank, world
        self.n_windows = len(text) - block_size
        if self.n_windows < global_batch:
            raise ValueError(f"the text has {self.n_windows} windows, fewer than one global batch")
        self.position = 0
        self._perm: tuple[int, torch.Tensor] | None = None  # (epoch, its permutation)

    def state_dict(self) -> dict[str, int]:
        """The stream position: samples consumed so far, over all ranks."""
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the stream at a checkpoint's position."""
        self.position = int(state["position"])

    def _window(self, p: int) -> int:
        epoch, i = divmod(p, self.n_windows)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.n_windows, generator=g))
        return int(self._perm[1][i])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the next global batch: (inputs, targets), each (batch/world, block_size)."""
        mine = range(self.position + self.rank, self.position + self.global_batch, self.world)
        starts = [self._window(p) for p in mine]
        self.position += self.global_batch
        x = torch.stack([self.tokens[s : s + self.block_size] for s in starts])
        y = torch.stack([self.tokens[s + 1 : s + 1 + self.block_size] for s in starts])
        return x, y
