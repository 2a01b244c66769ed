"""Prompt building shared by the adapters and the toy trainer: the chat template's text with its
one video placeholder token, expanded to the video's token count.

    ids, at = video_prompt_ids(tokenizer, "describe the video .", placeholder_id, n_video_tokens)
    # ids: the whole prompt (assistant turn opened); ids[at : at + n_video_tokens] are the video's

A prompt that already contains the tokenizer's special tokens is taken as fully templated (raw)
and must contain the placeholder itself; plain text goes through the chat template.
"""

from __future__ import annotations


class PromptError(ValueError):
    """A prompt that cannot carry the video."""


def video_prompt_ids(tokenizer, prompt: str, placeholder_id: int, n_video_tokens: int) -> tuple[list[int], int]:
    placeholder = tokenizer.convert_ids_to_tokens(placeholder_id)
    specials = set(tokenizer.all_special_tokens) | {placeholder}
    raw = any(s in prompt for s in specials)
    if raw:
        text = prompt
    else:
        if not tokenizer.chat_template:
            raise PromptError(f"the tokenizer has no chat template; give a templated prompt containing {placeholder}")
        messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt}]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    spots = [i for i, t in enumerate(ids) if t == placeholder_id]
    if len(spots) != 1:
        where = "the templated prompt" if raw else "the chat template's output"
        raise PromptError(f"{where} has {len(spots)} video placeholders ({placeholder}); it needs exactly one"
                          + (f": {prompt!r}" if raw else ""))
    at = spots[0]
    return ids[:at] + [placeholder_id] * n_video_tokens + ids[at + 1:], at
