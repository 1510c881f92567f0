"""Raw text into a trained model (`translate`, `evaluate --src`): which tags or prompt a source
gets (the model's serving languages and domains, as a sub-network extracted for one task serves
only that task), the task labels its routers read, and translation with long lines refused or
truncated, each bad choice one ConfigError / DataError line naming its flag."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from moe_train.errors import ConfigError, DataError


def _check_known(flag: str, given: str, known: list[str], whose: str = "the model's") -> None:
    if given not in known:
        raise ConfigError(f"--{flag}: {given!r} is not one of {whose} ({', '.join(known)})")


def serving(inf) -> tuple[dict[str, Any], str]:
    """(the manifest as `inf` serves it, who serves it, for messages): an extracted
    sub-network serves only its task's corpora (eval.extract.serving_manifest)."""
    from moe_train.eval.extract import serving_manifest

    task = inf.cfg.moe.extracted_task
    whose = f"this sub-network's (extracted with --task {task})" if task else "the model's"
    return serving_manifest(inf.cfg, inf.manifest), whose


def _tag_choice(flag: str, given: str | None, known: list[str], needs: str,
                whose: str = "the model's") -> str:
    """`given` if it is one of `known`, or the only one when not given; else ConfigError."""
    if given is None:
        if len(known) != 1:
            raise ConfigError(f"--{flag}: this model {needs} {', '.join(known)}; choose one")
        return known[0]
    _check_known(flag, given, known, whose)
    return given


def source_prefix(manifest: dict[str, Any], vocab, domain: str | None,
                  tgt_lang: str | None, whose: str = "the model's") -> list[int]:
    """Tag ids to put before every raw-text source, as the model's data had them: the domain tag
    (data.domain_tags, from --domain), then the target-language tag (data.lang_tags, from
    --tgt-lang). A flag may be left out when the data had one choice."""
    corpora = manifest.get("corpora", [])  # none: a converted model saw no corpus
    targets = sorted({c["tgt_lang"] for c in corpora})
    held = {c["domain"] for c in corpora}  # an extracted sub-network's: its task's
    all_domains = manifest.get("domains", [])
    domains = [d for d in all_domains if d in held] or list(all_domains)
    return vocab.source_prefix(
        _tag_choice("domain", domain, domains,
                    "was trained with domain tags (data.domain_tags) for", whose)
        if manifest.get("domain_tags") else None,
        _tag_choice("tgt-lang", tgt_lang, targets, "translates into", whose)
        if manifest.get("lang_tags") else None)


def _source_prefix(inf, args: argparse.Namespace) -> list[int]:
    manifest, whose = serving(inf)
    return source_prefix(manifest, inf.vocab, getattr(args, "domain", None),
                         getattr(args, "tgt_lang", None), whose)


def _prompts(inf, args: argparse.Namespace, lines: list[str], source: str = "input"
             ) -> list[str]:
    """Raw lines as a decoder-only model's prompts (data.prompt_template), the languages from
    --src-lang / --tgt-lang or the model's only choice. A blank line (or one the tokenizer
    keeps nothing of) stays blank; a prompt must leave room for a translation as long as its
    source (`fit_prompt`): else the line is refused, or its source cut (--long-lines)."""
    from moe_train.data.corpus import collapse_spaces
    from moe_train.data.prompts import fit_prompt
    from moe_train.eval.decode import max_source_tokens, positions_field

    corpora = inf.manifest.get("corpora", [])

    def choose(flag: str, key: str, needs: str) -> str:
        known, given = sorted({c[key] for c in corpora}), getattr(args, flag.replace("-", "_"))
        if known:
            return _tag_choice(flag, given, known, needs)
        if given is None:  # e.g. converted from Hugging Face: no training data to go by
            raise ConfigError(f"--{flag}: this model names no languages; expected a code "
                              "such as de")
        return given

    src = choose("src-lang", "src_lang", "translates from")
    tgt = choose("tgt-lang", "tgt_lang", "translates into")
    # the template the training data was filled with, and its whitespace rule (prepare
    # collapses runs of whitespace); a blank line stays blank (translated to a blank line)
    template = inf.manifest.get("data_config", {}).get("prompt_template") or \
        inf.cfg.data.prompt_template
    limit, field = max_source_tokens(inf.model), positions_field(inf.model)
    count = lambda text: len(inf.vocab.encode(text))  # noqa: E731
    prompts = []
    for line_no, line in enumerate(lines, start=1):
        text = collapse_spaces(line)
        if not text or not count(text):
            prompts.append("")
            continue
        prompt, kept = fit_prompt(template, text, src, tgt, count, limit)
        if kept is not None:
            where = (f"{source}:{line_no}: its prompt and a translation as long as its source "
                     f"need more than the model's {field}={limit} positions")
            if args.long_lines == "error" or kept == 0:
                raise DataError(f"{where}; nothing was translated (shorten or split the line"
                                + (", or pass --long-lines truncate)" if kept else ")"))
            _warn(f"{where}; translating its first {kept} words only")
        prompts.append(prompt)
    return prompts


def raw_text_labels(inf, args: argparse.Namespace):
    """Language and domain ids for raw-text input: from --src-lang / --tgt-lang / --domain, or
    the model's only choice when its data had one (an extracted sub-network's: its task's)."""
    from moe_train.eval.decode import RawTextLabels

    manifest, whose = serving(inf)
    corpora = manifest.get("corpora", [])

    def pick(flag: str, given: str | None, known: list[str], used: set[str]) -> int | None:
        if given is None:
            return known.index(next(iter(used))) if len(used) == 1 else None
        if not known:  # a converted model that saw no corpus: no ids to give
            return None
        _check_known(flag, given, sorted(used) or known, whose)  # what it trained on
        return known.index(given)

    langs, domains = manifest.get("langs", []), manifest.get("domains", [])
    return RawTextLabels(
        src_lang=pick("src-lang", getattr(args, "src_lang", None), langs,
                      {c["src_lang"] for c in corpora}),
        tgt_lang=pick("tgt-lang", getattr(args, "tgt_lang", None), langs,
                      {c["tgt_lang"] for c in corpora}),
        domain=pick("domain", getattr(args, "domain", None), domains,
                    {c["domain"] for c in corpora}),
        num_langs=len(langs))


_TAG_PIECE = re.compile(r"<2[^<>\s]+>|<dom:[^<>\s]+>")
"""Our sentencepiece tag pieces (`data.vocab.lang_tag`, `domain_tag`)."""


def _check_no_control_tokens(vocab: Any, lines: list[str], source: str) -> None:
    """Refuse input text holding a piece the tokenizer reads as a control token wherever it
    appears (a tag `<2de>` / `<dom:law>`, a special token `<|endoftext|>`), as prepare refuses
    it in training text: the model would obey it (another domain, an early end)."""
    from moe_train.data.hf_tokenizer import HFTokenizer
    from moe_train.data.prepare import first_tag

    hf = isinstance(vocab, HFTokenizer)
    tags = vocab.special_tokens() if hf else [
        piece for piece in map(vocab.piece, range(len(vocab))) if _TAG_PIECE.fullmatch(piece)]
    hit = first_tag(lines, tags, normalized=not hf)
    if hit is not None:
        raise DataError(f"{source}:{hit[0]}: holds {hit[1]!r}, which this model's tokenizer "
                        "reads as a control token (a tag or a special token) the model would "
                        "obey; remove or reword it")


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def translate_raw(inf, args: argparse.Namespace, source: str, lines: list[str], ecfg,
                   device) -> list[str]:
    """Translate raw lines as `translate` and `evaluate --src` both do: a decoder-only model
    gets them as the instruction prompts it trained on, an encoder-decoder its source tags."""
    from moe_train.eval.decode import translate_lines

    _check_no_control_tokens(inf.vocab, lines, source)
    if inf.cfg.decoder_only:
        lines, prefix = _prompts(inf, args, lines, source), []
    else:
        prefix = _source_prefix(inf, args)
    return translate_lines(inf.model, inf.vocab, lines, ecfg, device, prefix,
                           labels=raw_text_labels(inf, args), source=source,
                           long_lines=args.long_lines, warn=_warn,
                           prompts=inf.cfg.decoder_only)
