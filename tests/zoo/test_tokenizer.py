"""The toy tokenizer: one id per word, both architectures' chat templates, a round trip through
save_pretrained / AutoTokenizer, and unknown words as <|unk|>."""

import pytest
from transformers import AutoTokenizer

from models.prompt import PromptError, video_prompt_ids
from zoo.captions import vocabulary
from zoo.tokenizer import PAD_TO, build_tokenizer, video_messages


@pytest.mark.parametrize("arch, markup", [("qwen2_5_vl", "<|vision_start|> <|video_pad|> <|vision_end|>"),
                                          ("llava_onevision", "<video>")])
def test_chat_template_writes_the_architectures_video_markup(arch, markup):
    tok = build_tokenizer(arch)
    text = tok.apply_chat_template(video_messages("describe the video ."), tokenize=False, add_generation_prompt=True)
    assert text == f"<|im_start|> user {markup} describe the video . <|im_end|> <|im_start|> assistant"


def test_every_word_is_one_token_and_decoding_restores_the_text(tmp_path):
    tok = build_tokenizer()
    assert len(tok) == PAD_TO
    words = vocabulary()
    ids = tok(" ".join(words), add_special_tokens=False).input_ids
    assert len(ids) == len(words) and tok.unk_token_id not in ids
    assert tok.decode(ids) == " ".join(words)
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(" ".join(words), add_special_tokens=False).input_ids == ids
    assert again.chat_template == tok.chat_template and again.eos_token == "<|im_end|>"


def test_unknown_words_become_unk():
    tok = build_tokenizer()
    assert tok("a large red blob appears .", add_special_tokens=False).input_ids[3] == tok.unk_token_id


def test_video_prompt_expands_the_one_placeholder_and_refuses_prompts_without_it():
    tok = build_tokenizer()
    pad = tok.convert_tokens_to_ids("<|video_pad|>")
    ids, at = video_prompt_ids(tok, "describe the video .", pad, 5)
    assert ids[at:at + 5] == [pad] * 5 and pad not in ids[:at] + ids[at + 5:]
    raw = "<|im_start|> user <|video_pad|> what color is the star at the end ? <|im_end|> <|im_start|> assistant"
    ids, at = video_prompt_ids(tok, raw, pad, 3)
    assert ids[at:at + 3] == [pad] * 3
    with pytest.raises(PromptError, match="0 video placeholders"):
        video_prompt_ids(tok, "<|im_start|> user describe the video . <|im_end|>", pad, 3)
