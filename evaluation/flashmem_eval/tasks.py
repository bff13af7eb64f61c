"""Task families past the single needle (issue 31): prompts that need several pieces at once,
a chain of pieces, or the whole text.

Each family builds a prompt of about `length` tokens in a real haystack (`kjv` or
`stdlib-doc`, :func:`flashmem.texts.haystack`) and lists the *items* its answer
must contain; a generated output is scored per item (`score_output`), so a method's
result can be compared with the full cache's item by item:

* ``keyed``: several keyed numbers; distractor keys share a word with the one asked;
* ``multivalue``: several numbers for one key (and a distractor key), all asked for;
* ``multiquery``: several keys, several of them asked in one question;
* ``vartrack``: a chain of assignments (RULER's variable tracking) and a distractor
  chain; the answer names every variable of the chain that holds the value;
* ``aggregation``: notes scattered over the whole text, a few goods noted far more
  often than the rest; the answer names the most frequent ones;
* ``passage``: a short passage about a person (and one about another person); a
  question answered in free text, scored against the passage's facts.

Wordings: every family has DEV_WORDINGS (0-2, the ones looked at while sizing the
families for SmolLM2) and one held-out wording (3), kept apart (`--wordings heldout`).
The random draws depend on (family, length, seed, haystack), not on the wording, so
a held-out wording asks about the same facts in other words.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from flashmem.errors import FlashMemError
from flashmem.texts import haystack, insert_needles

FAMILIES = ("keyed", "multivalue", "multiquery", "vartrack", "aggregation", "passage")
HAYSTACKS = ("kjv", "stdlib-doc")
DEV_WORDINGS = (0, 1, 2)
HELDOUT_WORDINGS = (3,)
WORDING_SETS = {"dev": DEV_WORDINGS, "heldout": HELDOUT_WORDINGS, "all": DEV_WORDINGS + HELDOUT_WORDINGS}
# generated tokens per family: lists of numbers/names need room, a single number does not
MAX_NEW = {"keyed": 12, "multivalue": 40, "multiquery": 40, "vartrack": 40, "aggregation": 24, "passage": 40}

PREAMBLE = (
    "Some important pieces of information are hidden inside a lot of irrelevant text. "
    "Find them and memorize them. I will quiz you about them.\n\n"
)

_COLORS = ["red", "blue", "green", "golden", "silver", "black", "white", "amber"]
_NOUNS = ["falcon", "harbor", "lantern", "meadow", "orchid", "quartz", "saddle", "walnut", "candle", "river"]
_GOODS = ["apples", "barley", "copper", "lemons", "onions", "pepper", "salt", "timber", "wool", "honey", "rice", "tea"]
_NAMES = ["Maria", "Ingrid", "Aditi", "Yuki", "Elena", "Fatima", "Greta", "Leila"]
_CITIES = ["Lisbon", "Oslo", "Nairobi", "Montreal", "Krakow", "Osaka", "Valparaiso", "Tbilisi", "Dublin", "Hanoi"]
_JOBS = ["pharmacist", "carpenter", "astronomer", "violinist", "geologist", "translator", "baker", "surveyor"]
_PETS = ["parrot", "tortoise", "ferret", "goat", "rabbit", "peacock", "donkey", "hedgehog"]
_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"


@dataclass
class TaskProbe:
    family: str
    context: str
    question: str
    items: list[str]  # what a right answer contains
    wording: int
    max_new: int
    # scoring: "first" (the output's first number is items[0]), "numbers" / "names" (the
    # output's first len(items) distinct numbers / upper-case names), "words" (each item
    # as a whole word, any case)
    scoring: str
    vocab: list[str] = field(default_factory=list)  # "words" scoring with a candidate list
    # the needle sentences the answer needs (the diagnosis looks up where they were selected)
    pieces: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- wordings
# (needle template, question template, answer prefix); {k} key, {v} value
_KEYED = [
    ("The special magic number for {k} is: {v}.", "What is the special magic number for {k}?",
     "The special magic number for {k} is"),
    ("Remember: the access code of the {k} account is {v}.", "What is the access code of the {k} account?",
     "The access code of the {k} account is"),
    ("Record entry: the {k} was assigned the number {v}.", "Which number was the {k} assigned?",
     "The {k} was assigned the number"),
    ("In the ledger, the line for the {k} reads {v}.", "What does the ledger line for the {k} read?",
     "The ledger line for the {k} reads"),
]  # fmt: skip
_MULTIVALUE = [
    ("One of the special magic numbers for {k} is: {v}.", "What are all the special magic numbers for {k}?",
     "The special magic numbers for {k} are:"),
    ("A code that opens the {k} door is {v}.", "List every code that opens the {k} door.",
     "The codes that open the {k} door are:"),
    ("The {k} station reported the reading {v}.", "Which readings did the {k} station report?",
     "The {k} station reported the readings"),
    ("Among the tickets held by the {k} team is number {v}.", "Which ticket numbers does the {k} team hold?",
     "The {k} team holds the tickets"),
]  # fmt: skip
_MULTIQUERY = [
    ("The special magic number for {k} is: {v}.", "What are the special magic numbers for {ks}?",
     "The special magic numbers for {ks} are:"),
    ("The locker of the {k} club has the code {v}.", "What are the locker codes of the {ks} clubs?",
     "The locker codes of the {ks} clubs are:"),
    ("Shipment {v} belongs to the {k} warehouse.", "Which shipments belong to the {ks} warehouses?",
     "The shipments of the {ks} warehouses are, in order:"),
    ("The {k} office can be reached at extension {v}.", "What are the extensions of the {ks} offices?",
     "The extensions of the {ks} offices are:"),
]  # fmt: skip
# (first assignment "{a} = {v}", a copy "{a} = {b}", question, answer prefix with {n} and {v})
_VARTRACK = [
    ("VAR {a} = {v}", "VAR {a} = VAR {b}", "Find all variables that are assigned the value {v} in the text above.",
     "According to the chain of variable assignments in the text above, {n} variables are assigned the value {v}, "
     "they are:"),
    ("let {a} = {v};", "let {a} = {b};", "Which variables end up holding the value {v}?",
     "Following the assignments, the {n} variables holding {v} are:"),
    ("Set {a} to {v}.", "Set {a} to the value of {b}.", "Name every variable whose value is {v}.",
     "The {n} variables whose value is {v} are:"),
    ("Register {a} is loaded with {v}.", "Register {a} is loaded from register {b}.",
     "Which registers contain {v} in the end?", "The {n} registers that contain {v} are:"),
]  # fmt: skip
_AGGREGATION = [
    ("Inventory note: a crate of {g} was delivered.", "Which three goods were delivered most often according to the "
     "inventory notes?", "The three goods delivered most often are"),
    ("Market log: today the merchant sold {g}.", "Which three goods did the merchant sell most often, according to "
     "the market logs?", "The three goods sold most often are"),
    ("Customs record: a ship unloaded {g}.", "Which three goods were unloaded most often in the customs records?",
     "The three goods unloaded most often are"),
    ("Warehouse tally: one more sack of {g} came in.", "According to the warehouse tallies, which three goods came "
     "in most often?", "The three goods that came in most often are"),
]  # fmt: skip
# (passage, question, answer prefix); {n} name, {c} city, {j} job, {p} pet, {y} year
_PASSAGE = [
    ("{n} was born in {c} in {y}. She trained as a {j}, and for many years she kept a {p} at home.",
     "Where was {n} born, what did she train as, and what animal did she keep?", "{n} was born in"),
    ("The biography of {n}: she grew up in {c}, worked all her life as a {j}, and was never seen without her {p}.",
     "According to her biography, where did {n} grow up, what was her work, and what animal was she seen with?",
     "{n} grew up in"),
    ("A letter from {n}, {y}: I have settled in {c}, where I work as a {j}. My only company is a {p}.",
     "In her letter, where has {n} settled, what is her work, and what is her only company?",
     "{n} has settled in"),
    ("Census record for {n}: residence {c}; occupation {j}; animals kept: one {p}; registered {y}.",
     "What does the census record for {n} give as her residence, her occupation and the animal she keeps?",
     "The census record gives {n}'s residence as"),
]  # fmt: skip


def wordings(which: str) -> tuple[int, ...]:
    if which in WORDING_SETS:
        return WORDING_SETS[which]
    raise FlashMemError(f"--wordings: {which!r} is not known; allowed: {', '.join(WORDING_SETS)}")


# ----------------------------------------------------------------------------- draws
def _num(rng: random.Random, used: set[str]) -> str:
    while True:
        v = str(rng.randint(100000, 999999))
        if v not in used:
            used.add(v)
            return v


def _var(rng: random.Random, used: set[str]) -> str:
    while True:
        v = "".join(rng.choice(_LETTERS) for _ in range(5))
        if v not in used:
            used.add(v)
            return v


def _depths(rng: random.Random, n: int) -> list[float]:
    """`n` depths spread over the text (one per equal slice, jittered), in order."""
    return [(i + rng.uniform(0.1, 0.9)) / n for i in range(n)]


def _keyed_names(rng: random.Random, n: int) -> list[str]:
    """n two-word keys; the first is asked, the next two share its colour / its noun."""
    c0, n0 = rng.choice(_COLORS), rng.choice(_NOUNS)
    keys = [f"{c0} {n0}"]
    other_c = rng.sample([c for c in _COLORS if c != c0], n)
    other_n = rng.sample([x for x in _NOUNS if x != n0], n)
    keys += [f"{c0} {other_n[0]}", f"{other_c[0]} {n0}"]
    keys += [f"{other_c[i]} {other_n[i]}" for i in range(1, n - 2)]
    return keys[:n]


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _family(rng: random.Random, family: str, w: int) -> tuple[list[tuple[str, float]], str, str, list[str], dict]:
    """(needles with depths, question, answer prefix, items, extra TaskProbe fields)."""
    used: set[str] = set()
    if family == "keyed":
        nt, qt, at = _KEYED[w]
        keys = _keyed_names(rng, 5)
        vals = [_num(rng, used) for _ in keys]
        order = list(range(len(keys)))
        rng.shuffle(order)  # the asked key is not always first
        needles = [(nt.format(k=keys[i], v=vals[i]), d) for i, d in zip(order, _depths(rng, len(keys)))]
        extra = {"scoring": "first", "pieces": [nt.format(k=keys[0], v=vals[0])]}
        return needles, qt.format(k=keys[0]), at.format(k=keys[0]), [vals[0]], extra
    if family == "multivalue":
        nt, qt, at = _MULTIVALUE[w]
        key, other = (f"{c} {n}" for c, n in zip(rng.sample(_COLORS, 2), rng.sample(_NOUNS, 2)))
        vals = [_num(rng, used) for _ in range(3)]
        pieces = [(key, v) for v in vals] + [(other, _num(rng, used))]
        rng.shuffle(pieces)
        needles = [(nt.format(k=k, v=v), d) for (k, v), d in zip(pieces, _depths(rng, len(pieces)))]
        # items in the order they appear: the natural order of a listing answer
        items = [v for k, v in pieces if k == key]
        extra = {"scoring": "numbers", "pieces": [nt.format(k=key, v=v) for v in items]}
        return needles, qt.format(k=key), at.format(k=key), items, extra
    if family == "multiquery":
        nt, qt, at = _MULTIQUERY[w]
        keys = [f"{c} {n}" for c, n in zip(rng.sample(_COLORS, 4), rng.sample(_NOUNS, 4))]
        vals = [_num(rng, used) for _ in keys]
        order = list(range(len(keys)))
        rng.shuffle(order)
        needles = [(nt.format(k=keys[i], v=vals[i]), d) for i, d in zip(order, _depths(rng, len(keys)))]
        asked = [0, 1, 2]
        ks = _join([keys[i] for i in asked])
        extra = {"scoring": "numbers", "pieces": [nt.format(k=keys[i], v=vals[i]) for i in asked]}
        return needles, qt.format(ks=ks), at.format(ks=ks), [vals[i] for i in asked], extra
    if family == "vartrack":
        first, copy, qt, at = _VARTRACK[w]
        hops = 4  # variables in the chain: 3 copies after the first assignment
        chain = [_var(rng, used) for _ in range(hops)]
        decoy = [_var(rng, used) for _ in range(hops)]
        v, dv = _num(rng, used), _num(rng, used)
        lines: list[str] = []
        # the two chains interleaved, each in order (a copy comes after what it copies)
        for i in range(hops):
            for names, value in ((chain, v), (decoy, dv)):
                lines.append(first.format(a=names[0], v=value) if i == 0 else copy.format(a=names[i], b=names[i - 1]))
        needles = list(zip(lines, _depths(rng, len(lines))))
        extra = {"scoring": "names", "pieces": lines[0::2]}  # the asked chain's lines (the decoy's interleave)
        return needles, qt.format(v=v), at.format(n=hops, v=v), chain, extra
    if family == "aggregation":
        nt, qt, at = _AGGREGATION[w]
        goods = rng.sample(_GOODS, 8)
        top, rest = goods[:3], goods[3:]
        notes = [g for g in top for _ in range(6)] + [g for g in rest for _ in range(rng.randint(1, 2))]
        rng.shuffle(notes)
        needles = [(nt.format(g=g), d) for g, d in zip(notes, _depths(rng, len(notes)))]
        return needles, qt, at, top, {"scoring": "words", "vocab": goods, "pieces": [n for n, _ in needles]}
    if family == "passage":
        pt, qt, at = _PASSAGE[w]
        names = rng.sample(_NAMES, 2)
        cities, jobs, pets = rng.sample(_CITIES, 2), rng.sample(_JOBS, 2), rng.sample(_PETS, 2)
        years = [str(rng.randint(1901, 1989)) for _ in range(2)]
        texts = [pt.format(n=names[i], c=cities[i], j=jobs[i], p=pets[i], y=years[i]) for i in range(2)]
        ds = _depths(rng, 2)
        if rng.random() < 0.5:
            ds.reverse()  # the asked passage first or second
        needles = list(zip(texts, ds))
        n0 = names[0]
        extra = {"scoring": "words", "pieces": [texts[0]]}
        return needles, qt.format(n=n0), at.format(n=n0), [cities[0], jobs[0], pets[0]], extra
    raise FlashMemError(f"--families: {family!r} is not known; allowed: {', '.join(FAMILIES)}")


def make_task(tok: Any, family: str, length: int, seed: int, hay: str = "kjv", wording: int = 0) -> TaskProbe:
    """A `family` prompt of about `length` tokens (context + question) in the haystack `hay`."""
    if family not in FAMILIES:
        raise FlashMemError(f"--families: {family!r} is not known; allowed: {', '.join(FAMILIES)}")
    if hay not in HAYSTACKS:
        raise FlashMemError(f"--haystacks: {hay!r} is not known; allowed: {', '.join(HAYSTACKS)}")
    if wording not in WORDING_SETS["all"]:
        raise FlashMemError(f"wording: {wording!r} is not known; allowed: 0-{len(_KEYED) - 1}")
    rng = random.Random(f"tasks|{family}|{length}|{seed}|{hay}")
    needles, q, prefix, items, extra = _family(rng, family, wording)
    question = f"\n\nQuestion: {q}\nAnswer: {prefix}"
    overhead = len(tok(PREAMBLE + question, add_special_tokens=True)["input_ids"])
    overhead += sum(len(tok(" " + n, add_special_tokens=False)["input_ids"]) + 2 for n, _ in needles)
    text = "default" if hay == "kjv" else hay
    hay_text = haystack(tok, max(16, length - overhead - 4), seed=rng.randrange(10**6), name=text)
    context = PREAMBLE + insert_needles(hay_text, needles, own_paragraph=True)
    return TaskProbe(family, context, question, items, wording, MAX_NEW[family], **extra)


# ----------------------------------------------------------------------------- scoring
def answer_part(text: str) -> str:
    """The answer proper: the output up to its first blank line or a new question (blank
    lines before it skipped: "they are:" is often followed by a line break)."""
    return re.split(r"\n\s*\n|\nQuestion", text.lstrip(), maxsplit=1)[0]


def score_output(text: str, probe: TaskProbe) -> tuple[float, list[bool]]:
    """(share of the items found, per item found or not).

    Lists count only the output's first len(items) distinct candidates (numbers,
    5-letter upper-case names, or the family's goods), so naming every candidate in
    the text does not score; free-text facts count as whole words, any case."""
    ans = answer_part(text)
    items = probe.items
    if probe.scoring == "first":
        nums = re.findall(r"\d+", ans)
        hits = [bool(nums) and nums[0] == items[0]]
    elif probe.scoring in ("numbers", "names"):
        pat = r"\d+" if probe.scoring == "numbers" else r"(?<![A-Za-z])[A-Z]{5}(?![A-Za-z])"
        found = list(dict.fromkeys(re.findall(pat, ans)))[: len(items)]
        hits = [it in found for it in items]
    elif probe.scoring == "words":
        low = ans.lower()
        if probe.vocab:
            spots = sorted(
                (m.start(), g) for g in probe.vocab for m in re.finditer(rf"(?<!\w){re.escape(g)}(?!\w)", low)
            )
            found = list(dict.fromkeys(g for _, g in spots))[: len(items)]
            hits = [it in found for it in items]
        else:
            hits = [re.search(rf"(?<!\w){re.escape(it.lower())}(?!\w)", low) is not None for it in items]
    else:
        raise FlashMemError(f"scoring: {probe.scoring!r} is not known; allowed: first, numbers, names, words")
    return sum(hits) / len(hits), hits


def found_from(tok: Any, gen: list[int], probe: TaskProbe) -> list[int | None]:
    """Per item: the index of the answer's token (ids `gen`) from which the item stays found
    (`score_output` of the text up to each token); None for an item the whole answer misses."""
    hits = [score_output(tok.decode(gen[: t + 1], skip_special_tokens=True), probe)[1] for t in range(len(gen))]
    out: list[int | None] = []
    for i in range(len(probe.items)):
        if not hits or not hits[-1][i]:
            out.append(None)
            continue
        t = len(hits) - 1
        while t > 0 and hits[t - 1][i]:
            t -= 1
        out.append(t)
    return out


def item_gaps(tok: Any, gen: list[int], gaps: list[float], probe: TaskProbe) -> list[float | None]:
    """Per item: how firmly a greedy answer (token ids `gen`, each with its decision margin in
    `gaps`: top-1 minus runner-up logit, `harness.greedy`) found it. The smallest margin among
    the tokens up to the one from which the item stays found, in nats; None for an item not
    found. An item found behind a margin of 0.05 nats, where the runner-up token was 95% as
    likely, is a coin flip: any small change to the attention (int8 coding of the cache, say)
    may turn the answer elsewhere."""
    return [None if t is None else round(min(gaps[: t + 1]), 3) for t in found_from(tok, gen, probe)]


def item_spans(tok: Any, gen: list[int], probe: TaskProbe) -> list[tuple[int, int] | None]:
    """Per item the answer (ids `gen`) finds: the tokens [s, t] (inclusive) that write it: t the
    one from which it stays found (`found_from`), s the last from which the text of tokens s..t
    still holds the item (any case). None for an item not found."""
    spans: list[tuple[int, int] | None] = []
    for it, t in zip(probe.items, found_from(tok, gen, probe)):
        if t is None:
            spans.append(None)
            continue
        s = t
        while s > 0 and it.lower() not in tok.decode(gen[s : t + 1], skip_special_tokens=True).lower():
            s -= 1
        spans.append((s, t))
    return spans


def forced_items(
    tok: Any, gen: list[int], tops: list[int], margins: list[float], probe: TaskProbe
) -> tuple[list[bool | None], list[float | None]]:
    """Whether another cache writes each item of the full cache's answer `gen` when fed that
    answer (teacher forcing: `harness.forced` gives, per token, its own top-1 `tops` and the
    full answer's token's margin over its best other token, `margins`): per item the full cache
    found, True if its top-1 is the full cache's token at every token of the item's span
    (`item_spans`), and the smallest margin there (negative: it would write another token);
    None for items the full cache did not find. Unlike a greedy answer scored on its own, an
    earlier token written otherwise (a word of the phrasing, a near tie) does not carry the
    answer elsewhere: this asks whether the cache retrieves the item, given the same words."""
    hits: list[bool | None] = []
    low: list[float | None] = []
    for span in item_spans(tok, gen, probe):
        if span is None:
            hits.append(None)
            low.append(None)
            continue
        s, t = span
        hits.append(all(tops[j] == gen[j] for j in range(s, t + 1)))
        low.append(round(min(margins[s : t + 1]), 3))
    return hits, low
