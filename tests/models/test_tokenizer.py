"""Tokenizer parity with transformers on the real SmolLM2 GGUF, plus HF-directory loading."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")

from rhyme_jax.models.tokenizer import Tokenizer, load_tokenizer  # noqa: E402

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " 123 4567 89.5 1,000,000 and 3.14159",
    "x=12345678901234567890; y = -0.001e-5",
    "héllo wörld ñ façade — “quotes” «guillemets» 日本語 中文 한국어 Ελληνικά русский",
    "emoji 🤖🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "  lots   of\tspaces\n\n\n  and\r\nnewlines  \n",
    "def f(x):\n    return x**2  # square\n\nprint(f(3))\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "don't I'll we've SHE'S it's",
    "",
    " ",
    "\u00a0non-breaking\u2003em-space\u200bzero-width",
    "a" * 64,
    "Tom has 3 apples. He buys 5 more. How many? #### 8",
]

MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name a color."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another 🎨?"}],
]


def test_ids_match_transformers(smollm2_tokenizer, smollm2_hf_tokenizer):
  for text in TEXTS:
    want = smollm2_hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert smollm2_tokenizer.encode(text) == want, text
    assert smollm2_tokenizer.encode(text, add_special_tokens=True) == (
        smollm2_hf_tokenizer(text, add_special_tokens=True)["input_ids"]), text


def test_decode_matches_transformers(smollm2_tokenizer, smollm2_hf_tokenizer):
  for text in TEXTS:
    ids = smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert smollm2_tokenizer.decode(ids) == smollm2_hf_tokenizer.decode(
        ids, skip_special_tokens=True), text


def test_batch_roundtrip(smollm2_tokenizer):
  ids = smollm2_tokenizer.encode_batch(TEXTS)
  assert ids == [smollm2_tokenizer.encode(t) for t in TEXTS]
  assert smollm2_tokenizer.decode_batch(ids, skip_special_tokens=False) == TEXTS


@pytest.mark.parametrize("which", range(len(MESSAGES)))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(smollm2_tokenizer, smollm2_hf_tokenizer, which, gen):
  msgs = MESSAGES[which]
  text = smollm2_tokenizer.apply_chat_template(msgs, add_generation_prompt=gen)
  assert text == smollm2_hf_tokenizer.apply_chat_template(msgs, tokenize=False,
                                                          add_generation_prompt=gen)
  ids = smollm2_tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True)
  assert ids == smollm2_hf_tokenizer(text, add_special_tokens=False)["input_ids"]
  assert ids.count(smollm2_tokenizer.token_to_id("<|im_start|>")) == (
      len(msgs) + (msgs[0]["role"] != "system") + gen)


def test_special_ids(smollm2_tokenizer, smollm2_hf_tokenizer):
  tok = smollm2_tokenizer
  assert tok.vocab_size == 49152 == len(smollm2_hf_tokenizer)
  assert tok.eos_id == smollm2_hf_tokenizer.eos_token_id == tok.token_to_id("<|im_end|>")
  assert tok.pad_id == smollm2_hf_tokenizer.pad_token_id
  assert tok.bos_id == smollm2_hf_tokenizer.bos_token_id
  assert set(tok.stop_ids) == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
  assert tok.decode([tok.token_to_id("<|im_start|>"), 19556]) == tok.decode([19556])


def test_from_directory_matches_gguf(tmp_path, smollm2_tokenizer, smollm2_hf_tokenizer):
  smollm2_hf_tokenizer.save_pretrained(tmp_path)
  if not (tmp_path / "tokenizer.json").exists():
    pytest.skip("transformers did not write tokenizer.json")
  tok = load_tokenizer(str(tmp_path))
  assert isinstance(tok, Tokenizer)
  for text in TEXTS:
    assert tok.encode(text) == smollm2_tokenizer.encode(text), text
  assert tok.eos_id == smollm2_tokenizer.eos_id
  assert tok.stop_ids[0] == smollm2_tokenizer.eos_id
  for msgs in MESSAGES:
    assert tok.apply_chat_template(msgs) == smollm2_tokenizer.apply_chat_template(msgs)
  # generate stops at generation_config.json's end ids too (an instruct model's end of turn)
  (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 11]}')
  (tmp_path / "config.json").write_text('{"eos_token_id": 11}')
  assert {7, 11} <= set(load_tokenizer(str(tmp_path)).stop_ids)


def test_template_raise_exception_and_sandbox(tmp_path, smollm2_hf_tokenizer):
  smollm2_hf_tokenizer.save_pretrained(tmp_path)
  conf_path = tmp_path / "tokenizer_config.json"
  conf = json.loads(conf_path.read_text())
  conf["chat_template"] = ("{% if messages[0]['role'] != 'user' %}"
                           "{{ raise_exception('first message must be from the user') }}"
                           "{% endif %}{{ messages | tojson }}")
  conf_path.write_text(json.dumps(conf))
  (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
  tok = Tokenizer.from_directory(tmp_path)
  with pytest.raises(Exception, match="first message must be from the user"):
    tok.apply_chat_template([{"role": "assistant", "content": "x"}])
  assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == (
      '[{"role": "user", "content": "é"}]')
  tok.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
  with pytest.raises(Exception, match="unsafe|not safely|SecurityError|access"):
    tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_training_prompts_do_not_read_the_clock(tmp_path, smollm2_hf_tokenizer):
  """A template that prints today's date (Llama-3.x's system message) renders training prompts
  with a fixed one: a prompt is a function of its example, on every host and day."""
  import datetime

  from rhyme_jax.rl.samples import PROMPT_DATE, chat_renderer
  smollm2_hf_tokenizer.save_pretrained(tmp_path)
  tok = Tokenizer.from_directory(tmp_path)
  tok.chat_template = "Today Date: {{ strftime_now('%d %b %Y') }}\n{{ messages[0]['content'] }}"
  msgs = [{"role": "user", "content": "q"}]
  assert chat_renderer(tok)(msgs) == "Today Date: 26 Jul 2024\nq" == tok.apply_chat_template(
      msgs, now=PROMPT_DATE)
  today = datetime.datetime.now().strftime("%d %b %Y")  # transformers' default: the clock
  assert tok.apply_chat_template(msgs) in (f"Today Date: {today}\nq",
                                           f"Today Date: {datetime.datetime.now():%d %b %Y}\nq")


def test_directory_without_tokenizer_json(tmp_path):
  with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
    Tokenizer.from_directory(tmp_path)


def test_gguf_without_tokenizer_names_field(tmp_path):
  import gguf
  path = tmp_path / "notok.gguf"
  w = gguf.GGUFWriter(str(path), "llama")
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ValueError, match=r"notok\.gguf.*'tokenizer\.ggml\.model'"):
    Tokenizer.from_gguf(path)


def test_broken_tokenizer_json_names_the_file(tmp_path):
  """tokenizers' parser raises a bare Exception; it arrives as a ValueError naming the file."""
  import tokenizers
  from tokenizers import models
  tj = tmp_path / "tokenizer.json"
  tokenizers.Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tj))
  os.truncate(tj, tj.stat().st_size // 2)
  with pytest.raises(ValueError, match=rf"^{tj}: cannot read the tokenizer"):
    Tokenizer.from_directory(tmp_path)


def test_smollm2_splits_every_number_character_on_its_own(smollm2_tokenizer):
  """SmolLM2's tokenizer.json pre-tokenizes with `Digits(individual_digits=True)` before the
  byte-level split (llama.cpp's `smollm` pre splits `\\p{N}` first too): a number character
  never merges with the space before it. ASCII digits come out the same either way (the
  vocabulary has no space + digit token), so the transformers parity texts cannot show it."""
  enc = smollm2_tokenizer.encode
  assert enc(" ²") == enc(" ") + enc("²")
  assert enc("x ² y") == enc("x") + enc(" ") + enc("²") + enc(" y")
  assert enc("① ② ③") == enc("①") + enc(" ") + enc("②") + enc(" ") + enc("③")
  assert enc(" ٣٤") == enc(" ") + enc("٣") + enc("٤")
  assert smollm2_tokenizer.decode(enc("x ² y ½")) == "x ² y ½"


def _gguf_tokenizer(path, pre, tokens, merges):
  import gguf
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(pre)
  w.add_token_list(tokens + ["<|end_of_text|>"])
  w.add_token_types([1] * len(tokens) + [3])
  w.add_token_merges(merges)
  w.add_eos_token_id(len(tokens))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return Tokenizer.from_gguf(path)


def test_llama3_pre_takes_a_whole_vocabulary_piece_before_merging(tmp_path):
  """Llama 3's tokenizer.json sets `ignore_merges` (llama.cpp does for llama-bpe): a piece that
  is in the vocabulary is one token even where the merges could not build it ("abc" here,
  with only the merge "a b"); other pre names merge as BPE does."""
  tokens = ["a", "b", "c", "ab", "abc"]
  t = _gguf_tokenizer(tmp_path / "l3.gguf", "llama-bpe", tokens, ["a b"])
  assert t.encode("abc") == [4]
  t = _gguf_tokenizer(tmp_path / "q2.gguf", "qwen2", tokens, ["a b"])
  assert t.encode("abc") == [3, 2]


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json"])
def test_malformed_json_beside_the_tokenizer_names_its_file(tmp_path, name):
  import tokenizers
  from tokenizers import models
  tokenizers.Tokenizer(models.WordLevel({"a": 0, "</s>": 1}, unk_token="a")).save(
      str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
  (tmp_path / name).write_text('{"eos_token_id": 1,\n')
  with pytest.raises(ValueError, match=rf"^{tmp_path / name}: not valid JSON"):
    Tokenizer.from_directory(tmp_path)
