"""Megatron's pipeline layouts: what every virtual pipeline stage holds.

A layout is the list of virtual stages in order ``v = c * PP + r`` (chunk c of pipeline rank
r), each holding, in this order: the embedding (``E``, stage 0 only), a run of consecutive
transformer layers (``t``), the MTP blocks (``m``, all in one stage) and the final norm + output
head + loss (``L``, last stage only). Every split moeplug runs is one: an even split, uneven
first / last stages, Megatron's ``account_for_embedding/loss_in_pipeline_split`` and a layout
string (``--pipeline-model-parallel-layout``) all become a :class:`PipelineLayout`, which the
model split (moeplug.parallelize.pipeline), the checkpoints' manifests and the planner read.

The string grammar is Megatron-Core's ``PipelineParallelLayerLayout.parse_str_to_list``
(megatron/core/transformer/pipeline_parallel_layer_layout.py), reproduced step by step so that
every string it accepts parses to the same stages (tests/test_pipeline_layout.py compares the
two on fixed and generated strings): commas are dropped; each ``(...)*N`` (no ``)`` inside) is
replaced by N copies of its body, left to right; then each ``X*N`` by N copies of the single
character X (a letter or ``|``); then ``|`` splits the stages. E.g. DeepSeek-V3 on 1,024 H100
(PP8 x VPP4): ``Et*3|(tt|)*29m|L`` = ``Ettt``, 29 x ``tt``, ``m``, ``L``. Unlike Megatron, the
errors name the column of the original string and the fix, and each character's column is kept
through the expansion for that.

Placement rules (Megatron's ``validate_layer_layout``; where Megatron checks only the flattened
order, the embedding and the loss must also sit in the first and last virtual stage, which is
where Megatron builds them): one ``E``, first; one ``L``, last; as many ``t`` as the model's
layers and ``m`` as its MTP blocks; no ``t`` after an ``m``; the ``m`` in one stage, the last
chunk of its pipeline rank. This module imports nothing of moeplug but the error type.
"""

from __future__ import annotations

from dataclasses import dataclass

LETTERS = {"E": "embedding", "t": "transformer layer", "m": "MTP block", "L": "loss"}
_DIGITS = "0123456789"
_GRAMMAR = ("E embedding, t transformer layer, m MTP block, L loss, | stage boundary, X*N and "
            "(...)*N repeats")


class LayoutError(ValueError):
    """A layout that cannot be run: ``rule`` (what is wrong, naming the column) and ``fix``;
    the config section turns it into its one-line ConfigError naming the field."""

    def __init__(self, rule: str, fix: str) -> None:
        super().__init__(f"{rule}. Fix: {fix}")
        self.rule, self.fix = rule, fix


# ---------------------------------------------------------------- the string grammar

# More letters than any model has layers: a count beyond it is a typo (and Megatron's parser
# would try to build the string).
MAX_LETTERS = 100_000


def _count(digits: list[tuple[str, int]], size: int, have: int) -> int:
    """The repeat count of ``digits`` (characters with their columns), refused when ``size``
    characters repeated that often after ``have`` would exceed MAX_LETTERS."""
    n = int("".join(c for c, _ in digits))
    if have + n * size > MAX_LETTERS:
        raise LayoutError(f"column {digits[0][1]}: the count {n} repeats to more than "
                          f"{MAX_LETTERS:,} letters", "write the count the model's layers need")
    return n


def _repeat_groups(chars: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Megatron's first substitution, ``re.sub(r'\\(([^)]+)\\)\\*(\\d+)', body * N)``, on
    (character, column) pairs: at each position, '(' + at least one non-')' character + ')' +
    '*' + digits is replaced by the body N times; elsewhere the character is kept."""
    out, i, n = [], 0, len(chars)
    while i < n:
        if chars[i][0] == "(":
            j = i + 1
            while j < n and chars[j][0] != ")":
                j += 1
            k = j + 2
            while k < n and chars[k][0] in _DIGITS:
                k += 1
            if j > i + 1 and j + 2 < k and chars[j + 1][0] == "*":
                out += chars[i + 1:j] * _count(chars[j + 2:k], j - i - 1, len(out))
                i = k
                continue
        out.append(chars[i])
        i += 1
    return out


def _repeat_chars(chars: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Megatron's second substitution, ``re.sub(r'(.)\\*(\\d+)', x * N)``: any character
    followed by '*' and digits becomes N copies of itself."""
    out, i, n = [], 0, len(chars)
    while i < n:
        k = i + 2
        while k < n and chars[k][0] in _DIGITS:
            k += 1
        if i + 1 < n and chars[i + 1][0] == "*" and k > i + 2 and chars[i][0] != "\n":
            out += [chars[i]] * _count(chars[i + 2:k], 1, len(out))
            i = k
            continue
        out.append(chars[i])
        i += 1
    return out


def _leftover(char: str) -> str:
    """Why a character left after the expansion is not a layer, and how to write it."""
    if char in "()":
        return ("a parenthesised group must be closed and followed by *N, with no group inside "
                "it", "write e.g. (tt|)*4")
    if char == "*":
        return ("'*' must follow a letter, '|' or a (group) and be followed by a count",
                "write e.g. t*3")
    if char in _DIGITS:
        return "a count must follow '*'", "write e.g. t*3 instead of 3t"
    return (f"{char!r} is not a layer letter ({_GRAMMAR})",
            f"use only {', '.join(LETTERS)}, '|', '*', digits, parentheses and commas")


def parse_layout(text: str) -> list[list[tuple[str, int]]]:
    """The virtual stages of a layout string, each a list of (letter, column): Megatron's
    ``parse_str_to_list`` with every letter's 1-based column in ``text``; each stage after the
    first starts with ("|", column of its boundary). Raises LayoutError naming the column of
    the first character that is not a layer."""
    if not isinstance(text, str):
        raise LayoutError(f"must be a string, not {type(text).__name__}",
                          "quote it, e.g. 'Et|tt|tL'")
    chars = [(c, col) for col, c in enumerate(text, start=1) if c != ","]
    chars = _repeat_chars(_repeat_groups(chars))
    stages: list[list[tuple[str, int]]] = [[]]
    for c, col in chars:
        if c == "|":
            stages.append([("|", col)])
        elif c in LETTERS:
            stages[-1].append((c, col))
        else:
            rule, fix = _leftover(c)
            raise LayoutError(f"column {col} ({c!r}): {rule}", fix)
    return stages


# ---------------------------------------------------------------- the layout itself

@dataclass(frozen=True)
class VirtualStage:
    """What one virtual stage holds: the embedding, decoder layers ``layers`` (global indices),
    ``mtp`` MTP blocks (0, or all of them), the final norm + head + loss."""

    embedding: bool
    layers: range
    mtp: int
    loss: bool

    @property
    def letters(self) -> str:
        return ("E" if self.embedding else "") + "t" * len(self.layers) + "m" * self.mtp + \
            ("L" if self.loss else "")


@dataclass(frozen=True)
class PipelineLayout:
    """The virtual stages of one pipeline, ``stages[c * pp + r]`` = chunk c of rank r."""

    pp: int
    stages: tuple[VirtualStage, ...]

    @property
    def vpp(self) -> int:
        return len(self.stages) // self.pp

    def stage(self, rank: int, chunk: int) -> VirtualStage:
        return self.stages[chunk * self.pp + rank]

    def rank_stages(self, rank: int) -> list[VirtualStage]:
        """Rank ``rank``'s chunks, in chunk order."""
        return [self.stage(rank, c) for c in range(self.vpp)]

    def rank_layer_counts(self) -> list[int]:
        return [sum(len(s.layers) for s in self.rank_stages(r)) for r in range(self.pp)]

    def chunk_layers(self) -> list[list[range]]:
        """``[rank][chunk]`` -> that chunk's decoder layers."""
        return [[s.layers for s in self.rank_stages(r)] for r in range(self.pp)]

    @property
    def mtp_stage(self) -> int | None:
        """The virtual stage holding the MTP blocks (None without)."""
        return next((v for v, s in enumerate(self.stages) if s.mtp), None)

    def embedding_ranks(self, tied: bool) -> list[int]:
        """Pipeline ranks holding the embedding: the first stage's, the MTP stage's (MTP embeds
        the tokens ahead) and, when the head is the embedding (``tied``), the last stage's."""
        ranks = {0}
        if self.mtp_stage is not None:
            ranks.add(self.mtp_stage % self.pp)
        if tied:
            ranks.add((len(self.stages) - 1) % self.pp)
        return sorted(ranks)

    def text(self) -> str:
        """A Megatron layout string of these stages (runs of equal stages as ``(..|)*N``)."""
        def repeat(letter: str, n: int) -> str:
            return letter * n if n <= 3 else f"{letter}*{n}"

        def one(s: VirtualStage) -> str:
            return ("E" if s.embedding else "") + repeat("t", len(s.layers)) + \
                repeat("m", s.mtp) + ("L" if s.loss else "")
        parts, out, v = [one(s) for s in self.stages], [], 0
        while v < len(parts):
            run = 1
            while v + run < len(parts) - 1 and parts[v + run] == parts[v]:
                run += 1
            if run > 2 and parts[v]:  # "(tt|)*29": the group closes its own boundary
                out.append(f"({parts[v]}|)*{run}")
            else:
                out.append("|".join(parts[v:v + run]) + "|")
            v += run
        return "".join(out)[:-1]  # the last stage ends the string, no boundary after it


def from_letters(stages: list[list[tuple[str, int]]], pp: int, vpp: int | None = None, *,
                 num_layers: int | None = None, mtp_num_layers: int | None = None
                 ) -> PipelineLayout:
    """The layout of parsed stages (:func:`parse_layout`) over ``pp`` ranks, checked as
    Megatron checks it (see the module docstring). ``vpp``: the configured chunks per rank
    (None or 1: whatever the stage count gives). ``num_layers`` / ``mtp_num_layers``: the
    model's, when known (None: not checked). Raises LayoutError naming the column."""
    n = len(stages)
    starts = [s[0][1] if s[:1] and s[0][0] == "|" else 1 for s in stages]  # boundary columns
    stages = [[x for x in s if x[0] != "|"] for s in stages]
    flat = [x for s in stages for x in s]
    end = max((col for _, col in flat), default=0)

    def col(letter: str) -> list[int]:
        return [c for x, c in flat if x == letter]

    if n % pp or (vpp not in (None, 1) and n != pp * vpp):
        want = pp * vpp if vpp not in (None, 1) else f"a multiple of {pp}"
        where = f", the last from the '|' at column {starts[-1]}" if n > 1 else ""
        raise LayoutError(f"has {n} virtual stage{'s' * (n != 1)} ({n - 1} '|'{where}), but "
                          f"parallel.pp = {pp}" + (f" x parallel.vpp = {vpp}"
                                                   if vpp not in (None, 1) else "")
                          + f" needs {want}",
                          f"write {pp * vpp} stages separated by '|', or set parallel.vpp: 1 "
                          "(the layout then sets it)" if vpp not in (None, 1) else
                          f"write a multiple of {pp} stages separated by '|' (PP x VPP), or "
                          "change parallel.pp")
    if len(col("E")) != 1 or stages[0][:1] != [("E", col("E")[0])]:
        at = f"column {col('E')[1]}: a second 'E'" if len(col("E")) > 1 else \
            f"column {col('E')[0]}: 'E' is not the first letter of the first stage" \
            if col("E") else "has no 'E'"
        raise LayoutError(f"{at} (the embedding opens the first virtual stage, once)",
                          "start the layout with E, e.g. 'Et|tt|tL'")
    if len(col("L")) != 1 or stages[-1][-1:] != [("L", col("L")[0])]:
        at = f"column {col('L')[0]}: a second 'L'" if len(col("L")) > 1 else \
            f"column {col('L')[0]}: 'L' is not the last letter of the last stage" \
            if col("L") else "has no 'L'"
        raise LayoutError(f"{at} (the loss closes the last virtual stage, once)",
                          "end the layout with L, e.g. 'Et|tt|tL'")
    if num_layers is not None and len(col("t")) != num_layers:
        diff = num_layers - len(col("t"))
        raise LayoutError(f"has {len(col('t'))} transformer layers 't' but model.num_layers = "
                          f"{num_layers}", f"{'add' if diff > 0 else 'remove'} {abs(diff)} 't' "
                          f"(the string ends at column {end}), or change model.num_layers")
    mtp = col("m")
    if mtp_num_layers is not None and len(mtp) != mtp_num_layers:
        raise LayoutError(f"has {len(mtp)} MTP blocks 'm' but model.mtp_num_layers = "
                          f"{mtp_num_layers}", f"write {mtp_num_layers} 'm' before the 'L'"
                          if mtp_num_layers else "remove the 'm', or set model.mtp_num_layers")
    if mtp:
        late = [c for c in col("t") if c > mtp[0]]
        if late:
            raise LayoutError(f"column {late[0]}: a transformer layer 't' after the MTP block at "
                              f"column {mtp[0]} (MTP follows every decoder layer)",
                              "move the 'm' after the last 't'")
        where = [v for v, s in enumerate(stages) if any(x == "m" for x, _ in s)]
        if len(where) > 1:
            raise LayoutError(f"column {mtp[-1]}: the MTP blocks span virtual stages "
                              f"{where[0]} and {where[-1]} (they run as one block)",
                              "put every 'm' in one stage")
        if where[0] // pp != n // pp - 1:
            raise LayoutError(f"column {mtp[0]}: the MTP block sits in chunk {where[0] // pp} of "
                              f"pipeline rank {where[0] % pp}, not in that rank's last chunk "
                              f"({n // pp - 1}), as Megatron requires",
                              f"move the 'm' into one of the last {pp} stages")
    out, start = [], 0
    for s in stages:
        letters = [x for x, _ in s]
        k = letters.count("t")
        out.append(VirtualStage("E" in letters, range(start, start + k), letters.count("m"),
                                "L" in letters))
        start += k
    return PipelineLayout(pp, tuple(out))


def layout_of_string(text: str, pp: int, vpp: int | None = None, *,
                     num_layers: int | None = None, mtp_num_layers: int | None = None
                     ) -> PipelineLayout:
    """:func:`parse_layout` then :func:`from_letters`."""
    return from_letters(parse_layout(text), pp, vpp, num_layers=num_layers,
                        mtp_num_layers=mtp_num_layers)


def from_stage_sizes(sizes: list[int], pp: int, mtp_num_layers: int = 0) -> PipelineLayout:
    """The layout whose virtual stage v holds ``sizes[v]`` consecutive layers, the embedding
    on the first, the MTP blocks and the loss on the last (Megatron without a layout)."""
    out, start, last = [], 0, len(sizes) - 1
    for v, k in enumerate(sizes):
        out.append(VirtualStage(v == 0, range(start, start + k), mtp_num_layers if v == last
                                else 0, v == last))
        start += k
    return PipelineLayout(pp, tuple(out))


def balanced_sizes(num_layers: int, mtp_num_layers: int, num_stages: int) -> list[int]:
    """Layers per virtual stage, as even as whole layers allow, counting the MTP blocks as
    layers of the last stage: the spare ones go to the middle stages first (the first and last
    also carry the embedding and the head), then the first, then the last."""
    units = num_layers + mtp_num_layers
    base, extra = divmod(units, num_stages)
    order = [*range(1, num_stages - 1), 0, num_stages - 1] if num_stages > 1 else [0]
    sizes = [base + (order.index(v) < extra) for v in range(num_stages)]
    sizes[-1] -= mtp_num_layers
    for v in range(num_stages - 1, 0, -1):  # an MTP block larger than the last stage's share
        if sizes[v] < 0:
            sizes[v - 1] += sizes[v]
            sizes[v] = 0
    return sizes
