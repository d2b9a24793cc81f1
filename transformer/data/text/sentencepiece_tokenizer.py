"""A sentencepiece model (T5's `spiece.model`) behind the Tokenizer protocol of tokenizers.py.

For a model directory that has no tokenizer.json: the ids are the sentencepiece package's, which
are transformers' (tested on varied text), and T5's `extra_ids` sentinels follow the pieces,
<extra_id_0> last, as transformers numbers them. A run saves the model file and its settings.
"""

import json
import os
import shutil

import numpy as np

MODEL_FILE = "spiece.model"


class SentencePieceTokenizer:
    kind = "hf"  # a model directory's own tokenizer, like a tokenizer.json

    def __init__(self, model_file: str, specials: dict[str, str] | None = None, extra_ids: int = 0):
        try:
            import sentencepiece
        except ImportError:
            raise ImportError(f"{model_file} needs the sentencepiece package: pip install sentencepiece (or give "
                              "the directory a tokenizer.json)") from None
        self.model_file, self.specials, self.extra_ids = model_file, dict(specials or {}), extra_ids
        self.processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.pieces = self.processor.get_piece_size()
        self.vocab_size = self.pieces + extra_ids

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.processor.encode(text), dtype=np.int32)

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return self.processor.decode([int(i) for i in ids if 0 <= i < self.pieces])

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        if os.path.abspath(self.model_file) != os.path.abspath(os.path.join(directory, MODEL_FILE)):
            shutil.copy(self.model_file, os.path.join(directory, MODEL_FILE))
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump({"kind": self.kind, "sentencepiece": MODEL_FILE, "extra_ids": self.extra_ids,
                       **({"specials": self.specials} if self.specials else {})}, f, indent=1)

    def token(self, i: int) -> str:
        return self.processor.id_to_piece(i) if i < self.pieces else f"<extra_id_{self.vocab_size - 1 - i}>"

    def special_id(self, name: str) -> int | None:
        token = self.specials.get(name, name)
        if token.startswith("<extra_id_") and token.endswith(">") and token[10:-1].isdigit():
            k = int(token[10:-1])
            return self.vocab_size - 1 - k if k < self.extra_ids else None
        i = self.processor.piece_to_id(token)
        return None if i == self.processor.unk_id() and token != self.processor.id_to_piece(i) else i


def load(directory: str, settings: dict) -> SentencePieceTokenizer:
    """A run directory's saved sentencepiece tokenizer (its tokenizer_config.json `settings`)."""
    return SentencePieceTokenizer(os.path.join(directory, settings["sentencepiece"]), settings.get("specials"),
                                  settings.get("extra_ids", 0))
