"""A byte-level chat tokenizer for the tiny base model, built with `tokenizers` and saved for `AutoTokenizer`.

Vocabulary: the 256 bytes (ids 0-255, in byte order) and four special tokens (ids 256-259). There are no
merges, so every UTF-8 byte of the text is one token and any string round-trips. The chat template has the
shape of Qwen's ChatML without its default system prompt:

    <|im_start|>{role}\\n{content}<|im_end|>\\n   per message, then   <|im_start|>assistant\\n

so the same `apply_chat_template` path serves this tokenizer and Qwen models. Generation stops at
`<|im_end|>` (the eos token); padding uses `<|pad|>` on the left.

The saved `tokenizer_config.json` names `TokenizersBackend` (transformers' generic fast tokenizer), and the
tiny model is a Llama: `AutoTokenizer` maps no tokenizer class of its own to `llama`, so the file reloads
exactly as saved. (With `model_type: qwen2`, transformers 5 would swap in `Qwen2Tokenizer`, which rebuilds
Qwen's BPE pre-tokenizer and special tokens around our vocabulary.)

transformers is imported inside `build_tokenizer`, so the token names import at once (`llm-pg pretrain-tiny --help`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, PAD, IM_START, IM_END)  # ids 256, 257, 258, 259

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer(model_max_length: int = 256) -> PreTrainedTokenizerFast:
    """The tiny chat tokenizer: 256 byte tokens, then `<|endoftext|>`, `<|pad|>`, `<|im_start|>`, `<|im_end|>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_symbols = bytes_to_unicode()  # byte -> printable unicode character, the GPT-2 byte-level alphabet
    vocab = {byte_symbols[b]: b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges it would change nothing but speed.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
