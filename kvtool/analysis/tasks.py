"""Long-context tasks in the style of RULER, generated offline from a seed (``kvtool tasks``).

Every sample is three runs of token ids, built from text pieces tokenised one at a time:

- ``context``: the chat template's opening and the long text (the haystack with its needles); this is
  the part that is captured and compressed, *before* the question is seen;
- ``question``: the question, the end of the user turn, the assistant's opening and an answer prefix
  ("The special magic number for ... is");
- ``answer``: the expected answer tokens, with ``scored`` marking the ones that are checked
  (separators such as ``, `` between listed values are given, not scored).

``length`` is the token count of context + question (the prompt the model reads), so a 4k sample
fills 4,096 tokens of the model's window before the answer.

Tasks (:data:`TASKS`; names as in RULER where they match):

- ``niah_single``: one needle "One of the special magic numbers for KEY is: NUMBER." in a noise
  haystack (short plain sentences repeated); asked for the number of KEY.
- ``niah_essay``: the same needle in the shipped texts (prose, dialogue, code) used as haystack.
- ``niah_multikey``: four needles with different keys; asked for one of them.
- ``niah_multikey_essay``: the same four needles in the shipped texts.
- ``niah_multivalue``: four needles with the same key and different numbers; asked for all four, in
  the order they appear.
- ``niah_multiquery``: four needles with different keys; asked for two of them, in the order asked.
- ``vt`` (variable tracking): a chain ``VAR AAAAA = 12345``, ``VAR BBBBB = AAAAA``, ... of four
  assignments spread through the noise; asked which variables hold the value, in chain order.
- ``cwe`` (common-word extraction): a numbered list of words in which five words appear far more
  often than the rest (each a different number of times); asked for the five, most frequent first.
- ``qa`` (recall over the shipped texts): a passage of the shipped texts; asked to complete a quote
  of it (six tokens that occur once in the context): the answer is the five tokens that follow.

Several questions about one context (:func:`each_needle`, ``kvtool tasks --questions N``): the
four-needle tasks ``niah_multikey`` and ``niah_multikey_essay`` asked about N different needles of
the same context, the sample's own question first, then the other needles in the order of their keys.

Answers are checked teacher-forced (:mod:`kvtool.analysis.taskeval`): a sample is right when every
scored answer token is the model's top-1 next token given the prompt and the answer tokens before it,
which is exactly "greedy decoding produces the answer" for a single answer.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field
from typing import Any

from kvtool import texts
from kvtool.core.errors import UsageError
from kvtool.core.limits import MAX_TOKENS

MULTI_QUESTION_TASKS = ("niah_multikey", "niah_multikey_essay")
TASKS = ("niah_single", "niah_essay", "niah_multikey", "niah_multikey_essay", "niah_multivalue", "niah_multiquery", "vt", "cwe", "qa")

# the haystack of the noise tasks: short plain sentences, repeated (written for kvtool)
NOISE = ("The river runs past the old mill. The hills are green in spring. A cart goes down the road. "
         "The bell rings at noon. Then the town is quiet again.")

# words for needle keys (adjective-noun) and for the common-word list, written for kvtool
ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen", "lucky",
              "mellow", "noble", "odd", "proud", "quiet", "rapid", "silver", "tidy", "upper", "vivid", "wild", "young")
NOUNS = ("anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island", "jacket", "kettle",
         "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "rocket", "saddle", "tunnel", "violin", "walrus")
WORDS = ("apple", "basket", "cloud", "desk", "eagle", "forest", "guitar", "hammer", "igloo", "jungle", "kite", "lemon",
         "mirror", "napkin", "ocean", "pencil", "quilt", "river", "spoon", "tiger", "umbrella", "village", "window",
         "yacht", "zebra", "bottle", "carpet", "dragon", "feather", "glove", "helmet", "jewel", "ladder", "magnet",
         "nest", "onion", "parrot", "rabbit", "shovel", "tomato", "valley", "wagon", "button", "castle", "drum",
         "flute", "garlic", "honey", "insect", "kitten", "marble", "nickel", "oyster", "pillow", "rose", "sugar")

# a one-needle question and its answer prefix
NIAH_ASK = ("What is the special magic number for {key} mentioned in the provided text?",
            "The special magic number for {key} mentioned in the provided text is:")

INSTRUCTIONS = {
    "niah": "Some special magic numbers are hidden within the following text. Make sure to memorize them. I will quiz you about the numbers afterwards.\n",
    "vt": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n",
    "cwe": "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n",
    "qa": "Read the following text carefully. I will ask you about its exact words afterwards.\n\n",
}


@dataclass
class TaskSample:
    """One generated sample (token ids as plain lists; see the module docstring)."""

    task: str
    length: int
    seed: int
    index: int
    context: list[int]
    question: list[int]
    answer: list[int]
    scored: list[bool]
    answers: list[str]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return len(self.context) + len(self.question)

    def key(self) -> str:
        return f"{self.task}:{self.length}:{self.seed}:{self.index}"

    @property
    def needle_depth(self) -> float | None:
        """Where in the haystack (0 = its start, 1 = its end) the earliest piece the answer needs
        sits: the asked needle(s), the first assignment of ``vt``, the quoted phrase of ``qa``;
        None for ``cwe`` (its answer is spread over the whole list)."""
        if "depths" in self.meta:
            depths = self.meta["depths"]
            asked = self.meta.get("asked", range(len(depths)))
            return min(depths[j] for j in asked) if depths else None
        return self.meta.get("depth")


def sample_rng(task: str, length: int, seed: int, index: int) -> random.Random:
    """The random generator of one sample: a function of the task, length, seed and index only."""
    digest = hashlib.sha256(f"kvtool-task|{task}|{length}|{seed}|{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


class Tokens:
    """Tokenises text pieces (cached) without special tokens."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[str, list[int]] = {}

    def __call__(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            self._cache[text] = ids
        return ids


def chat_frame(tokenizer: Any) -> tuple[str, str]:
    """(text before the user's message, text between the message and the answer) of the tokenizer's
    chat template, or plain text around it when the tokenizer has none."""
    if not getattr(tokenizer, "chat_template", None):
        return "", "\n\nAnswer: "
    marker = "\u2063KVTOOLMSG\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True)
    if marker not in text:
        return "", "\n\nAnswer: "
    before, after = text.split(marker, 1)
    return before, after


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _keys(rng: random.Random, n: int) -> list[str]:
    pairs = rng.sample([(a, b) for a in ADJECTIVES for b in NOUNS], n)
    return [f"{a}-{b}" for a, b in pairs]


def _varname(rng: random.Random, used: set[str]) -> str:
    while True:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in used:
            used.add(name)
            return name


def _filler(tok: Tokens, source: str, n: int, rng: random.Random, essay: bool) -> list[list[int]]:
    """About ``n`` tokens of haystack as a list of sentence token runs (needles go between runs).
    The noise haystack repeats :data:`NOISE`; the essay haystack walks the shipped texts from a
    random sentence on, wrapping around."""
    sentences = [s.strip() for s in source.replace("\n", " ").split(". ") if s.strip()]
    sentences = [s if s.endswith((".", "?", "!", ":")) else s + "." for s in sentences]
    start = rng.randrange(len(sentences)) if essay else 0
    out: list[list[int]] = []
    total = 0
    i = start
    while total < n:
        ids = tok(" " + sentences[i % len(sentences)])
        out.append(ids)
        total += len(ids)
        i += 1
    return out


def _essay_source() -> str:
    return " ".join(t for _, t in texts.shipped())


def _assemble(runs: list[list[int]], inserts: list[tuple[float, list[int]]], budget: int) -> tuple[list[int], list[float]]:
    """Cut the haystack ``runs`` to ``budget`` tokens minus the inserts' tokens and put each insert
    (depth in [0, 1], token ids) between sentences at its depth. Returns the ids and the depths
    actually used (the insert's start over the context length)."""
    room = budget - sum(len(ids) for _, ids in inserts)
    if room < 0:
        raise UsageError(f"a task sample of {budget} context tokens cannot hold its needles; use a longer --lengths")
    kept: list[list[int]] = []
    total = 0
    for ids in runs:
        if total + len(ids) > room:
            ids = ids[: room - total]
        if ids:
            kept.append(ids)
            total += len(ids)
        if total >= room:
            break
    order = sorted(range(len(inserts)), key=lambda j: inserts[j][0])
    slots = [min(len(kept), int(round(inserts[j][0] * len(kept)))) for j in order]
    out: list[int] = []
    where: dict[int, float] = {}
    nxt = 0
    for s_i, ids in enumerate(kept + [[]]):
        while nxt < len(order) and slots[nxt] == s_i:
            j = order[nxt]
            where[j] = len(out)
            out.extend(inserts[j][1])
            nxt += 1
        out.extend(ids)
    depths = [where[j] / max(len(out), 1) for j in range(len(inserts))]
    return out, depths


# shares of the list's items taken by the five common words (most frequent first)
COMMON_SHARES = (0.09, 0.075, 0.06, 0.045, 0.03)


def _pseudo_word(rng: random.Random) -> str:
    syllables = ("ba", "ko", "ri", "tu", "me", "sa", "lo", "fi", "da", "ne", "pu", "gi", "vo", "ze", "ha", "mi")
    return "".join(rng.choice(syllables) for _ in range(3))


def _word_list(tok: Tokens, rng: random.Random, common: list[str], budget: int) -> tuple[list[int], list[str], int]:
    """A numbered word list of at most ``budget`` tokens where the five ``common`` words take
    :data:`COMMON_SHARES` of the items and every other word appears once or twice. Returns (ids, the
    common words from the most frequent on, items)."""
    n = max(40, budget // 5)
    rare_pool = [w for w in WORDS if w not in common]
    while len(rare_pool) < n:
        w = _pseudo_word(rng)
        if w not in rare_pool and w not in common:
            rare_pool.append(w)
    items: list[str] = []
    for w, share in zip(common, COMMON_SHARES):
        items += [w] * max(2, round(share * n))
    rare = list(rare_pool)
    rng.shuffle(rare)
    j = 0
    while len(items) < n:
        items.append(rare[j % len(rare)])
        j += 1
    rng.shuffle(items)
    ids: list[int] = []
    kept = 0
    for k, w in enumerate(items, 1):
        piece = tok(f" {k}. {w}")
        if len(ids) + len(piece) > budget:
            break
        ids += piece
        kept = k
    counts = {w: items[:kept].count(w) for w in common}
    order = sorted(common, key=lambda w: (-counts[w], items.index(w)))
    return ids, order, kept


def _qa_sample(tokenizer, tok, rng, head, instruction, question_ids, task, length, seed, index) -> "TaskSample":
    """The ``qa`` task (module docstring): the words right after a quoted phrase of the context."""
    room = length - len(head) - len(instruction)
    runs = _filler(tok, _essay_source(), room, rng, essay=True)
    full = [t for r in runs for t in r][:room]
    bound = room - 80  # the question takes fewer than 80 tokens: the phrase stays inside the body
    starts = []
    pos = 0
    for r in runs:
        if pos + 11 <= bound and len(r) >= 12:
            starts.append(pos)
        pos += len(r)
    rng.shuffle(starts)
    chosen = None
    for s in starts:
        phrase_ids = full[s:s + 6]
        if sum(1 for p in range(len(full) - 5) if full[p:p + 6] == phrase_ids) == 1:
            chosen = s
            break
    if chosen is None:
        raise UsageError(f"qa: no phrase that occurs once in a {length}-token context; use a longer --lengths")
    phrase = tokenizer.decode(full[chosen:chosen + 6]).strip()
    following = full[chosen + 6:chosen + 11]
    question = question_ids("Complete this quote from the text above with the words that follow it.", f'"{phrase}')
    body = full[: length - len(head) - len(instruction) - len(question)]
    meta = {"depth": round(chosen / max(len(body), 1), 4), "phrase": phrase}
    return TaskSample(task, length, seed, index, head + instruction + body, question, list(following), [_content(tokenizer, i) for i in following],
                      [tokenizer.decode(following)], meta)


def listed(answers: list[str]) -> list[tuple[str, bool]]:
    """Answer pieces ``(text, checked)`` of a list answer, in the bulleted form the embedded model
    writes after ``...:`` (a blank line, then ``* value`` lines); the bullets are given, the values
    checked."""
    pieces: list[tuple[str, bool]] = []
    for j, a in enumerate(answers):
        pieces += [("\n\n* " if j == 0 else "\n* ", False), (a, True)]
    return pieces


def _content(tokenizer: Any, token: int) -> bool:
    """A token that carries part of a value (a letter or digit), not only spacing or punctuation."""
    return any(ch.isalnum() for ch in tokenizer.decode([token]))


def generate_sample(tokenizer: Any, task: str, length: int, seed: int = 0, index: int = 0, tok: Tokens | None = None) -> TaskSample:
    """One sample of ``task`` whose prompt (context + question) is ``length`` tokens (see the module
    docstring). The same arguments give the same sample."""
    if task not in TASKS:
        raise UsageError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    tok = tok or Tokens(tokenizer)
    rng = sample_rng(task, length, seed, index)
    before, after = chat_frame(tokenizer)
    head = tok(before)
    meta: dict[str, Any] = {}
    family = "niah" if task.startswith("niah") else task
    instruction = tok(INSTRUCTIONS[family])

    if task.startswith("niah"):
        n_needles = 1 if task in ("niah_single", "niah_essay") else 4
        keys = _keys(rng, n_needles)
        if task == "niah_multivalue":
            keys = [keys[0]] * 4
        numbers = [_number(rng) for _ in range(n_needles)]
        depths = [rng.random() for _ in range(n_needles)]
        needles = [tok(f" One of the special magic numbers for {k} is: {v}.") for k, v in zip(keys, numbers)]
        appear = sorted(range(n_needles), key=lambda j: depths[j])
        ask = list(range(n_needles))  # the needles the answer needs (niah_multivalue: all)
        if task in ("niah_single", "niah_essay", "niah_multikey", "niah_multikey_essay"):
            ask = [rng.randrange(n_needles)]
            q, prefix = NIAH_ASK[0].format(key=keys[ask[0]]), NIAH_ASK[1].format(key=keys[ask[0]])
            answers = [numbers[ask[0]]]
        elif task == "niah_multivalue":
            q = f"What are all the special magic numbers for {keys[0]} mentioned in the provided text?"
            prefix = f"The special magic numbers for {keys[0]} mentioned in the provided text are:"
            answers = [numbers[j] for j in appear]
        else:
            ask = rng.sample(range(n_needles), 2)
            q = f"What are the special magic numbers for {keys[ask[0]]} and {keys[ask[1]]} mentioned in the provided text?"
            prefix = f"The special magic numbers for {keys[ask[0]]} and {keys[ask[1]]} mentioned in the provided text are:"
            answers = [numbers[j] for j in ask]
        essay = task in ("niah_essay", "niah_multikey_essay")
        source = _essay_source() if essay else NOISE
        inserts = list(zip(depths, needles))
        meta["keys"] = keys
        meta["numbers"] = numbers
        meta["asked"] = ask  # the needles the answer needs (indices into keys / numbers)
    elif task == "vt":
        used: set[str] = set()
        names = [_varname(rng, used) for _ in range(4)]
        value = str(rng.randint(10000, 99999))
        lines = [f" VAR {names[0]} = {value}."] + [f" VAR {names[j]} = {names[j - 1]}." for j in range(1, 4)]
        depths = sorted(rng.random() for _ in range(4))
        inserts = [(d, tok(line)) for d, line in zip(depths, lines)]
        q = f"Find all variables that are assigned the value {value} in the text above."
        prefix = f"Answer: According to the chain(s) of variable assignment in the text above, 4 variables are assigned the value {value}, they are:"
        answers = names
        source = NOISE
    elif task == "cwe":
        common = rng.sample(WORDS, 5)
        q = "What are the 5 words that appear most often in the above list? List them from the most frequent on."
        prefix = "Answer: The top 5 words that appear most often in the list are:"
    elif task == "qa":
        q = prefix = ""
    else:  # pragma: no cover - TASKS is exhaustive
        raise UsageError(task)

    def question_ids(q_text: str, prefix_text: str) -> list[int]:
        return tok("\n\n" + q_text) + tok(after) + tok(prefix_text)

    if task == "cwe":
        question = question_ids(q, prefix)
        budget = length - len(question) - len(head) - len(instruction)
        context_body, answers, n_items = _word_list(tok, rng, common, budget)
        meta["list_words"] = n_items
        context = head + instruction + context_body
        answer_text = listed(answers)
    elif task == "qa":
        return _qa_sample(tokenizer, tok, rng, head, instruction, question_ids, task, length, seed, index)
    else:
        question = question_ids(q, prefix)
        budget = length - len(question) - len(head) - len(instruction)
        runs = _filler(tok, source, budget, rng, essay=task in ("niah_essay", "niah_multikey_essay"))
        body, used_depths = _assemble(runs, inserts, budget)
        meta["depths"] = [round(d, 4) for d in used_depths]
        context = head + instruction + body
        answer_text = [(" ", False), (answers[0], True)] if len(answers) == 1 else listed(answers)
    answer_ids: list[int] = []
    scored: list[bool] = []
    for piece, checked in answer_text:
        ids = tok(piece)
        answer_ids += ids
        scored += [checked and _content(tokenizer, i) for i in ids]
    return TaskSample(task, length, seed, index, context, question, answer_ids, scored, list(answers), meta)


def each_needle(tokenizer: Any, sample: TaskSample, questions: int, tok: Tokens | None = None) -> list[TaskSample]:
    """``questions`` samples sharing ``sample``'s context (a ``niah_multikey`` or
    ``niah_multikey_essay`` sample), each asking about a different needle: the sample itself first,
    then the other needles in key order. Each carries ``meta["question"]`` (1, 2, ...)."""
    if sample.task not in MULTI_QUESTION_TASKS:
        raise UsageError(f"--questions asks about several needles of one context: tasks {', '.join(MULTI_QUESTION_TASKS)}, not {sample.task}")
    keys, numbers = sample.meta["keys"], sample.meta["numbers"]
    if not 1 <= questions <= len(keys):
        raise UsageError(f"--questions must be 1 to {len(keys)} (the needles of {sample.task}), got {questions}")
    tok = tok or Tokens(tokenizer)
    _, after = chat_frame(tokenizer)
    first = sample.meta["asked"][0]
    out = [TaskSample(**{**sample.__dict__, "meta": {**sample.meta, "question": 1}})]
    for j in [j for j in range(len(keys)) if j != first][:questions - 1]:
        q, prefix = NIAH_ASK[0].format(key=keys[j]), NIAH_ASK[1].format(key=keys[j])
        question = tok("\n\n" + q) + tok(after) + tok(prefix)
        answer = tok(" ") + tok(numbers[j])
        scored = [False] * len(tok(" ")) + [_content(tokenizer, i) for i in tok(numbers[j])]
        out.append(TaskSample(sample.task, sample.length, sample.seed, sample.index, sample.context, question, answer, scored,
                              [numbers[j]], {**sample.meta, "asked": [j], "question": len(out) + 1}))
    return out


def generate(tokenizer: Any, tasks: list[str], lengths: list[int], samples: int, seed: int = 0, start: int = 0) -> list[TaskSample]:
    """``samples`` samples of every task at every length (indices ``start .. start + samples - 1``)."""
    tok = Tokens(tokenizer)
    return [generate_sample(tokenizer, t, n, seed, start + i, tok) for t in tasks for n in lengths for i in range(samples)]


def parse_tasks(text: str | list[str] | None) -> list[str]:
    """``"niah_single,vt"`` or ``all`` -> task names (UsageError naming an unknown one)."""
    if text is None:
        return list(TASKS)
    items = text if isinstance(text, list) else [text]
    names = [n.strip() for item in items for n in item.split(",") if n.strip()]
    if not names or names == ["all"]:
        return list(TASKS)
    for n in names:
        if n not in TASKS:
            raise UsageError(f"unknown task {n!r}; tasks: {', '.join(TASKS)} (or all)")
    return list(dict.fromkeys(names))


def parse_lengths(text: str | list[str] | None, max_tokens: int | None = None) -> list[int]:
    """``"1k,2k,4096"`` -> [1024, 2048, 4096] (k = 1024)."""
    items = text if isinstance(text, list) else [text or "1k"]
    out = []
    for item in items:
        for part in item.split(","):
            p = part.strip().lower()
            if not p:
                continue
            try:
                number = float(p[:-1]) * 1024 if p.endswith("k") else float(p)
            except ValueError:
                raise UsageError(f"--lengths must be token counts like 1k,2k or 4096, got {part[:40]!r}") from None
            if not math.isfinite(number):
                raise UsageError(f"--lengths must be token counts like 1k,2k or 4096, got {part[:40]!r}")
            if number > MAX_TOKENS:
                raise UsageError(f"--lengths {part[:40]}: at most {MAX_TOKENS} tokens")
            n = int(number)
            if n < 128:
                raise UsageError(f"--lengths {part}: a task needs at least 128 tokens")
            if max_tokens is not None and n > max_tokens:
                raise UsageError(f"--lengths {part}: the model reads at most {max_tokens} tokens")
            out.append(n)
    return list(dict.fromkeys(out))
