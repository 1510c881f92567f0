"""Instruction-style prompts for decoder-only translation (``data.prompt_template``).

A decoder-only model reads ``prompt(source) + target + eos`` and is trained on the target and
eos tokens only. `prepare` stores each source as its filled prompt, so batches, the length
filter and the token budget see the tokens the model reads; `translate` fills the same
template. Placeholders: ``{source}`` (required), ``{src_lang}`` / ``{tgt_lang}`` (codes such as
de) and ``{src_name}`` / ``{tgt_name}`` (English names such as German; the code when unknown).
"""

from __future__ import annotations

import string
from typing import Callable

from moe_train.errors import ConfigError

DEFAULT_PROMPT = "Translate the following {src_name} text into {tgt_name}.\n{src_name}: " \
                 "{source}\n{tgt_name}:"
"""The template a decoder-only config gets when it sets none."""
PLACEHOLDERS = ("source", "src_lang", "tgt_lang", "src_name", "tgt_name")
LANGUAGE_NAMES = {
    "ar": "Arabic", "bg": "Bulgarian", "cs": "Czech", "da": "Danish", "de": "German",
    "el": "Greek", "en": "English", "es": "Spanish", "et": "Estonian", "fi": "Finnish",
    "fr": "French", "he": "Hebrew", "hi": "Hindi", "hr": "Croatian", "hu": "Hungarian",
    "it": "Italian", "ja": "Japanese", "ko": "Korean", "lt": "Lithuanian", "lv": "Latvian",
    "nl": "Dutch", "no": "Norwegian", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian",
    "ru": "Russian", "sk": "Slovak", "sl": "Slovenian", "sv": "Swedish", "tr": "Turkish",
    "uk": "Ukrainian", "vi": "Vietnamese", "zh": "Chinese",
}


def check_template(template: str, field: str = "data.prompt_template") -> None:
    """A ConfigError naming `field` unless `template` has {source} and only known fields."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ConfigError(f"{field}: {exc}; expected a format string with {{source}}") from None
    unknown = sorted(set(names) - set(PLACEHOLDERS))
    if unknown or "source" not in names:
        raise ConfigError(f"{field}: expected {{source}} and only the placeholders "
                          f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)}, got {template!r}")
    try:  # a format spec or conversion the text cannot take ({source:d}, {source!x})
        format_prompt(template, "text", "de", "en")
    except (ValueError, TypeError, OverflowError, KeyError, IndexError) as exc:
        raise ConfigError(f"{field}: {exc!r}; expected plain placeholders such as {{source}}, "
                          f"got {template!r}") from None


def language_name(code: str) -> str:
    """English name of a language code (the code itself when unknown)."""
    return LANGUAGE_NAMES.get(code, code)


def format_prompt(template: str, source: str, src_lang: str, tgt_lang: str) -> str:
    """The prompt of one source sentence."""
    return template.format(source=source, src_lang=src_lang, tgt_lang=tgt_lang,
                           src_name=language_name(src_lang), tgt_name=language_name(tgt_lang))


def fit_prompt(template: str, text: str, src_lang: str, tgt_lang: str,
               count: Callable[[str], int], limit: int | None) -> tuple[str, int | None]:
    """The prompt of `text` for a model of `limit` positions, and how many of its words it
    keeps (None: all). A prompt fits when it leaves the model room for a translation as long as
    the source and its eos, which is predicted but never fed (`count`: tokens of a text); else
    the source's words are cut from the end (0 kept: not even its first word fits)."""
    def tokens(words: list[str]) -> int:
        source = " ".join(words)
        return count(format_prompt(template, source, src_lang, tgt_lang)) + count(source)

    words = text.split()
    if limit is None or tokens(words) <= limit:
        return format_prompt(template, text, src_lang, tgt_lang), None
    lo, hi = 0, len(words)  # the most words that fit: in [lo, hi)
    while lo < hi - 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if tokens(words[:mid]) <= limit else (lo, mid)
    return format_prompt(template, " ".join(words[:lo]), src_lang, tgt_lang), lo
