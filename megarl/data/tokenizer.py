"""Tokenizers: load a Hugging Face tokenizer directory, or build a tiny character-level one.

The character tokenizer exists for tests and the embedded toy task: it needs no download, has a
vocabulary of a few tokens (so a tiny model's embedding and LM head stay small), and saves as an
ordinary HF tokenizer directory that `AutoTokenizer.from_pretrained` (and vLLM) load back.
Layout of its vocabulary: `<pad>` = 0, `<bos>` = 1, `<eos>` = 2, then `chars` in order.
It adds no special tokens when encoding, and its chat template concatenates the message
contents with nothing between them, so the toy prompt "copy 37=" stays 8 tokens long.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)


class TokenizerError(UserError, OSError):
    """A tokenizer directory that cannot be loaded; the message names the path and its files."""


PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)

# Renders every message's content in order, nothing else: no role markers, and the generation
# prompt is empty. A system message therefore simply precedes the user text.
CHAR_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained(path)` for a local HF tokenizer (or model) directory.

    A tokenizer without a pad token gets `pad_token = eos_token` (padding positions are always
    masked out, so the id only has to be valid). Raises `TokenizerError` naming `path` when it
    is not a directory or holds no loadable tokenizer.
    """
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise TokenizerError(
            f"tokenizer path {str(path)!r} is not a directory; expected a Hugging Face tokenizer "
            "or model directory (tokenizer.json / tokenizer_config.json)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as err:
        present = sorted(p.name for p in path.iterdir())
        raise TokenizerError(
            f"cannot load a tokenizer from {str(path)!r} (files: {present}): {err}"
        ) from err
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        logger.info("tokenizer %s has no pad token; using eos %r", path, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_char_tokenizer(
    chars: str, out_dir: str | os.PathLike | None = None
) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer over `chars` (ids 3..), with `<pad>`/`<bos>`/`<eos>`.

    Every character of the input is one token (whitespace included, if it is in `chars`);
    decoding joins tokens without separators. Encoding a character outside `chars` raises.
    With `out_dir`, the tokenizer is also saved there (`save_pretrained`).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if not chars:
        raise ValueError("build_char_tokenizer: chars is empty")
    dupes = sorted({c for c in chars if chars.count(c) > 1})
    if dupes:
        raise ValueError(f"build_char_tokenizer: duplicate characters {dupes} in {chars!r}")
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for c in chars:
        vocab[c] = len(vocab)

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    # [\s\S]: any single character, newlines included.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, bos_token=BOS, eos_token=EOS
    )
    tokenizer.chat_template = CHAR_CHAT_TEMPLATE
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer
