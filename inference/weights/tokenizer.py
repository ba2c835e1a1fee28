"""Tokenizer and chat template, built from whatever the model file carries.

A GGUF holds its vocabulary, merges and chat template as metadata, so the bundled model needs no
``tokenizer.json`` and no hub: we rebuild an HF ``tokenizers`` pipeline from those arrays. HF
directories ship ``tokenizer.json`` directly. Either way the result serialises to one JSON document
so the weight cache can restore it without re-reading the model file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

Message = dict[str, str]

# Tokens that end an assistant turn in the families we load; whichever exist in a vocabulary count.
_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|end|>")

# Pre-tokenizer regexes by llama.cpp's `tokenizer.ggml.pre` name.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class Tokenizer:
    """Text <-> token ids, plus the model's own chat template."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_id: int | None,
        eos_ids: Sequence[int],
        chat_template: str | None,
        add_bos: bool = False,
    ) -> None:
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = frozenset(eos_ids)
        self.chat_template = chat_template
        self.add_bos = add_bos
        self._template: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of ``text`` (no special tokens) and each token's character span in it: what maps a
        span of the text to the hidden states of its tokens (``graphs/spans.py``)."""
        enc = self.backend.encode(text, add_special_tokens=False)
        return list(enc.ids), [(int(a), int(b)) for a, b in enc.offsets]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def render_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """Render messages with the model's template, as HF's ``apply_chat_template`` would."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send the prompt raw (--raw)")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        bos = self.backend.id_to_token(self.bos_id) if self.bos_id is not None else ""
        eos = self.backend.id_to_token(min(self.eos_ids)) if self.eos_ids else ""
        return self._template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
        )

    def encode_chat(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
        # The template writes its own BOS/markers; adding another BOS would double it.
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt),
                           add_bos=False)

    # -- serialisation (for the weight cache) -------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({
            "backend": json.loads(self.backend.to_str()),
            "bos_id": self.bos_id,
            "eos_ids": sorted(self.eos_ids),
            "chat_template": self.chat_template,
            "add_bos": self.add_bos,
        })

    @classmethod
    def from_json(cls, text: str) -> "Tokenizer":
        d = json.loads(text)
        return cls(
            HFTokenizer.from_str(json.dumps(d["backend"])),
            bos_id=d["bos_id"],
            eos_ids=d["eos_ids"],
            chat_template=d["chat_template"],
            add_bos=d["add_bos"],
        )


def _raise_template_error(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _end_of_turn_ids(backend: HFTokenizer, eos_id: int | None) -> list[int]:
    ids = [i for i in (backend.token_to_id(t) for t in _END_OF_TURN) if i is not None]
    if eos_id is not None:
        ids.append(eos_id)
    return sorted(set(ids))


def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> Tokenizer:
    """Rebuild the tokenizer llama.cpp would use from ``tokenizer.ggml.*`` metadata."""
    kind = meta.get("tokenizer.ggml.model", "gpt2")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = _gpt2_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
    elif kind == "llama":
        backend = _sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.scores"), vocab,
                                     bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; expected 'gpt2' (BPE) or "
                         "'llama' (SentencePiece)")
    # Control (3) and user-defined (4) tokens must match atomically inside templated text.
    specials = [AddedToken(tok, special=(t == 3), normalized=False)
                for tok, t in zip(tokens, types) if t in (3, 4)]
    backend.add_special_tokens(specials)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return Tokenizer(
        backend,
        bos_id=int(bos) if bos is not None else None,
        eos_ids=_end_of_turn_ids(backend, int(eos) if eos is not None else None),
        chat_template=meta.get("tokenizer.chat_template"),
        # SmolLM-style GGUFs set add_bos with BOS = <|im_start|>; their HF tokenizer adds nothing.
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)) and kind == "llama",
    )


def _gpt2_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"), byte_level])
    if pre in ("qwen2", "deepseek-llm"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated"), byte_level])
    if pre in ("smollm", "starcoder", "refact"):
        # llama.cpp splits every digit on its own before the GPT-2 regex, as HF's SmolLM does.
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _sentencepiece_bpe(tokens: list[str], scores: list[float] | None, vocab: dict[str, int],
                       add_space_prefix: bool) -> HFTokenizer:
    """A SentencePiece-BPE vocabulary as an HF BPE model (merges ranked by the merged piece's score)."""
    scores = scores or [0.0] * len(tokens)
    candidates: list[tuple[float, int, str, str]] = []
    for piece, pid in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                candidates.append((-scores[pid], pid, left, right))
    merges = [(left, right) for _, _, left, right in sorted(candidates)]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True,
                                     unk_token=tokens[0] if tokens else None))
    norm = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend("\u2581"))
    backend.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(dec)
    return backend


def tokenizer_from_hf_dir(path: Path) -> Tokenizer:
    """Load ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``generation_config.json``) from an HF dir."""
    tok_file = path / "tokenizer.json"
    if not tok_file.exists():
        raise FileNotFoundError(f"{path} has no tokenizer.json; Elesium needs a fast-tokenizer export")
    backend = HFTokenizer.from_file(str(tok_file))
    cfg = _read_json(path / "tokenizer_config.json")
    gen = _read_json(path / "generation_config.json")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # several named templates: use "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()

    def tok_id(value: Any) -> int | None:
        if isinstance(value, dict):
            value = value.get("content")
        return backend.token_to_id(value) if isinstance(value, str) else None

    bos = tok_id(cfg.get("bos_token"))
    eos_ids = _end_of_turn_ids(backend, tok_id(cfg.get("eos_token")))
    gen_eos = gen.get("eos_token_id")
    extra = gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
    eos_ids = sorted(set(eos_ids) | set(extra))
    return Tokenizer(backend, bos_id=bos, eos_ids=eos_ids, chat_template=template,
                     add_bos=bool(cfg.get("add_bos_token", False)))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}
