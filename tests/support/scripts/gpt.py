"""A small GPT-style model with a transformers-style `tp_plan`, its data and its training loop, shared
by the layout workers (layouts_worker.py) and the tests' one-process references.

Everything is deterministic: the weights from a seed, the token sequences from their own
generator, the shuffle from the loader's generator. Every layout gets the same global batch
(`GLOBAL_BATCH` sequences a step, dealt to the data-parallel ranks), so every layout, and one
process with the whole batch, take the same optimizer steps up to the reduction order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, WIDTH, HEADS, LAYERS, LENGTH = 32, 16, 4, 2, 8
GLOBAL_BATCH, SAMPLES, LR, MAX_NORM = 8, 32, 3e-3, 0.5

#: The layouts of 4 processes the layout tests run (ParallelismConfig's sizes).
LAYOUTS = {
    "ddp": dict(dp_replicate_size=4),
    "fsdp": dict(dp_shard_size=4),
    "hsdp": dict(dp_replicate_size=2, dp_shard_size=2),
    "tp": dict(tp_size=4),
    "fsdp_tp": dict(dp_shard_size=2, tp_size=2),
    "replicate_tp": dict(dp_replicate_size=2, tp_size=2),
}


class Block(nn.Module):
    """Pre-norm attention and MLP. The head count comes from the projections' width (`-1`), as in
    transformers' models, so that a tp rank holding HEADS / tp_size heads computes its own."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (proj(h).view(b, t, -1, WIDTH // HEADS).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """Embedding, blocks, norm, head: the shape of the models torchtitan parallelizes."""

    tp_plan = {"blocks.*.q": "colwise", "blocks.*.k": "colwise", "blocks.*.v": "colwise", "blocks.*.o": "rowwise",
               "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT()


def make_loader(batch_size: int) -> DataLoader:
    """Sequences of LENGTH + 1 tokens with their indices (to count which samples a run saw)."""
    g = torch.Generator().manual_seed(99)
    tokens = torch.randint(0, VOCAB, (SAMPLES, LENGTH + 1), generator=g)
    return DataLoader(TensorDataset(tokens, torch.arange(SAMPLES)), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(7))


class TokenStream(torch.utils.data.IterableDataset):
    """The same sequences and indices as `make_loader`'s, in order, as a stream."""

    def __iter__(self) -> Any:
        tokens, index = make_loader(1).dataset.tensors
        return iter(zip(tokens, index))


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def prepared(acc: Any, seed: int = 0, accumulation: int = 1) -> tuple[nn.Module, Any, Any]:
    """The model, AdamW (built before prepare, as scripts do) and a loader whose batches, over the
    data-parallel ranks and `accumulation` micro-steps, make GLOBAL_BATCH."""
    data_parallel = acc.parallelism_config.data_parallel_size if acc.parallelism_config else acc.num_processes
    model = make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    return acc.prepare(model, optimizer, make_loader(GLOBAL_BATCH // data_parallel // accumulation))


def train_epoch(acc: Any, model: nn.Module, optimizer: Any, loader: Any, seen: list[int] | None = None,
                norms: list[float] | None = None) -> list[float]:
    """One pass with clipping; the global mean loss of each step (and, when asked, the sample indices
    and the total gradient norms that clip_grad_norm_ returned)."""
    losses = []
    for tokens, index in loader:
        with acc.accumulate(model):
            loss = loss_of(model, tokens)
            acc.backward(loss)
            if acc.sync_gradients:
                norm = acc.clip_grad_norm_(model.parameters(), MAX_NORM)
                if norms is not None:
                    norms.append(float(norm))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(acc.reduce(loss.detach(), "mean")))
        if seen is not None:
            seen.extend(int(i) for i in acc.gather_for_metrics(index))
    return losses


def full_state(acc: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in acc.get_state_dict(model).items()}
