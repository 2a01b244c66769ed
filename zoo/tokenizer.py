"""The toy zoo's word-level tokenizer: one token per word of the world's vocabulary, plus the
special tokens both model families expect, saved as a transformers tokenizer with a chat template.

    tok = build_tokenizer()                 # a PreTrainedTokenizerFast
    tok.save_pretrained(directory)          # tokenizer.json + tokenizer_config.json (chat_template)
    tok.apply_chat_template(video_messages("describe the video ."), tokenize=False)
      # '<|im_start|> user <|vision_start|> <|video_pad|> <|vision_end|> describe the video . <|im_end|> <|im_start|> assistant'

One tokenizer serves both architectures: it holds Qwen2.5-VL's video tokens (<|vision_start|>,
<|video_pad|>, <|vision_end|>) and LLaVA-OneVision's (<video>); each architecture's chat template
(`chat_template(arch)`) writes its own. The template writes one placeholder per video; the model
adapter repeats it to the video's token count, as the real processors do.

The word-level model splits on whitespace only, so the grammar's '.' and '?' are words of their
own (the captions already put spaces around them); an unknown word becomes <|unk|>, which the
scorer counts as a wrong clause.
"""

from __future__ import annotations

from zoo.captions import vocabulary

SPECIALS = ("<|endoftext|>", "<|unk|>", "<|im_start|>", "<|im_end|>",
            "<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<|image_pad|>", "<video>", "<image>")
ROLE_WORDS = ("user", "assistant", "system")
PAD_TO = 64      # vocabulary rounded up (embedding tables like a multiple of 8; 64 leaves room)

# Jinja, as transformers' apply_chat_template renders it. Words are separated by single spaces
# because the tokenizer splits on whitespace; `add_generation_prompt` opens the assistant's turn.
_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|> ' + message['role'] + ' ' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'video' -%}{{ VIDEO + ' ' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ ' <|im_end|> ' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|> assistant' }}{%- endif -%}"
)
VIDEO_MARKUP = {
    "qwen2_5_vl": "<|vision_start|> <|video_pad|> <|vision_end|>",
    "llava_onevision": "<video>",
}


def chat_template(arch: str) -> str:
    if arch not in VIDEO_MARKUP:
        raise ValueError(f"no toy chat template for architecture {arch!r} (have {', '.join(VIDEO_MARKUP)})")
    return _TEMPLATE.replace("VIDEO", repr(VIDEO_MARKUP[arch]))


def video_messages(prompt: str) -> list[dict]:
    """One user turn: the video, then the prompt text."""
    return [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt}]}]


def build_tokenizer(arch: str = "qwen2_5_vl"):
    """A PreTrainedTokenizerFast over SPECIALS + role words + the world's vocabulary, padded to
    PAD_TO entries with unused tokens (so ids are stable when the grammar grows by a few words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [*SPECIALS, *ROLE_WORDS, *vocabulary()]
    if len(words) > PAD_TO:
        raise ValueError(f"the toy vocabulary has {len(words)} entries, more than PAD_TO={PAD_TO}")
    words += [f"<|unused{i}|>" for i in range(PAD_TO - len(words))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with single spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<|unk|>", pad_token="<|endoftext|>", eos_token="<|im_end|>",
        bos_token=None, additional_special_tokens=[s for s in SPECIALS if s not in ("<|endoftext|>", "<|unk|>", "<|im_end|>")],
        model_max_length=1 << 20, clean_up_tokenization_spaces=False)
    tok.chat_template = chat_template(arch)
    return tok
