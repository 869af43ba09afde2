"""Tiny local stand-ins for the Hub names that the real scripts load, built offline in seconds.

The scripts under upstream/ load `AutoTokenizer.from_pretrained("bert-base-cased")`,
`AutoModelForSequenceClassification.from_pretrained("bert-base-cased")`,
`load_dataset("nyu-mll/glue", "mrpc")` and `evaluate.load("glue", "mrpc")` (and the causal-LM
example `HuggingFaceTB/SmolLM-360M` and `Salesforce/wikitext`). Each of these
libraries takes a name that is an existing folder in the working directory as a local path
before it asks the Hub, so a run started in a folder holding

    bert-base-cased/      a 2-layer BERT of width 16 (config.json, model.safetensors) and a
                          WordPiece tokenizer (vocab.txt written here, tokenizer_config.json)
    nyu-mll/glue/         the "mrpc" configuration as parquet files, declared in README.md's
                          `configs:` YAML, with MRPC's columns and ClassLabel names
    glue/glue.py          an `evaluate` metric module (glue_metric.py beside this file)
    HuggingFaceTB/SmolLM-360M/  a 2-layer Llama of width 16, with the same tokenizer and an eos token
    Salesforce/wikitext/  the "wikitext-2-v1" configuration (a `text` column), declared the same way

never reaches the network (the tests also set HF_HUB_OFFLINE and friends, so a name that did
not resolve locally fails instead of downloading). The data are random sentences over a small
vocabulary, labelled by word overlap, so that a model can learn something in a few steps.
"""

from __future__ import annotations

import json
import pathlib
import random
import shutil
import sys

#: The special tokens first (BERT's order), then a small vocabulary of lower-case words.
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("the a cat dog bird fish runs sits eats sleeps on under near big small red blue green old new "
         "house tree river park car road city day night sun rain happy sad quick slow man woman child "
         "sees likes finds takes gives book ball cup box table chair door window").split()
#: Rows per split: small enough for seconds per run, large enough for 2 processes and 3 folds.
SPLIT_ROWS = {"train": 64, "validation": 32, "test": 32}
LABEL_NAMES = ["not_equivalent", "equivalent"]

#: Named in the stand-ins' READMEs.
MADE_BY = "tests/compat/real_scripts/assets.py"


def build_assets(root: pathlib.Path) -> pathlib.Path:
    """Writes the tiny model, tokenizer, dataset and metric into `root` and returns it."""
    root.mkdir(parents=True, exist_ok=True)
    _write_bert(root / "bert-base-cased")
    _write_mrpc(root / "nyu-mll" / "glue")
    (root / "glue").mkdir(exist_ok=True)
    shutil.copyfile(pathlib.Path(__file__).with_name("glue_metric.py"), root / "glue" / "glue.py")
    _write_causal_lm(root / "HuggingFaceTB" / "SmolLM-360M")
    _write_wikitext(root / "Salesforce" / "wikitext")
    return root


def _write_tokenizer(folder: pathlib.Path, **settings: object) -> list[str]:
    """A WordPiece tokenizer over SPECIAL + WORDS (vocab.txt and its config); returns the vocabulary."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = SPECIAL + sorted(set(WORDS))
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "BertTokenizer", "do_lower_case": False, "model_max_length": 64, **settings}),
        encoding="utf-8")
    return vocab


def _write_bert(folder: pathlib.Path) -> None:
    """A tiny BertForSequenceClassification with 2 labels, saved with its tokenizer."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    vocab = _write_tokenizer(folder)
    config = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64, num_labels=2,
                        initializer_range=0.5)  # wide weights: predictions differ between inputs from the start
    torch.manual_seed(0)  # the same weights on every build
    BertForSequenceClassification(config).save_pretrained(folder)


def _write_causal_lm(folder: pathlib.Path) -> None:
    """A tiny Llama for HuggingFaceTB/SmolLM-360M, whose tokenizer has the eos token the script pads with."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = _write_tokenizer(folder, eos_token="[SEP]")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         bos_token_id=vocab.index("[CLS]"), eos_token_id=vocab.index("[SEP]"))
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)


def _write_wikitext(folder: pathlib.Path) -> None:
    """Salesforce/wikitext's "wikitext-2-v1" configuration: one `text` column, some lines empty as
    in the original; the script takes the first 500 training rows, so there are 500."""
    from datasets import Dataset

    rng, rows = random.Random(1), {"train": 500, "validation": 32, "test": 32}
    (folder / "wikitext-2-v1").mkdir(parents=True, exist_ok=True)
    for split, count in rows.items():
        text = ["" if i % 10 == 0 else _sentence(rng) for i in range(count)]
        Dataset.from_dict({"text": text}).to_parquet(str(folder / "wikitext-2-v1" / f"{split}.parquet"))
    files = "".join(f"  - split: {split}\n    path: wikitext-2-v1/{split}.parquet\n" for split in rows)
    (folder / "README.md").write_text(f"---\nconfigs:\n- config_name: wikitext-2-v1\n  data_files:\n{files}---\n"
                                      f"A tiny offline stand-in for WikiText-2, made by {MADE_BY}.\n",
                                      encoding="utf-8")


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9)))


def _mrpc_rows(rng: random.Random, count: int, start: int) -> dict[str, list]:
    """MRPC's columns; a pair is "equivalent" when its sentences share at least 3 distinct words."""
    rows: dict[str, list] = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
    for idx in range(start, start + count):
        first, second = _sentence(rng), _sentence(rng)
        if idx % 2:  # half the pairs reuse words, so both labels occur
            second = " ".join(first.split()[: rng.randint(3, 5)] + second.split()[:3])
        rows["sentence1"].append(first)
        rows["sentence2"].append(second)
        rows["label"].append(int(len(set(first.split()) & set(second.split())) >= 3))
        rows["idx"].append(idx)
    return rows


def _write_mrpc(folder: pathlib.Path) -> None:
    """nyu-mll/glue with the one configuration the scripts ask for, "mrpc", as parquet files whose
    schema carries the features (so `label` is a ClassLabel), declared in README.md."""
    from datasets import ClassLabel, Dataset, Features, Value

    features = Features({"sentence1": Value("string"), "sentence2": Value("string"),
                         "label": ClassLabel(names=LABEL_NAMES), "idx": Value("int32")})
    rng, start = random.Random(0), 0
    (folder / "mrpc").mkdir(parents=True, exist_ok=True)
    for split, count in SPLIT_ROWS.items():
        Dataset.from_dict(_mrpc_rows(rng, count, start), features=features).to_parquet(
            str(folder / "mrpc" / f"{split}.parquet"))
        start += count
    files = "".join(f"  - split: {split}\n    path: mrpc/{split}.parquet\n" for split in SPLIT_ROWS)
    (folder / "README.md").write_text(f"---\nconfigs:\n- config_name: mrpc\n  data_files:\n{files}---\n"
                                      f"A tiny offline stand-in for GLUE MRPC, made by {MADE_BY}.\n",
                                      encoding="utf-8")


if __name__ == "__main__":  # python assets.py FOLDER (the tests build the assets in a process of their own)
    build_assets(pathlib.Path(sys.argv[1]))
