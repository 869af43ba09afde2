"""A character-level language model trained on the Zen of Python, which ships with Python.

The text is `this.s`, the rot13-encoded Zen that `import this` prints; decoding it with
`codecs.decode(text, "rot13")` gives the nineteen aphorisms. The model is the classic
multi-layer perceptron language model (Bengio et al., 2003): it embeds the previous `--context`
characters, concatenates the embeddings and predicts the next character with an MLP. That is
small and fast on a CPU, and enough to learn this text. At the end the script samples new text
from it, one character at a time, starting from a prompt.

Run it:      python examples/char_lm.py
Tiny sizes:  python examples/char_lm.py --smoke
"""

import argparse
import codecs
import contextlib
import io

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fittrain import Callback, Trainer, TrainModule
from fittrain.callbacks import GradClip


def zen_of_python() -> str:
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    return codecs.decode(this.s, "rot13")


class CharWindows(Dataset):
    """Sample i: the `context` characters before position i, and the character at i."""

    def __init__(self, ids: torch.Tensor, context: int) -> None:
        self.ids, self.context = ids, context

    def __len__(self) -> int:
        return len(self.ids) - self.context

    def __getitem__(self, i: int):
        return self.ids[i:i + self.context], self.ids[i + self.context]


class CharLM(TrainModule):
    """Embeds `context` characters, concatenates them, and predicts the next one with an MLP."""

    def __init__(self, vocab_size: int, context: int, embed: int = 24, hidden: int = 256, lr: float = 3e-3) -> None:
        super().__init__()
        self.context, self.lr = context, lr
        self.embed = nn.Embedding(vocab_size, embed)
        self.mlp = nn.Sequential(nn.Linear(context * embed, hidden), nn.Tanh(), nn.Linear(hidden, vocab_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(ids).flatten(1))  # (batch, context) ids -> (batch, vocab) logits

    def training_step(self, batch):
        context, next_char = batch
        return nn.functional.cross_entropy(self(context), next_char)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, length: int, temperature: float, generator: torch.Generator):
        """Continues `prompt` (1-D ids, at least `context` long) by `length` sampled ids."""
        self.eval()
        ids = prompt.tolist()
        for _ in range(length):
            window = torch.tensor(ids[-self.context:], device=prompt.device)[None]
            probs = torch.softmax(self(window)[0] / temperature, dim=-1)
            ids.append(int(torch.multinomial(probs, 1, generator=generator)))
        return ids[len(prompt):]


class PrintLoss(Callback):
    """Prints the training loss every `every` epochs and after the last one."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_train_epoch_end(self, trainer):
        epoch = trainer.state.epoch
        if epoch % self.every == 0 or epoch == trainer.max_epochs - 1:
            trainer.accelerator.print(f"epoch {epoch:3d}  train_loss {trainer.state.metrics['train_loss']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description="A character-level language model on the Zen of Python.")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--context", type=int, default=16, help="characters the model sees to predict the next")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--length", type=int, default=300, help="characters to generate")
    parser.add_argument("--prompt", default="Beautiful is ")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for a quick test")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.context, args.hidden, args.length = 1, 8, 32, 40

    text = zen_of_python()
    print(f"text: the Zen of Python, {len(text)} characters, {len(set(text))} distinct")
    # Newlines in front give the first characters a full context, and the prompt a neutral padding.
    text = "\n" * args.context + text
    vocab = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(vocab)}
    ids = torch.tensor([stoi[ch] for ch in text])

    torch.manual_seed(0)
    loader = DataLoader(CharWindows(ids, args.context), batch_size=64, shuffle=True)
    model = CharLM(len(vocab), args.context, hidden=args.hidden)
    trainer = Trainer(max_epochs=args.epochs, callbacks=[GradClip(max_norm=1.0), PrintLoss(every=5)])
    trainer.fit(model, loader)

    device = trainer.accelerator.device
    padded = "\n" * args.context + args.prompt
    prompt = torch.tensor([stoi[ch] for ch in padded if ch in stoi], device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    sample = model.generate(prompt, args.length, temperature=0.5, generator=generator)
    print("sample:")
    print(args.prompt + "".join(vocab[i] for i in sample))


if __name__ == "__main__":
    main()
