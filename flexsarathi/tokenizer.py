"""`tokenizer.json` through the `tokenizers` library, with BOS/EOS as the checkpoint asks."""
from __future__ import annotations

import json
import os

from tokenizers import Tokenizer as HFTokenizer

from flexsarathi.errors import CheckpointError


class Tokenizer:
    def __init__(self, path: str, add_bos: bool | None, add_eos: bool, bos_id: int | None,
                 eos_id: int | None):
        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as exc:  # the tokenizers library raises a bare Exception on bad JSON
            raise CheckpointError(f"cannot read tokenizer {path}: {exc}") from None
        self.add_bos, self.add_eos = add_bos, add_eos
        self.bos_token_id, self.eos_token_id = bos_id, eos_id

    @classmethod
    def from_folder(cls, folder: str, bos_id: int | None = None,
                    eos_id: int | None = None) -> "Tokenizer | None":
        """None when the folder has no tokenizer.json (prompts must then be token ids)."""
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            return None
        tok_cfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
        gen_cfg = _read_json(os.path.join(folder, "generation_config.json"))
        bos = gen_cfg.get("bos_token_id", bos_id)
        eos = gen_cfg.get("eos_token_id", eos_id)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        # None: follow tokenizer.json's own post-processor.
        add_bos = tok_cfg.get("add_bos_token") if "add_bos_token" in tok_cfg else None
        return cls(path, add_bos, bool(tok_cfg.get("add_eos_token", False)), bos, eos)

    def encode(self, text: str) -> list[int]:
        if self.add_bos is None:
            return self._tok.encode(text, add_special_tokens=True).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if self.add_eos and self.eos_token_id is not None:
            ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
