"""A tiny random model that follows Qwen2.5-Math-1.5B-Instruct's conventions, built locally in seconds.

    python tests/make_qwen_fixture.py OUT_DIR

The real configs (`configs/format_copy/*.yaml`, `configs/math_hard/*.yaml`) name
`Qwen/Qwen2.5-Math-1.5B-Instruct`, which CI cannot download. This fixture keeps everything about that
checkpoint that our code depends on, at a size that runs on a CPU:

- `Qwen2ForCausalLM` (model_type `qwen2`) with q/k/v/o and gate/up/down projections, grouped-query
  attention (4 query heads, 2 key/value heads), tied embeddings, randomly initialised (seed 0).
- The embedding matrix is padded ABOVE the tokenizer: 320 rows for 300 token ids, as Qwen's 151936 rows
  exceed its 151665 ids, so a sampled id may have no token (decoding skips it).
- `tokenizer_class: Qwen2Tokenizer`, so `AutoTokenizer` builds the same class as for the real model: a
  byte-level BPE (the 256 byte symbols plus 41 merges learnt from a few prompt sentences) with Qwen's
  pre-tokenizer regex and NFC normaliser, then `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (ids 297-299,
  in Qwen's order). `eos_token` is `<|im_end|>` (it ends the assistant turn), `pad_token` `<|endoftext|>`,
  no bos and no unk token.
- Qwen2.5-Math-Instruct's ChatML chat template, default system prompt included (it applies when a
  conversation has no system turn).
- `generation_config.json` with Qwen's sampling defaults (do_sample, temperature 0.7, top_p 0.8,
  top_k 20, repetition_penalty 1.05, eos `[<|im_end|>, <|endoftext|>]`): the trainer must override all of
  them with the run's own settings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOKENIZER_SIZE = 300  # 256 bytes + 41 merges + 3 special tokens
MODEL_VOCAB_SIZE = 320  # padded above the tokenizer, like Qwen2.5 (151936 > 151665)
DEFAULT_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."

# The chat template of Qwen2.5-Math-1.5B-Instruct's tokenizer_config.json, verbatim (the tool branch included,
# so the text is the model's own).
CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'Please reason step by step, and put your final answer within \\\\boxed{}.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nPlease reason step by step, and put your final answer within "
    "\\\\boxed{}.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Sentences the 41 merges are learnt from: words of the tasks' prompts, so prompts tokenize a little shorter.
MERGE_CORPUS = [
    DEFAULT_SYSTEM_PROMPT,
    "Solve the competition-level math problem. Return the final answer in this exact format: \\boxed{NUMBER}",
    "You are a strict formatter. Return the final answer as XML using exactly one tag: <answer>...</answer>.",
    "Output only the XML tag and nothing else. Copy this integer exactly: 1234",
]


def build_tokenizer():
    """A `PreTrainedTokenizerFast` with Qwen2's pre-tokenization, 300 ids and Qwen's special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_SIZE - 3, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(MERGE_CORPUS, trainer)
    backend.add_special_tokens([ENDOFTEXT, IM_START, IM_END])  # ids 297, 298, 299
    if backend.get_vocab_size() != TOKENIZER_SIZE:
        raise RuntimeError(f"fixture tokenizer has {backend.get_vocab_size()} ids, expected {TOKENIZER_SIZE}")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )


def make_qwen_fixture(out_dir: str | Path) -> str:
    """Write the fixture (config, weights, tokenizer, generation config) to `out_dir`; returns its path."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out)
    # As in Qwen's own file: AutoTokenizer builds Qwen2Tokenizer (around our vocabulary and merges); no bos/unk.
    config_path = out / "tokenizer_config.json"
    saved = json.loads(config_path.read_text())
    saved.update(tokenizer_class="Qwen2Tokenizer", bos_token=None, unk_token=None, add_prefix_space=False)
    config_path.write_text(json.dumps(saved, indent=2))

    endoftext, im_end = tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_END])
    config = Qwen2Config(
        vocab_size=MODEL_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=endoftext,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(  # Qwen2.5-Math-1.5B-Instruct's generation_config.json
        bos_token_id=endoftext,
        pad_token_id=endoftext,
        eos_token_id=[im_end, endoftext],
        do_sample=True,
        temperature=0.7,
        top_p=0.8,
        top_k=20,
        repetition_penalty=1.05,
    )
    model.save_pretrained(out)
    return str(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/make_qwen_fixture.py OUT_DIR")
    print(make_qwen_fixture(sys.argv[1]))
