"""Tokenizer: byte-level BPE (HuggingFace `tokenizers`) plus the model's jinja2 chat template.

Built either from a GGUF file's `tokenizer.ggml.*` metadata (vocabulary, merges, token types,
pre-tokenizer name, special ids, chat template) or from an HF directory (`tokenizer.json` +
`tokenizer_config.json`). The chat template is rendered the way transformers renders it: a
sandboxed jinja2 environment with `trim_blocks`/`lstrip_blocks`, `raise_exception` and
`tojson`, so prompts match the reference token for token.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Any, Iterable, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4

# Extra end-of-turn markers that stop generation when present in the vocabulary.
_STOP_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>",
                 "<end_of_turn>")

# llama.cpp `tokenizer.ggml.pre` names -> split regex applied before the byte-level mapping.
# None means the GPT-2 regex built into `ByteLevel(use_regex=True)`; _DIGITS, that regex after
# every number character (\p{N}) is split off on its own, as SmolLM's and StarCoder's
# tokenizer.json do (`Digits(individual_digits=True)`; llama.cpp splits `\p{N}` first too).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS = "digits"
_PRE_SPLITS = {
    "default": None, "gpt2": None, "gpt-2": None, "smollm": _DIGITS, "starcoder": _DIGITS,
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
  """GPT-2's reversible byte -> printable character map (bytes 0..255)."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  table, extra = {}, 0
  for b in range(256):
    if b in printable:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return table


# Pre names whose BPE takes a piece found whole in the vocabulary as is, before any merge
# (tokenizer.json's `ignore_merges`, as Llama 3's sets and llama.cpp does for these).
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe"}


def _pre_tokenizer(split: str | None):
  if split is None:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if split == _DIGITS:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(split), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _read_json(path: str) -> dict:
  """A JSON object file; a malformed one is a ValueError naming it."""
  try:
    with open(path) as f:
      out = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from e
  if not isinstance(out, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(out).__name__}")
  return out


def _token_text(tok: Any) -> str | None:
  """`tokenizer_config.json` spells special tokens as strings or `{"content": ...}` dicts."""
  if isinstance(tok, dict):
    return tok.get("content")
  return tok


class Tokenizer:
  """Text <-> ids with the model's special tokens and chat template."""

  def __init__(self, backend: tokenizers.Tokenizer, *, bos_id: int | None, eos_id: int,
               pad_id: int | None, chat_template: str | None, source: str,
               extra_stop_ids: Iterable[int] = ()):
    self.backend = backend
    self._bos_id, self._eos_id = bos_id, eos_id
    self._pad_id = eos_id if pad_id is None else pad_id
    self.chat_template = chat_template
    self.source = source
    stops = [eos_id, *extra_stop_ids]
    for marker in _STOP_MARKERS:
      i = backend.token_to_id(marker)
      if i is not None:
        stops.append(i)
    self._stop_ids = tuple(dict.fromkeys(stops))

  # ----- construction

  @classmethod
  def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
    """Byte-level BPE from GGUF `tokenizer.ggml.*` metadata (llama.cpp model type `gpt2`)."""
    from rhyme_jax.models.gguf_reader import GGUFFile
    g = path if isinstance(path, GGUFFile) else GGUFFile(path)
    kind = g.get("tokenizer.ggml.model")
    if kind != "gpt2":
      raise ValueError(f"{g.path}: field 'tokenizer.ggml.model' is {kind!r}; only byte-level "
                       "BPE ('gpt2') is supported")
    pre = g.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
      raise ValueError(f"{g.path}: field 'tokenizer.ggml.pre' has unsupported value {pre!r}; "
                       f"supported: {sorted(_PRE_SPLITS)}")
    tokens = list(g.get("tokenizer.ggml.tokens"))
    types = list(g.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in g.get("tokenizer.ggml.merges")]
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    # Every BPE piece is spelled in the byte alphabet; re-spell the odd one that is not.
    vocab = {}
    for i, t in enumerate(tokens):
      key = t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))
      vocab.setdefault(key, i)
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                     ignore_merges=pre in _IGNORE_MERGES)
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = _pre_tokenizer(_PRE_SPLITS[pre])
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|> ...) stay whole and count as special; user-defined ones
    # (e.g. <think>) stay whole but are ordinary text when decoding.
    backend.add_special_tokens([
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= letters])
    backend.add_tokens([
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    def special(field):
      v = g.get(f"tokenizer.ggml.{field}", None)
      return None if v is None else int(v)

    bos, eos = special("bos_token_id"), special("eos_token_id")
    if bos is not None and g.get("tokenizer.ggml.add_bos_token", False):
      # llama.cpp prepends BOS when this flag is set; `encode(add_special_tokens=True)` does too.
      bos_text = backend.id_to_token(bos)
      backend.post_processor = processors.TemplateProcessing(
          single=f"{bos_text} $A", pair=f"{bos_text} $A $B", special_tokens=[(bos_text, bos)])
    if eos is None:
      raise ValueError(f"{g.path}: missing GGUF metadata field 'tokenizer.ggml.eos_token_id'")
    return cls(backend, bos_id=bos, eos_id=eos,
               pad_id=special("padding_token_id"),
               chat_template=g.get("tokenizer.chat_template", None), source=g.path)

  @classmethod
  def from_directory(cls, directory: str | os.PathLike) -> "Tokenizer":
    """From an HF directory: `tokenizer.json`, `tokenizer_config.json` (chat template, specials)."""
    directory = os.fspath(directory)
    tj = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(tj):
      raise FileNotFoundError(f"{directory}: no tokenizer.json")
    try:
      backend = tokenizers.Tokenizer.from_file(tj)
    except Exception as e:  # the Rust parser raises a bare Exception  # pylint: disable=broad-except
      raise ValueError(f"{tj}: cannot read the tokenizer ({e})") from e
    conf_path = os.path.join(directory, "tokenizer_config.json")
    conf = {}
    if os.path.isfile(conf_path):
      conf = _read_json(conf_path)
    template = conf.get("chat_template")
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_path):
      with open(jinja_path) as f:
        template = f.read()
    if isinstance(template, list):  # named templates: take the default one
      template = next((t["template"] for t in template if t.get("name") == "default"), None)

    def tid(field):
      text = _token_text(conf.get(field))
      if text is None:
        return None
      i = backend.token_to_id(text)
      if i is None:
        raise ValueError(f"{conf_path}: field {field!r} names {text!r}, not in the vocabulary")
      return i

    # End ids from config.json and generation_config.json (what transformers' generate stops
    # at: instruct models list their end-of-turn token there).
    extra = []
    for name in ("config.json", "generation_config.json"):
      path = os.path.join(directory, name)
      if os.path.isfile(path):
        e = _read_json(path).get("eos_token_id")
        extra += [i for i in ([e] if isinstance(e, int) else list(e or [])) if i not in extra]
    eos = tid("eos_token")
    if eos is None and extra:
      eos = extra[0]
    if eos is None:
      raise ValueError(f"{conf_path}: no 'eos_token' (and no eos_token_id in config.json)")
    return cls(backend, bos_id=tid("bos_token"), eos_id=eos, pad_id=tid("pad_token"),
               chat_template=template, source=directory, extra_stop_ids=extra)

  # ----- ids

  @property
  def eos_id(self) -> int:
    return self._eos_id

  @property
  def bos_id(self) -> int | None:
    return self._bos_id

  @property
  def pad_id(self) -> int:
    return self._pad_id

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """EOS plus end-of-turn markers (e.g. `<|im_end|>`, `<|endoftext|>`): generation stops here."""
    return self._stop_ids

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def token_to_id(self, token: str) -> int | None:
    return self.backend.token_to_id(token)

  def id_to_token(self, i: int) -> str | None:
    return self.backend.id_to_token(i)

  # ----- encode / decode

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids; `add_special_tokens` adds what the model's post-processor adds (e.g. BOS)."""
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
    encs = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
    return [e.ids for e in encs]

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def decode_batch(self, batch: Sequence[Sequence[int]],
                   skip_special_tokens: bool = True) -> list[str]:
    return self.backend.decode_batch([[int(i) for i in ids] for ids in batch],
                                     skip_special_tokens=skip_special_tokens)

  # ----- chat

  def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                          tokenize: bool = False, now: datetime.datetime | None = None,
                          **kwargs) -> str | list[int]:
    """Renders `messages` ([{"role", "content"}, ...]) with the model's template.

    With `tokenize=True` returns ids (special tokens in the text are matched whole). `now`:
    the time a template's `strftime_now` reads (Llama-3.x prints today's date into the system
    message); default the wall clock, as transformers renders.
    """
    if not self.chat_template:
      raise ValueError(f"{self.source}: no chat template")
    if now is not None:
      kwargs.setdefault("strftime_now", now.strftime)
    bos = self.id_to_token(self._bos_id) if self._bos_id is not None else ""
    text = _compiled_template(self.chat_template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        bos_token=bos, eos_token=self.id_to_token(self._eos_id), **kwargs)
    return self.encode(text) if tokenize else text


class _TemplateError(ValueError):
  """A chat template's own `raise_exception(...)` (e.g. roles that must alternate)."""


def _raise_exception(message):
  raise _TemplateError(f"chat template: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str):
  """The template compiled in a sandbox (templates come from model files: untrusted)."""
  from jinja2.sandbox import ImmutableSandboxedEnvironment
  from jinja2.ext import loopcontrols
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env.from_string(source)


def load_tokenizer(name_or_path: str | os.PathLike) -> Tokenizer:
  """Same resolution as `load_model`: a known name, an HF directory, or a `.gguf` file."""
  from rhyme_jax.models.loading import resolve_model_path
  path = resolve_model_path(name_or_path)
  if os.path.isdir(path):
    return Tokenizer.from_directory(path)
  if path.lower().endswith(".gguf"):
    return Tokenizer.from_gguf(path)
  raise ValueError(f"{path}: expected an HF directory or a .gguf file")
