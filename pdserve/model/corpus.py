"""The built-in byte-level BPE tokenizer: its deterministic training text and its training.

The built-in models must be byte-identical on every machine, so the tokenizer's training text
cannot come from anything that varies between hosts or Python versions (the stdlib sources, a
downloaded dataset). Instead it is generated here from small word lists with a fixed-seed
`random.Random`. Only integer-driven draws (`randrange`, `choice`, `shuffle`) are used: their
output for a given seed has been stable across CPython 3.x releases, whereas float-based
helpers have changed in the past.

The text mixes English-like prose, Python-like code, numbers, markup and a few non-Latin
scripts and emoji, so that the learned merges cover the shapes of text a serving test sends.
builtin.py adds the per-model parts (post-processor, tokenizer_config.json).
"""

from __future__ import annotations

import random
from functools import lru_cache

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TOKENIZER_VOCAB = 4096
# Qwen2's published pre-tokenization pattern (one digit per piece, letters with one leading
# non-letter, punctuation runs, newline runs). It must be this exact pattern: HF transformers
# rebuilds any model_type "qwen2" tokenizer with it (plus NFC) whatever tokenizer.json says, so
# any other split would make HF and pdserve disagree on token ids.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_NOUNS = _words(
    """
time year people way day man woman child world life hand part place case week company system
program question work government number night point home water room mother area money story
fact month lot right study book eye job word business issue side kind head house service
friend father power hour game line end member law car city community name president team
minute idea kid body information back parent face others level office door health person art
war history party result change morning reason research girl guy moment air teacher force
education server request token model cache memory thread process queue engine worker router
client batch block layer tensor kernel device buffer stream signal river mountain forest
garden window bridge market island village planet ocean cloud storm
"""
)

_VERBS = _words(
    """
ask build call carry change check close come compute create decide describe design explain
fill find finish follow give help hold keep learn leave listen load look make measure move
need open order pass play plan print push read reach return run save schedule send serve
share show start stop store talk teach test think touch train try turn update use visit wait
walk want watch work write allocate decode encode fetch flush merge parse render sample
"""
)

_ADJECTIVES = _words(
    """
good new first last long great little own other old right big high different small large
next early young important few public bad same able quick slow bright dark simple complex
quiet loud warm cold empty full careful clear strange final main local remote free busy safe
stable fast tiny huge narrow wide open closed ready idle short deep green blue red
"""
)

_ADVERBS = _words(
    """
quickly slowly carefully quietly often never always sometimes usually rarely again soon
today later early finally suddenly easily clearly simply nearly really almost already
"""
)

_NAMES = _words(
    """
Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Niaj Olivia Peggy Rupert Sybil
Trent Victor Walter London Paris Berlin Tokyo Madrid Cairo Lima Oslo Python Linux
"""
)

_PREPOSITIONS = _words(
    """
in on at by with from into over under after before during through near
"""
)

_CONNECTIVES = (
    "and",
    "but",
    "so",
    "because",
    "while",
    "although",
    "when",
    "if",
    "then",
    "or",
)

_PY_WORDS = _words(
    """
value result items count index name path config request response buffer state tokens ids
data size offset limit key line text batch queue block table model params cache layer
"""
)

_PY_TYPES = ("int", "str", "float", "bool", "bytes", "list[int]", "dict[str, int]", "None")

# A few sentences per script, written for this file, so multi-byte UTF-8 sequences get merges.
_FOREIGN = (
    "Le chat dort sur la chaise près de la fenêtre.",
    "Où est la gare? Je voudrais un café, s'il vous plaît.",
    "Der schnelle Fuchs läuft über die grüne Wiese.",
    "Größe und Gewicht werden später gemessen.",
    "El niño come una manzana en el jardín.",
    "¿Cuántos años tienes? Mañana vamos a la playa.",
    "Привет, как дела? Сегодня хорошая погода.",
    "Мы читаем книгу и пишем письмо.",
    "今天天气很好，我们去公园散步吧。",
    "我喜欢学习新的语言和编程。",
    "東京の天気は晴れです。ありがとうございます。",
    "これはテストの文章です。",
    "안녕하세요, 만나서 반갑습니다.",
    "Καλημέρα, τι κάνεις σήμερα;",
    "مرحبا بكم في المدينة الجميلة.",
    "नमस्ते, आप कैसे हैं?",
)

# Invented words (built from these syllables) give the long tail a natural corpus has: without
# them a few hundred real words are fully merged long before the vocabulary is full.
_ONSETS = _words(
    """
b c d f g h j k l m n p r s t v w z br cl dr fl gr pl st th sh ch tr sp
"""
)
_VOWELS = _words(
    """
a e i o u a e i o ea ou ai io
"""
)
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt")

_EMOJI = ("😀", "🎉", "🚀", "✨", "👍", "❤️", "🔥", "🙂", "🌍", "✅", "⚠️", "👩‍💻")

_SYMBOL_LINES = (
    "α + β = γ, ∑ x² ≤ ∞",
    "price: €12.50 / £10 / ¥1500",
    "→ ← ↑ ↓ • … “quoted” ‘single’ — dash",
)


@lru_cache(maxsize=1)
def trained_tokenizer_json() -> str:
    """tokenizer.json text of the BPE trained on corpus_text(), special tokens last (ids 4093-5).

    Trained once per process; about half a second. No post-processor: that is per model.
    """
    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The trainer breaks count ties by token id, so its result does not depend on thread
    # scheduling or hash seeds (test_builtin retrains in a fresh process and compares bytes).
    tok.train_from_iterator(corpus_text().split("\n"), trainer)
    if tok.get_vocab_size() != TOKENIZER_VOCAB - len(SPECIAL_TOKENS):
        raise RuntimeError(
            f"tokenizer training produced {tok.get_vocab_size()} tokens, "
            f"wanted {TOKENIZER_VOCAB - len(SPECIAL_TOKENS)}: the corpus is too small"
        )
    # Special tokens go last, like Qwen's, so nothing may assume they have small ids.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok.to_str()


def corpus_text(target_chars: int = 1_000_000, seed: int = 20240601) -> str:
    """Return about `target_chars` characters of mixed training text, the same for a given seed."""
    if target_chars <= 0:
        raise ValueError(f"target_chars must be positive, got {target_chars}")
    writer = _Writer(random.Random(seed))
    makers = (
        writer.paragraph,
        writer.paragraph,
        writer.paragraph,
        writer.python_snippet,
        writer.python_snippet,
        writer.dialogue,
        writer.listing,
    )
    parts: list[str] = []
    size = 0
    while size < target_chars:
        piece = writer.rng.choice(makers)()
        parts.append(piece)
        size += len(piece)
    return "\n\n".join(parts) + "\n"


class _Writer:
    """Draws every piece from one seeded generator: the output is a pure function of the seed."""

    def __init__(self, rng: random.Random, lexicon_size: int = 6000) -> None:
        self.rng = rng
        self.lexicon = sorted({self._invent_word() for _ in range(lexicon_size)})
        rng.shuffle(self.lexicon)

    def _invent_word(self) -> str:
        rng = self.rng
        syllables = rng.randrange(1, 5)
        return "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
        )

    def rare_word(self) -> str:
        # randrange(randrange(n)) favours small indices: a Zipf-like head with a long tail.
        return self.lexicon[self.rng.randrange(self.rng.randrange(1, len(self.lexicon) + 1))]

    def noun(self) -> str:
        return self.rare_word() if self.rng.randrange(4) == 0 else self.rng.choice(_NOUNS)

    def verb(self) -> str:
        rng = self.rng
        verb = self.rare_word() if rng.randrange(6) == 0 else rng.choice(_VERBS)
        # Crude inflection: enough to make "-s", "-ed" and "-ing" frequent suffix merges.
        ending = rng.randrange(4)
        if ending == 0:
            return verb
        if ending == 1:
            return verb + ("es" if verb.endswith(("s", "sh", "ch")) else "s")
        if ending == 2:
            return verb + ("d" if verb.endswith("e") else "ed")
        return (verb[:-1] if verb.endswith("e") else verb) + "ing"

    def noun_phrase(self) -> str:
        rng = self.rng
        article = rng.choice(("the", "a", "this", "that", "every", "our", "their"))
        if rng.randrange(2):
            return f"{article} {rng.choice(_ADJECTIVES)} {self.noun()}"
        if rng.randrange(5) == 0:
            return rng.choice(_NAMES)
        return f"{article} {self.noun()}"

    def clause(self) -> str:
        rng = self.rng
        words = [self.noun_phrase(), self.verb(), self.noun_phrase()]
        if rng.randrange(3) == 0:
            words.insert(1, rng.choice(_ADVERBS))
        if rng.randrange(2):
            words += [rng.choice(_PREPOSITIONS), self.noun_phrase()]
        return " ".join(words)

    def sentence(self) -> str:
        rng = self.rng
        text = self.clause()
        if rng.randrange(3) == 0:
            text += f", {rng.choice(_CONNECTIVES)} {self.clause()}"
        if rng.randrange(8) == 0:
            text += f" ({rng.randrange(1, 2000)} {self.noun()}s)"
        end = rng.choice((".", ".", ".", "!", "?"))
        if rng.randrange(40) == 0:
            end += " " + rng.choice(_EMOJI)
        return text[0].upper() + text[1:] + end

    def paragraph(self) -> str:
        rng = self.rng
        sentences = [self.sentence() for _ in range(rng.randrange(2, 8))]
        if rng.randrange(6) == 0:
            sentences.insert(rng.randrange(len(sentences) + 1), rng.choice(_FOREIGN))
        if rng.randrange(25) == 0:
            sentences.append(rng.choice(_SYMBOL_LINES))
        return " ".join(sentences)

    def ident(self) -> str:
        rng = self.rng
        first = rng.choice(_PY_WORDS) if rng.randrange(4) else self.rare_word()
        return first if rng.randrange(2) else f"{first}_{rng.choice(_PY_WORDS)}"

    def expression(self) -> str:
        rng = self.rng
        kind = rng.randrange(6)
        if kind == 0:
            return f"{self.ident()} + {rng.randrange(100)}"
        if kind == 1:
            return f"len({self.ident()})"
        if kind == 2:
            return f"{self.ident()}[{self.ident()}]"
        if kind == 3:
            return f'"{self.noun()} {self.verb()}"'
        if kind == 4:
            return f"self.{self.ident()}.get({self.ident()!r})"
        return f"[{self.ident()} for {self.ident()} in range({rng.randrange(1, 64)})]"

    def python_snippet(self) -> str:
        rng = self.rng
        name = f"{rng.choice(_VERBS)}_{self.ident()}"
        args = sorted({self.ident() for _ in range(rng.randrange(1, 4))})
        signature = ", ".join(f"{a}: {rng.choice(_PY_TYPES)}" for a in args)
        lines = [
            f"def {name}({signature}) -> {rng.choice(_PY_TYPES)}:",
            f'    """{self.sentence()}"""',
        ]
        for _ in range(rng.randrange(2, 7)):
            stmt = rng.randrange(5)
            if stmt == 0:
                lines.append(f"    {self.ident()} = {self.expression()}")
            elif stmt == 1:
                lines.append(f"    if {self.ident()} > {rng.randrange(10)}:")
                lines.append(f"        return {self.expression()}")
            elif stmt == 2:
                lines.append(f"    for {self.ident()} in {self.ident()}:")
                lines.append(f"        {self.ident()}.append({self.expression()})")
            elif stmt == 3:
                lines.append(f"    # {self.clause()}")
            else:
                lines.append(
                    f'    raise ValueError(f"{self.ident()} {{{self.ident()}}} is invalid")'
                )
        lines.append(f"    return {self.expression()}")
        return "\n".join(lines)

    def dialogue(self) -> str:
        rng = self.rng
        speakers = (rng.choice(_NAMES), rng.choice(_NAMES))
        return "\n".join(
            f'{speakers[i % 2]}: "{self.sentence()}"' for i in range(rng.randrange(2, 5))
        )

    def listing(self) -> str:
        rng = self.rng
        kind = rng.randrange(3)
        if kind == 0:
            items = [
                f"- {rng.choice(_ADJECTIVES)} {self.noun()}" for _ in range(rng.randrange(2, 6))
            ]
            return f"## {self.noun().title()} list\n" + "\n".join(items)
        if kind == 1:
            fields = ", ".join(
                f'"{self.ident()}": {rng.randrange(-500, 5000)}' for _ in range(rng.randrange(1, 5))
            )
            return "{" + fields + "}"
        year, month, day = rng.randrange(1990, 2030), rng.randrange(1, 13), rng.randrange(1, 29)
        return (
            f"{year}-{month:02d}-{day:02d} {rng.randrange(24):02d}:{rng.randrange(60):02d} "
            f"{rng.choice(('INFO', 'WARN', 'ERROR'))} {self.clause()} id={rng.randrange(10**6)}"
        )
