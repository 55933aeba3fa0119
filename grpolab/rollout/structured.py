"""Structured output: constrain a completion to a JSON schema, any JSON object, a regular expression,
one of a list of strings, or a Lark/GBNF grammar, with llguidance (a Rust matcher, CPU only).

A request's constraint is a `Constraint` (kind, spec): hashable and library-free, so sampling settings
can carry it. `Grammars(tok)` turns one into llguidance's grammar for that tokenizer (checked once, cached
per constraint) and hands each completion its own matcher. Each decode step a matcher writes its allowed
next tokens as a packed bitmask (logits_processors.unpack_bitmask reads it); once the grammar is complete
only the tokenizer's stop tokens are allowed, so the completion ends there.

llguidance was chosen by measurement (bench/structured_output.py, docs/serving.md): on SmolLM2's
49k-token vocabulary its mask costs ~16 us a token on one core, it has no dependencies, and vLLM 0.32
depends on it (its `guidance` backend).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import torch

from .logits_processors import unpack_bitmask

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class BadConstraint(ValueError):
    """A constraint llguidance cannot compile (the message says why)."""


@dataclass(frozen=True)
class Constraint:
    """kind: one of KINDS; spec: the JSON schema (JSON text), the regex, the choices (a JSON list),
    the Lark or GBNF grammar ("" for json_object). any_whitespace: JSON may hold whitespace anywhere
    JSON allows it (vLLM's default); False: none between tokens (vLLM's disable_any_whitespace)."""
    kind: str
    spec: str = ""
    any_whitespace: bool = True


def grammar_text(c: Constraint) -> str:
    """llguidance's grammar for a constraint (not yet checked against a tokenizer)."""
    import llguidance  # the serve extra; only a constrained request needs it

    options = {"whitespace_flexible": c.any_whitespace}
    try:
        if c.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(c.spec, defaults=options)
        if c.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
        if c.kind == "choice":
            choices = json.loads(c.spec)
            if not choices or not all(isinstance(x, str) for x in choices):
                raise BadConstraint("choice must be a non-empty list of strings")
            return llguidance.grammar_from("choice", c.spec)
        if c.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(c.spec)
        if c.kind == "grammar":
            return llguidance.grammar_from("grammar", c.spec)
    except ValueError as e:
        raise BadConstraint(str(e)) from None
    raise BadConstraint(f"unknown constraint kind {c.kind!r}; use one of {', '.join(KINDS)}")


def _empty(kind: str) -> str:
    """Why a constraint that no completion satisfies is refused (found as: no first token is allowed)."""
    if kind == "json":
        return ("the schema admits no JSON value (no first token is allowed: e.g. a $ref that refers only to "
                "itself); give a schema some value satisfies")
    return (f"the {kind} admits no string (no first token is allowed and the empty string is not in it: e.g. a "
            f"rule that refers only to itself, or an empty character class); give one some text satisfies")


class _CharVocab:
    """What llguidance's TokenizerWrapper reads from a tokenizer without a Hugging Face backend (the
    built-in CharTokenizer): each id's bytes (special tokens marked with a leading 0xFF, llguidance's
    convention), the end-of-sequence id, and an encoder."""

    def __init__(self, tok) -> None:
        special = set(getattr(tok, "special", {}).values())
        self.tokens = [b"\xff" + tok.decode([i], skip_special=False).encode() if i in special
                       else tok.decode([i]).encode() for i in range(tok.vocab_size)]
        self.special_token_ids = sorted(special)
        self.eos_token_id, self.bos_token_id = tok.stop_ids[0], getattr(tok, "bos_id", None)
        self._tok = tok

    def __call__(self, s: str) -> list[int]:
        return self._tok.encode(s)


class Grammars:
    """Compiled constraints for one tokenizer; thread-safe (the server checks requests in its event
    loop while the batcher builds matchers in its thread)."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self._lltok = None
        self._cache: dict[Constraint, str] = {}
        self._lock = threading.Lock()

    def _tokenizer(self):
        import llguidance
        import llguidance.hf

        if self._lltok is None:   # ~0.25 s for a 49k vocabulary: built on the first constrained request
            stops = list(self.tok.stop_ids)
            if hasattr(self.tok, "tok"):   # grpolab's HFTokenizer: the fast tokenizer inside
                self._lltok = llguidance.hf.from_tokenizer(self.tok.tok, eos_token=stops)
            else:
                self._lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_CharVocab(self.tok)),
                                                     eos_token=stops)
        return self._lltok

    def compile(self, c: Constraint) -> str:
        """The checked grammar of `c` (cached); BadConstraint with llguidance's reason when it is not valid."""
        try:   # every constrained request passes here first
            import llguidance
        except ImportError:
            raise BadConstraint("structured output needs llguidance: pip install 'grpolab[serve]'") from None

        with self._lock:
            if c not in self._cache:
                grammar = grammar_text(c)
                error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer())
                if error and not error.startswith("WARNING"):
                    raise BadConstraint(error)
                if not self._can_start(grammar):
                    raise BadConstraint(_empty(c.kind))
                self._cache[c] = grammar
            return self._cache[c]

    def _can_start(self, grammar: str) -> bool:
        """Whether a completion under `grammar` can begin: a first token other than the stop tokens is allowed,
        or the empty string is complete. An empty language leaves llguidance's fresh matcher in error, whose
        mask allows the stop tokens alone (a 200 with an empty completion, before this check)."""
        import llguidance

        m = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if m.is_error():
            return False
        allowed = self.masks([m], self.tok.vocab_size)
        allowed[:, list(self.tok.stop_ids)] = False
        return bool(allowed.any()) or m.is_accepting()

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """Each token's raw bytes as llguidance reads the vocabulary (a byte-level BPE token may hold part of a
        UTF-8 character; special tokens their text)."""
        t = self._tokenizer()
        return [t.decode_bytes([i]) for i in ids]

    def matcher(self, c: Constraint):
        """A fresh matcher (one per completion) at the start of `c`."""
        import llguidance

        grammar = self.compile(c)
        m = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise BadConstraint(m.get_error())
        return m

    def masks(self, matchers: list, vocab: int) -> torch.Tensor:
        """(B, V) bool: the tokens each matcher allows next."""
        import llguidance.torch as lt

        from_lib = self._tokenizer().vocab_size
        bits = lt.allocate_token_bitmask(len(matchers), from_lib)
        for i, m in enumerate(matchers):
            lt.fill_next_token_bitmask(m, bits, i)
        allowed = unpack_bitmask(bits, min(vocab, from_lib))
        if allowed.size(1) < vocab:   # logits wider than the tokenizer (padded embeddings): never allowed
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.size(1)))
        return allowed

