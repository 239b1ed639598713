"""Fuzz harness for the CLI, the chain loader and the plan loaders (issue 12 item 5).

One *case* is an ``optmem`` command line plus the files it reads (chain files, plan files,
directories), written into a fresh temporary directory. The strategies below draw cases
with hypothesis: valid documents first, then mutations (wrong types, missing and extra
fields, huge, negative, NaN and infinite numbers, deep nesting, empty stages) and byte
corruptions (truncation, non-UTF-8 bytes, empty files), and command lines mixing good and
nasty values (sizes, bandwidths, methods, variants, slots, time limits, output paths).

:func:`run_case` runs ``optmem.cli.main`` in-process (stdout/stderr captured like a real
pipe: UTF-8, strict on stdout) and :func:`check_case` is the oracle of the contract: the
command ends with exit 0, or with exit 2 and exactly one line on stderr that names the bad
file (and its stage and field when one field was broken); never a traceback, never an
output file left behind by a failing run, never a stray temporary file, stdout of
``--json`` is one strict JSON value, no numeric warning leaks out, and ``compare``/``sweep``
do not hide a Python exception in an ``error`` row.

The short deterministic run is ``tests/test_fuzz_cli.py``; the long run is
``benchmarks/fuzz_cli.py``.
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
import re
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

FORMAT = "optmem.chain/1"
PIPELINE_FORMAT = "optmem.pipeline-plan/1"
PROBLEMS = ("checkpoint", "offload", "remat-offload", "pipeline", "min-peak")
DIR = object()  # marker: create a directory instead of a file


class Raw(str):
    """JSON text written as is (``1e400``, ``NaN``, a 400-digit integer)."""


def dumps(value: Any) -> str:
    """Serialise ``value`` to JSON text; :class:`Raw` strings are inserted verbatim.

    Non-finite floats become ``NaN`` / ``Infinity`` / ``-Infinity`` (what Python's ``json``
    reads back), so documents can carry every nasty number.
    """
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


# ------------------------------------------------------------------ value pools
NASTY_NUMBERS: tuple[Any, ...] = (
    -1, -0.0, 0.5, -1e-9, 2**53 + 1, 2**63, 2**64 + 7, Raw("1" + "0" * 400), 1e308,
    Raw("1e400"), Raw("-1e400"), math.inf, -math.inf, math.nan, 5e-324, 1e-300,
)
NASTY_TYPES: tuple[Any, ...] = (None, True, False, "", "12", "NaN", [], [1], {}, {"a": 1},
                                "\udcff", "é" * 3)
TITLES = ("", "%s", "a" * 500, "$\\frac{", "cost in $", "two\nlines")
NASTY_TEXT = ("\udcff", "a\x00b", "a\nb", "$x^{$", "\u202e", "", "x" * 2000, "é")
NASTY_VALUES = NASTY_NUMBERS + NASTY_TYPES

STAGE_FIELDS = ("fwd_time", "bwd_time", "output_size", "saved_size", "fwd_overhead",
                "bwd_overhead", "weight_size")
REQUIRED_STAGE_FIELDS = ("fwd_time", "bwd_time", "output_size", "saved_size")
TIME_UNITS = ("ms", "s", "us", "ns")

BAD_SIZES = ("", " ", "-1", "-0", "nan", "NaN", "inf", "-inf", "1e400", "1e30", "2.7", "0.5",
             "abc", "4 GiB", "4GIB", "1_000", "0x10", "\u0661\u0662", "\uff11\uff12", "16B/s",
             "9" * 400, "1e-9", "+5", "5e", ".", "1e18", "1EiB", "\udcff")
BAD_RATES = ("0", "-1", "1e400", "nan", "inf", "-inf", "1/s", "GB/s", "12GB/h", "12GB/", "/s",
             "1e-300", "12 GB/s", "none", "Infinity", "1e308", "abc", "", "1e18GB/ns",
             "12GB/S", "\udcff")
EXTREME_SIZES = ("0", "1", "2.7", "1e18", "4611686018427387904", "1EiB", "1e30")
EXTREME_RATES = ("1e-300", "1e-9", "1e18", "1e308", "1B/ns", "1000TB/s", "1B/s")
CHAIN_RATES = ("2", "0.5", "1e6")  # --chain-bandwidth: memory units per chain time unit
BAD_CHAIN_RATES = ("-1", "nan", "1e400", "-inf", "12GB/s", "2B/ms", "", "abc", "1/2", "0x10",
                   " ", "\udcff")
EXTREME_CHAIN_RATES = ("0", "1e-300", "1e-9", "1e18", "1e308", "inf")
BAD_INTS = ("0", "-1", "1.5", "x", "", "10000000000", "1" + "0" * 30, "\u0663", "0x1", " 2",
            "1e3", "-0")
BAD_FLOATS = ("0", "-1", "nan", "inf", "-inf", "1e-300", "1e308", "x", "", "1e400", "0.0")
BAD_BUDGETS = ("0", "-1", "nan", "-inf", "x", "", "0.0", "1e-400", "None", "true")
BUNDLED = ("resnet-like-40", "vgg16-b64-224", "resnet18-b64-224")
BAD_CHAIN_NAMES = ("", ".", "..", "-", "/", "resnet", "RESNET-LIKE-40", "nonexistent",
                   "nonexistent.json", "/nonexistent/chain.json", "~", "resnet-like-40.json",
                   "\udcff", "a" * 300, "../" * 20 + "etc/passwd")

METHODS: dict[str, tuple[str, ...]] = {
    "checkpoint": ("dp", "dp:rotor", "dp:floating", "dp:floating-printed", "store_all",
                   "recompute_all", "chen", "sequential", "revolve", "brute", "ilp",
                   "ilp:persistent", "cpsat", "cpsat:persistent"),
    "offload": ("dp", "dp:thesis", "dp:cheap", "greedy", "vdnn", "vdnn_conv", "offload_all",
                "frac", "cpsat", "ilp", "brute"),
    "remat-offload": ("dp", "dp:extended", "dp:thesis", "remat_only", "offload_only",
                      "opportunist", "autocapper", "delta", "cpsat", "brute"),
    "pipeline": ("contiguous", "equal", "pipedream", "madpipe", "ilp", "cpsat"),
    "min-peak": ("dp", "dp:linear", "dp:quadratic", "dp:cubic", "ilp", "brute", "chen",
                 "every"),
}
# methods cheap on chains of any length (dp:floating is O(L^3 M^2): 70 s at L = 24, M = 332)
CHEAP_METHODS: dict[str, tuple[str, ...]] = {
    "checkpoint": ("dp", "dp:rotor", "store_all", "chen", "sequential", "revolve"),
    "offload": ("dp", "greedy", "vdnn", "offload_all", "frac"),
    "remat-offload": ("dp", "remat_only", "offload_only", "opportunist"),
    "pipeline": ("contiguous", "equal", "pipedream"),
    "min-peak": ("dp", "chen", "every", "dp:linear"),
}
BAD_METHODS = ("", "bogus", "dp:", ":rotor", "dp:bogus", "dp:rotor:x", "DP", " dp", ",",
               "auto", "ilp:bogus", "\udcff")
VARIANTS = ("paper", "rotor", "floating", "persistent", "full", "thesis", "cheap", "contract",
            "extended", "never-worse", "linear", "cubic", "bogus", "")


# ------------------------------------------------------------------ cases
@dataclass
class Case:
    """One command line and the files it needs.

    Paths in ``argv`` are written ``{d}/name`` and resolved in a fresh directory.

    Parameters
    ----------
    argv
        The arguments after ``optmem``.
    files
        Files to create first: name -> bytes, or :data:`DIR` for a directory.
    outputs
        Names the command may write; they must not exist after a failing run.
    blame
        Name of the input file an exit-2 message must name (every other input is good).
    must_fail
        The blamed file is known to be invalid: the run must exit 2.
    replay
        For ``solve`` on a valid chain file: the ``verify`` command line (plan file
        ``{d}/.replay.json``) that replays the result it prints (:func:`replay_solved`).
    where
        ``(stage, field)`` the message must name as well (one broken chain field).
    note
        What the generator did, for reports.
    """

    argv: list[str]
    files: dict[str, Any] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    blame: str | None = None
    where: tuple[int | None, str] | None = None
    note: str = ""
    must_fail: bool = False
    replay: list[str] | None = None

    def resolved(self, d: Path) -> list[str]:
        """``argv`` with ``{d}`` replaced by the case directory."""
        return [a.replace("{d}", str(d)) for a in self.argv]

    def describe(self, *, limit: int = 300) -> dict[str, Any]:
        """A JSON-able record of the case (file contents cut at ``limit`` bytes; bytes that
        are not UTF-8 are written as backslash escapes)."""

        def show(v: Any) -> str:
            if v is DIR:
                return "<dir>"
            text = v[:limit].decode("utf-8", "backslashreplace")
            return text + (f"... ({len(v)} bytes)" if len(v) > limit else "")

        return {"argv": self.argv, "files": {k: show(v) for k, v in self.files.items()},
                "outputs": self.outputs, "blame": self.blame, "where": self.where,
                "must_fail": self.must_fail, "note": self.note, "replay": self.replay}


# ------------------------------------------------------------------ documents
def size_scale() -> st.SearchStrategy[int]:
    """1 (small integers) or a byte scale (discretisation kicks in)."""
    return st.sampled_from((1, 1, 1, 1000, 2**20, 10**9))


@st.composite
def chain_docs(draw: st.DrawFn, *, max_stages: int = 6, holds: bool | None = None
               ) -> dict[str, Any]:
    """A valid ``optmem.chain/1`` document of 1..``max_stages`` stages.

    With ``holds`` (``None``: half of the time) the stages that have overheads draw held
    terms (``fwd_held``, ``bwd_held``, ``loss.held``: 0 up to the overhead, often all of it).
    """
    n = draw(st.integers(1, max_stages))
    scale = draw(size_scale())
    if holds is None:
        holds = chance(draw, 50)  # the held terms of stop 82
    times = st.one_of(st.integers(0, 20), st.floats(0, 50, allow_nan=False).map(
        lambda v: round(v, 3)))
    stages = []
    for i in range(n):
        out = draw(st.integers(0, 12)) * scale
        stage: dict[str, Any] = {
            "name": f"s{i + 1}", "fwd_time": draw(times), "bwd_time": draw(times),
            "output_size": out, "saved_size": out + draw(st.integers(0, 8)) * scale,
        }
        if draw(st.booleans()) or holds and chance(draw, 50):
            stage["fwd_overhead"] = draw(st.integers(0, 4)) * scale
            stage["bwd_overhead"] = draw(st.integers(0, 4)) * scale
            if holds:  # stop 83: memory left held until the next compute op (<= overhead)
                for held, over in (("fwd_held", "fwd_overhead"), ("bwd_held", "bwd_overhead")):
                    stage[held] = stage[over] if chance(draw, 50) else \
                        draw(st.integers(0, stage[over] // scale)) * scale
        if draw(st.booleans()):
            stage["weight_size"] = draw(st.integers(0, 6)) * scale
        stages.append(stage)
    doc: dict[str, Any] = {"format": FORMAT, "name": "fuzz", "time_unit":
                           draw(st.sampled_from(TIME_UNITS)), "memory_unit": "B",
                           "input_size": draw(st.integers(0, 12)) * scale, "stages": stages}
    if draw(st.booleans()):
        doc["loss"] = {"bwd_time": draw(times), "bwd_overhead": draw(st.integers(0, 3)) * scale}
        if holds:
            doc["loss"]["held"] = draw(st.integers(0, doc["loss"]["bwd_overhead"] // scale)) \
                * scale
    return doc


def total_size(doc: dict[str, Any]) -> int:
    """An upper bound on the store-all peak of a valid chain document (every size summed)."""
    total = doc["input_size"] + doc.get("loss", {}).get("bwd_overhead", 0)
    for s in doc["stages"]:
        total += s["saved_size"] + 2 * s["output_size"] + s.get("fwd_overhead", 0) \
            + s.get("bwd_overhead", 0) + 3 * s.get("weight_size", 0)
    return total


@dataclass
class Doc:
    """Bytes of a file and what the generator knows about them."""

    data: bytes
    invalid: bool = False  # known to be rejected
    where: tuple[int | None, str] | None = None
    note: str = ""
    name: str | None = None  # the path the error must name, if not the default file


@st.composite
def mutated_chain(draw: st.DrawFn, doc: dict[str, Any]) -> Doc:
    """Apply one kind of damage to a valid chain document and serialise it."""
    doc = json.loads(json.dumps(doc))
    kind = draw(st.sampled_from(("none",) * 6 + ("extreme",) * 3 + (
        "field", "field", "missing", "extra", "top", "stages", "loss", "held", "bytes",
        "bytes", "deep")))
    if kind == "none":
        return Doc(dumps(doc).encode(), note="valid chain")
    if kind == "held":
        return draw(mutated_held(doc))
    if kind == "extreme":
        sizes = draw(st.sampled_from((1, 2**30, 2**40, 2**44)))
        times = draw(st.sampled_from((1, 1e-9, 1e-6, 1e6, 1e10)))
        tiny = draw(st.booleans())
        for i, stage in enumerate(doc["stages"]):
            for f in ("output_size", "saved_size", "fwd_overhead", "bwd_overhead",
                      "weight_size", "fwd_held", "bwd_held"):
                if f in stage:
                    stage[f] *= sizes
            for f in ("fwd_time", "bwd_time"):
                stage[f] = stage[f] * times if not (tiny and i == 0) else stage[f] * 1e-9
        doc["input_size"] *= sizes
        return Doc(dumps(doc).encode(), note=f"sizes x{sizes}, times x{times:g}"
                   + (", stage 1 tiny" if tiny else ""))
    if kind == "field":
        k = draw(st.integers(0, len(doc["stages"]) - 1))
        name = draw(st.sampled_from(STAGE_FIELDS))
        value = draw(st.sampled_from(NASTY_VALUES))
        doc["stages"][k][name] = value
        # a value of the wrong type is always rejected, naming the stage and the field
        wrong_type = value is None or isinstance(value, bool | str | list | dict) \
            and not isinstance(value, Raw)
        return Doc(dumps(doc).encode(), invalid=wrong_type,
                   where=(k + 1, name) if wrong_type else None,
                   note=f"stage {k + 1} {name} = {value!r}")
    if kind == "missing":
        k = draw(st.integers(0, len(doc["stages"]) - 1))
        name = draw(st.sampled_from(REQUIRED_STAGE_FIELDS + ("input_size", "format")))
        if name in ("input_size", "format"):
            del doc[name]
            return Doc(dumps(doc).encode(), invalid=True, where=(None, name),
                       note=f"no {name}")
        del doc["stages"][k][name]
        return Doc(dumps(doc).encode(), invalid=True, where=(k + 1, name),
                   note=f"stage {k + 1} without {name}")
    if kind == "extra":
        target = draw(st.sampled_from(("top", "stage")))
        key = draw(st.sampled_from(("extra", "", "name", "é", "\udcff", "stages ", "loss")))
        value = draw(st.sampled_from(NASTY_VALUES + (Raw("[" * 500 + "]" * 500),)))
        where = doc if target == "top" else doc["stages"][0]
        if key in ("name", "loss", "\udcff"):
            where[key] = value
            return Doc(dumps(doc).encode(), note=f"{target} {key!r} = {value!r}")
        where[key] = value
        return Doc(dumps(doc).encode(), note=f"extra {target} field {key!r}")
    if kind == "top":
        name = draw(st.sampled_from(("input_size", "format", "time_unit", "memory_unit",
                                     "name", "name", "stages")))
        value = draw(st.sampled_from(NASTY_VALUES + NASTY_TEXT + ("optmem.chain/2", "h", "B")))
        doc[name] = value
        return Doc(dumps(doc).encode(), note=f"top {name} = {value!r}")
    if kind == "stages":
        how = draw(st.sampled_from(("empty", "scalar", "strings", "dup", "many", "null")))
        if how == "empty":
            doc["stages"] = []
        elif how == "scalar":
            doc["stages"] = draw(st.sampled_from((1, "x", {}, None)))
        elif how == "strings":
            doc["stages"] = ["F_all 1"] * len(doc["stages"])
        elif how == "null":
            doc["stages"] = [None]
        elif how == "dup":
            doc["stages"] = doc["stages"] * draw(st.integers(2, 4))
            return Doc(dumps(doc).encode(), note="stages repeated")
        else:
            doc["stages"] = doc["stages"][:1] * draw(st.integers(30, 80))
            return Doc(dumps(doc).encode(), note="many stages")
        return Doc(dumps(doc).encode(), invalid=True, note=f"stages {how}")
    if kind == "loss":
        value = draw(st.sampled_from(NASTY_VALUES))
        if draw(st.booleans()):
            doc["loss"] = value
            return Doc(dumps(doc).encode(), note=f"loss = {value!r}")
        doc["loss"] = {"bwd_time": value, "bwd_overhead": 0}
        return Doc(dumps(doc).encode(), note=f"loss.bwd_time = {value!r}")
    if kind == "deep":
        depth = draw(st.sampled_from((50, 5000, 100000)))
        text = "[" * depth + dumps(doc) + "]" * depth
        return Doc(text.encode(), invalid=True, note=f"nested {depth} deep")
    return draw(corrupted_bytes(dumps(doc).encode()))


HELD_FIELDS = ("fwd_held", "bwd_held")
BAD_HELD: tuple[Any, ...] = (-1, 0.5, "1", "", True, False, None, [1], {}, math.nan,
                             math.inf, Raw("1e400"), 2**64)


@st.composite
def mutated_held(draw: st.DrawFn, doc: dict[str, Any]) -> Doc:
    """A held term (stop 82) that the loader must refuse, or a valid one at a boundary.

    Invalid: above its op's overhead (by one unit), or a value of :data:`BAD_HELD` (negative,
    fractional, text, a bool, null, a list, NaN, infinite, huge), on a stage or on the loss
    (``loss.held``); the error names the stage (none for the loss) and the field. Valid:
    every held term equal to its overhead (the largest allowed).
    """
    how = draw(st.sampled_from(("above", "above", "bad", "bad", "loss", "loss", "full")))
    if how == "full":
        for stage in doc["stages"]:
            for held in HELD_FIELDS:
                stage[held] = stage.get(held.replace("held", "overhead"), 0)
        if isinstance(doc.get("loss"), dict):
            doc["loss"]["held"] = doc["loss"].get("bwd_overhead", 0)
        return Doc(dumps(doc).encode(), note="every held term at its overhead")
    if how == "loss":
        loss = doc.setdefault("loss", {"bwd_time": 1})
        over = loss.setdefault("bwd_overhead", 0)
        value = draw(st.sampled_from((over + 1,) + BAD_HELD))
        loss["held"] = value
        return Doc(dumps(doc).encode(), invalid=True, where=(None, "loss.held"),
                   note=f"loss.held = {value!r} (bwd_overhead {over})")
    k = draw(st.integers(0, len(doc["stages"]) - 1))
    held = draw(st.sampled_from(HELD_FIELDS))
    stage = doc["stages"][k]
    over = stage.get(held.replace("held", "overhead"), 0)
    value = over + draw(st.sampled_from((1, 1, 2**20))) if how == "above" \
        else draw(st.sampled_from(BAD_HELD))
    stage[held] = value
    return Doc(dumps(doc).encode(), invalid=True, where=(k + 1, held),
               note=f"stage {k + 1} {held} = {value!r} (overhead {over})")


@st.composite
def corrupted_bytes(draw: st.DrawFn, data: bytes) -> Doc:
    """Byte-level damage: truncation, non-UTF-8 bytes, empty or binary files."""
    how = draw(st.sampled_from(("truncate", "badutf8", "empty", "blank", "bom", "utf16",
                                "garbage", "trailing", "null")))
    if how == "truncate":
        cut = draw(st.integers(0, max(0, len(data) - 1)))
        return Doc(data[:cut], invalid=True, note=f"truncated at {cut}")
    if how == "badutf8":
        pos = draw(st.integers(0, len(data)))
        bad = draw(st.sampled_from((b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80",
                                    b"\xf8\x88\x80\x80\x80")))
        return Doc(data[:pos] + bad + data[pos:], invalid=True, note=f"byte {bad!r} at {pos}")
    if how == "empty":
        return Doc(b"", invalid=True, note="empty file")
    if how == "blank":
        return Doc(b" \n\t ", invalid=True, note="whitespace only")
    if how == "bom":
        return Doc(b"\xef\xbb\xbf" + data, note="UTF-8 BOM")
    if how == "utf16":
        return Doc(data.decode().encode("utf-16"), note="UTF-16")
    if how == "garbage":
        return Doc(draw(st.binary(min_size=1, max_size=64)), note="random bytes")
    if how == "trailing":
        return Doc(data + b" }garbage", invalid=True, note="trailing garbage")
    return Doc(b"null", invalid=True, note="null")


# ------------------------------------------------------------------ plans
def _cli_json(argv: list[str]) -> Any:
    """Run the CLI quietly and parse its stdout (used to precompute real plans)."""
    out = run_cli(argv)
    return json.loads(out.stdout) if out.code == 0 else None


@functools.cache
def reference_plans() -> dict[str, Any]:
    """Real ``solve --json`` results on one fixed small chain, one per problem.

    Returns ``{"chain": doc, problem: (argv options, result JSON), ...}``; fuzzed plans
    start from these so that some of them replay successfully.
    """
    doc = {"format": FORMAT, "name": "ref", "time_unit": "ms", "memory_unit": "B",
           "input_size": 2, "stages": [
               {"fwd_time": 1, "bwd_time": 2, "output_size": 2, "saved_size": 3,
                "weight_size": 1},
               {"fwd_time": 2, "bwd_time": 3, "output_size": 1, "saved_size": 2,
                "weight_size": 2},
               {"fwd_time": 1, "bwd_time": 1, "output_size": 2, "saved_size": 4,
                "weight_size": 1}]}
    options = {"checkpoint": ["-m", "12"], "offload": ["-m", "11", "--bandwidth", "2kB/s"],
               "remat-offload": ["-m", "9", "--bandwidth", "2kB/s"],
               "pipeline": ["-m", "40", "--gpus", "2"], "min-peak": []}
    out: dict[str, Any] = {"chain": doc}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ref.json"
        path.write_text(json.dumps(doc))
        for problem, opts in options.items():
            result = _cli_json(["solve", problem, str(path), *opts, "--json"])
            if result is None or not result.get("plan"):
                raise RuntimeError(f"the reference {problem} solve found no plan")
            out[problem] = (opts, result)
    return out


CHECKPOINT_OPS = ("F_all", "F_ck", "F_none", "B")


@st.composite
def op_strings(draw: st.DrawFn, problem: str, n: int) -> str:
    """One op string from the grammar of ``problem`` (stage numbers near 1..n, or not)."""
    stage = st.one_of(st.integers(0, n + 2), st.sampled_from((-1, 10**18, 2**64)))
    if problem == "pipeline":
        num = st.one_of(st.integers(-2, 50).map(str), st.sampled_from(
            ("nan", "inf", "-inf", "1e400", "1e-300", "0.5", "1e18", "x", "1000000000000",
             "-1000000000000")))
        kind = draw(st.sampled_from(("period", "stage", "task", "task", "junk")))
        if kind == "period":
            return f"period {draw(num)}"
        if kind == "stage":
            return (f"stage {draw(stage)} layers {draw(stage)}-{draw(stage)} "
                    f"gpu {draw(st.integers(-1, 3))}")
        if kind == "task":
            return (f"{draw(st.sampled_from(('F', 'B', 'send', 'grad')))} {draw(stage)} "
                    f"start {draw(num)} shift {draw(num)}")
        return draw(st.sampled_from(("", " ", "period", "stage 1 layers 1 gpu 0",
                                     "F 1 start 0 shift", "\udcff")))
    kind = draw(st.sampled_from(("ck", "ck", "loss", "transfer", "junk")))
    if kind == "ck":
        return f"{draw(st.sampled_from(CHECKPOINT_OPS))} {draw(stage)}"
    if kind == "loss":
        return "Loss"
    if kind == "transfer":
        return (f"{draw(st.sampled_from(('offload', 'prefetch')))} "
                f"{draw(st.sampled_from(('a', 'abar', 'delta')))} {draw(stage)}")
    return draw(st.sampled_from(("", " ", "Loss 1", "F_all", "F_all x", "F_all 1 2", "loss",
                                 "offload", "F_all -1", "F_all 1.5", "\udcff", "B\u00a01",
                                 "F_all \u0661")))


@st.composite
def plan_docs(draw: st.DrawFn, problem: str) -> Doc:
    """A plan file for ``problem``: a real result, its plan, or damage to either."""
    ref = reference_plans()
    opts, result = ref[problem]
    n = len(ref["chain"]["stages"])
    base = draw(st.sampled_from(("result", "result", "plan", "plan", "ops", "object",
                                 "indices")))
    value: Any
    if base == "result":
        value = json.loads(json.dumps(result))
    elif base == "plan":
        value = list(result["plan"])
    elif base == "ops":
        value = draw(st.lists(op_strings(problem, n), max_size=12))
    elif base == "object" and problem == "pipeline":
        from optmem.pipeline_plan import PipelinePlan

        value = PipelinePlan.from_any(result).to_dict()
    elif base == "indices" and problem == "min-peak":
        value = draw(st.lists(st.one_of(st.integers(-1, n + 1), st.sampled_from(
            NASTY_VALUES)), max_size=5))
    else:
        value = {"plan": list(result["plan"]), "checkpoints": result.get("report", {}).get(
            "checkpoints")}
    value = draw(mutated_plan(value, problem, n))
    data = dumps(value).encode()
    if chance(draw, 15):
        return draw(corrupted_bytes(data))
    return Doc(data, note=f"{problem} plan from {base}")


@st.composite
def mutated_plan(draw: st.DrawFn, value: Any, problem: str, n: int) -> Any:
    """Damage a plan value: ops swapped, dropped or replaced, fields of the wrong type."""
    if isinstance(value, dict) and value.get("format") == PIPELINE_FORMAT:
        kinds: tuple[str, ...] = ("none", "none", "pipe", "pipe", "pipe", "field", "type")
    elif isinstance(value, dict):
        kinds = ("none", "none", "field", "field", "field", "op", "drop", "swap", "wrap",
                 "type")
    else:
        kinds = ("none", "none", "op", "op", "drop", "swap", "wrap", "type")
    how = draw(st.sampled_from(kinds))
    ops = value.get("plan") if isinstance(value, dict) else value
    if how == "none":
        return value
    if how in ("op", "drop", "swap") and isinstance(ops, list) and ops:
        k = draw(st.integers(0, len(ops) - 1))
        if how == "op":
            ops[k] = draw(st.one_of(op_strings(problem, n), st.sampled_from(NASTY_VALUES)))
        elif how == "drop":
            del ops[k]
        else:
            j = draw(st.integers(0, len(ops) - 1))
            ops[k], ops[j] = ops[j], ops[k]
        return value
    if how == "field" and isinstance(value, dict):
        name = draw(st.sampled_from(("memory_limit", "unit", "bandwidth", "report", "plan",
                                     "problem", "method", "checkpoints", "format", "period",
                                     "stages", "tasks")))
        value[name] = draw(st.sampled_from(NASTY_VALUES + (
            "x", [["F 1"]], {"bandwidth": -1}, {"bandwidth": "12GB/s"}, 10**12, 7, "12GB/s")))
        return value
    if how == "pipe":
        part = draw(st.sampled_from(("stages", "tasks", "tasks")))
        items = value[part]
        if items:
            k = draw(st.integers(0, len(items) - 1))
            key = draw(st.sampled_from(("layers", "gpu") if part == "stages" else
                                       ("op", "stage", "start", "shift", "shift")))
            items[k][key] = draw(st.sampled_from(NASTY_VALUES + (
                10**12, -10**12, [1], [2, 1], [1, 10**12], "F", 3, 0.5)))
        return value
    if how == "wrap":
        return draw(st.sampled_from(([value], {"plan": value}, {"result": value})))
    return draw(st.sampled_from(NASTY_VALUES + ("F_all 1", {"plan": None}, {"plan": "Loss"})))


# ------------------------------------------------------------------ command lines
def chance(draw: st.DrawFn, percent: int) -> bool:
    """True with probability about ``percent`` %.

    Drawn from the middle of a range, because hypothesis favours the bounds of integer
    ranges (``integers(0, 9) == 0`` comes up far more often than one time in ten).
    """
    return 500 <= draw(st.integers(0, 1999)) < 500 + 10 * percent


def pick(good: Sequence[str], bad: Sequence[str], p_bad: int = 5) -> st.SearchStrategy[str]:
    """A good value, or with probability about ``1/p_bad`` a nasty one."""
    return st.integers(0, p_bad - 1).flatmap(
        lambda k: st.sampled_from(tuple(bad)) if k == 0 else st.sampled_from(tuple(good)))


@dataclass
class Args:
    """Options drawn for one command, and whether every one came from the good pools.

    ``p_bad`` (percent) is drawn once per case: most cases take only good values, some one
    nasty value, a few many, so that every nasty value also meets otherwise good input.
    """

    argv: list[str] = field(default_factory=list)
    clean: bool = True
    p_bad: int = 0

    def add(self, draw: st.DrawFn, flag: str, good: Sequence[str], bad: Sequence[str],
            *, p_bad: int = 0, p_skip: int = 0, required: bool = False,
            extreme: Sequence[str] = ()) -> None:
        """Add ``flag value``: good, or (rarely) bad, or (one time in ten) ``extreme``.

        ``extreme`` values parse (huge slots, a zero memory, a tiny bandwidth) and so reach
        the solvers, where nasty syntax never does. The option is left out with probability
        ``1/p_skip``; leaving out a ``required`` one makes the command line bad.
        """
        if p_skip and chance(draw, 100 // p_skip):
            self.clean = self.clean and not required
            return
        if chance(draw, 100 // p_bad if p_bad else self.p_bad):
            value = draw(st.sampled_from(tuple(bad)))
        elif extreme and chance(draw, 10):
            value = draw(st.sampled_from(tuple(extreme)))
        else:
            value = draw(st.sampled_from(tuple(good)))
        if value not in good:
            self.clean = False
        self.argv += [flag, value]


def bad_rate() -> st.SearchStrategy[int]:
    """Percent chance that an option takes a nasty value, drawn once per case."""
    return st.sampled_from((0, 0, 0, 0, 3, 6, 25))


def memory_values(doc: dict[str, Any] | None) -> tuple[str, ...]:
    """Good ``--memory`` values for a chain document."""
    if doc is None:
        return ("100", "1GiB", "8GiB", "700MB", "0")
    total = total_size(doc)
    return (str(total), str(total), str(total // 2), str(total // 3), "0", str(total * 4),
            f"{max(1, total // 2**20)}MiB")


@st.composite
def chain_arg(draw: st.DrawFn, files: dict[str, Any]) -> tuple[str, dict[str, Any] | None, Doc]:
    """The CHAIN argument: a (possibly damaged) chain file, a bundled name, or a bad path.

    Returns the argument, the valid document it holds (``None`` if damaged or not a file)
    and the :class:`Doc`; a damaged file or a directory is added to ``files``.
    """
    kind = draw(st.sampled_from(("file",) * 12 + ("bundled", "bundled", "bad", "dir")))
    if kind == "file":
        doc = draw(chain_docs())
        d = draw(mutated_chain(doc))
        files["chain.json"] = d.data
        return "{d}/chain.json", (doc if not d.invalid else None), d
    if kind == "bundled":
        return draw(st.sampled_from(BUNDLED)), None, Doc(b"", note="bundled")
    if kind == "dir":
        files["adir"] = DIR
        return draw(st.sampled_from(("{d}/adir", "{d}/adir/", "{d}/adir/x.json"))), None, \
            Doc(b"", invalid=True, note="directory", name="adir")
    return draw(st.sampled_from(BAD_CHAIN_NAMES)), None, Doc(b"", note="bad name")


def output_path(draw: st.DrawFn, files: dict[str, Any], suffix: str,
                outputs: list[str], args: Args) -> str:
    """An output path: a fresh file in the case directory, or an unwritable one."""
    kind = draw(st.sampled_from(("ok",) * 6 + ("nodir", "isdir", "parentfile", "longname",
                                               "suffix", "trailing")))
    if kind == "ok":
        outputs.append("out" + suffix)
        return "{d}/out" + suffix
    args.clean = False
    if kind == "nodir":
        return "{d}/missing/out" + suffix
    if kind == "isdir":
        files["outdir" + suffix] = DIR
        return "{d}/outdir" + suffix
    if kind == "parentfile":
        files["plain.txt"] = b"x"
        return "{d}/plain.txt/out" + suffix
    if kind == "longname":
        return "{d}/" + "x" * 300 + suffix
    if kind == "suffix":
        outputs.append("out.weird")
        return "{d}/out.weird"
    outputs.append("out" + suffix)
    return "{d}/out" + suffix + "/"


def problem_options(draw: st.DrawFn, problem: str, args: Args) -> None:
    """The options a problem needs (bandwidth, GPUs, min-peak model), good or bad."""
    if problem in ("offload", "remat-offload"):
        link_option(draw, args, ("2", "0.5", "12GB/s", "1", "100"))
    elif problem == "pipeline":
        args.add(draw, "--gpus", ("1", "2", "3"), BAD_INTS,
                 extreme=("8", "64", "4096", "4097", "10000000000"))
        link_option(draw, args, ("inf", "2", "12GB/s"), p_skip=2)
        args.add(draw, "--weight-copies", ("3", "1", "0"), BAD_INTS, p_skip=2,
                 extreme=("64", "65", "1000000", "1" + "0" * 30))
        args.add(draw, "--memory-model", ("stash", "strict"), ("bogus", ""), p_skip=2)
        if args.argv[-2:] == ["--memory-model", "strict"] and chance(draw, 50):
            args.argv.append("--temporaries")  # strict only (else exit 2, tested elsewhere)
    elif problem == "min-peak":
        args.add(draw, "--model", ("pytorch", "static", "optmem"), ("bogus",), p_skip=2)
        if chance(draw, 25):
            args.argv.append("--ignore-input")


def link_option(draw: st.DrawFn, args: Args, good: Sequence[str], *, p_skip: int = 0,
                required: bool = False) -> None:
    """``--bandwidth``, or one time in four ``--chain-bandwidth`` (rarely with both)."""
    if not chance(draw, 25):
        args.add(draw, "--bandwidth", good, BAD_RATES, p_skip=p_skip, required=required,
                 extreme=EXTREME_RATES)
        return
    args.add(draw, "--chain-bandwidth", CHAIN_RATES, BAD_CHAIN_RATES, p_skip=p_skip,
             required=required, extreme=EXTREME_CHAIN_RATES)
    if chance(draw, 5):  # exclusive: one error
        args.argv += ["--bandwidth", good[0]]
        args.clean = False


def common_options(draw: st.DrawFn, args: Args, *, exact: bool) -> None:
    """``--slots``, ``--time-limit``, ``--threads``, ``--solver``, ``--work-budget``,
    ``--variant``."""
    args.add(draw, "--slots", ("500", "50", "7", "1"), BAD_INTS, p_skip=2,
             extreme=("2", "3", "5000", "100000", "100000000", "10000000000"))
    args.add(draw, "--time-limit", ("5", "2.5"), BAD_FLOATS, p_skip=1 if exact else 2,
             extreme=("1e-300", "0.001", "1e308"))
    args.add(draw, "--threads", ("1", "2"), BAD_INTS, p_skip=2,
             extreme=("256", "257", "100000"))
    args.add(draw, "--solver", ("highs", "cbc"), ("bogus", "gurobi", ""), p_skip=3)
    if chance(draw, 20):  # stop 54: HiGHS and CBC under the budget (no fuzz coverage before)
        args.add(draw, "--work-budget", ("0.05", "1", "inf", "1e400"), BAD_BUDGETS,
                 extreme=("1e-300", "1e308"))
    if chance(draw, 15):
        args.add(draw, "--variant", VARIANTS, ("bogus",))


@st.composite
def solve_cases(draw: st.DrawFn, command: str = "solve") -> Case:
    """``solve`` / ``compare`` / ``export`` with a chain, a problem and options."""
    files: dict[str, Any] = {}
    outputs: list[str] = []
    problem = draw(pick(PROBLEMS, ("bogus", "", "CHECKPOINT", "remat_offload"), 25))
    args = Args([command, problem], problem in PROBLEMS, draw(bad_rate()))
    spec, doc, chain_doc = draw(chain_arg(files))
    args.argv.append(spec)
    args.add(draw, "--memory", memory_values(doc), BAD_SIZES, p_skip=25, required=True,
             extreme=EXTREME_SIZES)
    if problem in PROBLEMS:
        problem_options(draw, problem, args)
    small = doc is not None and len(doc["stages"]) <= 4
    if command == "solve":
        methods = METHODS.get(problem, ("dp",)) if small else CHEAP_METHODS.get(problem, ("dp",))
        if problem in METHODS and chance(draw, 67):
            args.add(draw, "--method", methods, BAD_METHODS)
        common_options(draw, args, exact=True)
        if chance(draw, 33):
            args.argv += ["-o", output_path(draw, files, ".json", outputs, args)]
        if draw(st.booleans()):
            args.argv.append("--json")
        if doc is not None and args.clean and problem in PROBLEMS:
            return replace(finish(args, files, outputs, chain_doc, note=chain_doc.note),
                           replay=replay_argv(args.argv))
    elif command == "compare":
        # every default method (exact ones included) only on small chains, now and then
        if problem in METHODS and (not small or not chance(draw, 25)):
            names = draw(st.lists(st.sampled_from(CHEAP_METHODS[problem] + BAD_METHODS),
                                  min_size=1, max_size=3))
            args.argv += ["--methods", ",".join(names)]
            args.clean = args.clean and all(n in CHEAP_METHODS[problem] for n in names)
        common_options(draw, args, exact=True)
        if "--time-limit" not in args.argv:
            args.argv += ["--time-limit", "5"]
        if draw(st.booleans()):
            args.argv.append("--json")
    else:  # export
        suffix = draw(st.sampled_from((".mps", ".lp", ".mps", ".pb", ".txt", "")))
        args.clean = args.clean and suffix in (".mps", ".lp")
        args.add(draw, "--method", ("ilp", "ilp:persistent", "cpsat"), BAD_METHODS + ("dp",),
                 p_skip=3)
        common_options(draw, args, exact=False)
        args.argv += ["-o", output_path(draw, files, suffix, outputs, args)]
    return finish(args, files, outputs, chain_doc, note=chain_doc.note)


REPLAY_OPTIONS = ("--memory", "--slots", "--bandwidth", "--chain-bandwidth", "--gpus",
                  "--weight-copies", "--memory-model", "--model")
REPLAY_FLAGS = ("--temporaries", "--ignore-input")


def replay_argv(argv: list[str]) -> list[str]:
    """The ``verify`` command line replaying what ``solve`` ``argv`` prints: the problem,
    the chain and the options that change the problem (memory, slots, link, GPUs ...)."""
    out = ["verify", argv[1], argv[2], "{d}/.replay.json", "--json"]
    for k, arg in enumerate(argv[3:], start=3):
        if arg in REPLAY_OPTIONS and k + 1 < len(argv):
            out += [arg, argv[k + 1]]
        elif arg in REPLAY_FLAGS:
            out.append(arg)
    return out


HELD_METHODS: dict[str, tuple[str, ...]] = {
    "offload": ("dp", "dp", "greedy", "dp:cheap", "vdnn", "cpsat", "ilp", "brute"),
    "remat-offload": ("dp", "dp", "opportunist", "opportunist", "offload_only", "cpsat",
                      "brute"),
}


@st.composite
def held_solve_cases(draw: st.DrawFn) -> Case:
    """``solve offload|remat-offload`` of a valid chain with held terms (stop 83).

    The held terms count only where a prefetch starts between two compute ops, so the
    memory is a share of the store-all peak (45 % .. 100 %) and the link moves the chain's
    values in a few time units: plans offload, and their prefetches wait. Every option is
    good; the result is replayed (:attr:`Case.replay`) and its prefetches checked against
    the chain's held terms (:func:`held_floor_breaks`).
    """
    doc = draw(chain_docs(max_stages=4, holds=True))
    scale = max(1, max(s["output_size"] for s in doc["stages"]) // 12)
    for stage in doc["stages"]:  # large held terms: a prefetch after the op must wait
        for held, over in (("fwd_held", "fwd_overhead"), ("bwd_held", "bwd_overhead")):
            if chance(draw, 50):
                stage[over] = stage[held] = draw(st.integers(0, 16)) * scale
    if chance(draw, 50):
        over = draw(st.integers(0, 16)) * scale
        doc["loss"] = {"bwd_time": draw(st.integers(0, 5)), "bwd_overhead": over, "held": over}
    files = {"chain.json": dumps(doc).encode()}
    problem = draw(st.sampled_from(tuple(HELD_METHODS)))
    argv = ["solve", problem, "{d}/chain.json", "--memory",
            f"{draw(st.integers(45, 100))}%",
            "--chain-bandwidth", str(scale * draw(st.sampled_from((0.25, 0.5, 1, 2, 8)))),
            "--slots", draw(st.sampled_from(("500", "60"))), "--threads", "1"]
    methods = HELD_METHODS[problem] if len(doc["stages"]) <= 2 else \
        tuple(m for m in HELD_METHODS[problem] if m != "brute")
    method = draw(st.sampled_from(methods))
    argv += ["--method", method, "--json"]
    if method in ("cpsat", "ilp"):
        argv += ["--work-budget", "2"]
    return Case(argv, files, [], note=f"held chain, {method}", replay=replay_argv(argv))


def finish(args: Args, files: dict[str, Any], outputs: list[str], doc: Doc,
           *, blame_name: str = "chain.json", note: str = "", any_error: bool = False) -> Case:
    """Build the case; when every other input is good, an error must name the file.

    That holds for a file known to be damaged, and with ``any_error`` for any error (plans
    replayed on a good chain with good options: whatever fails is the plan's fault).
    """
    blame = where = None
    name = doc.name or blame_name
    if args.clean and (doc.invalid or any_error) and name in files:
        blame, where = name, doc.where
    return Case(args.argv, files, outputs, blame, where, note,
                must_fail=blame is not None and doc.invalid)


@st.composite
def verify_cases(draw: st.DrawFn) -> Case:
    """``verify PROBLEM CHAIN PLAN`` with the reference chain or a damaged one."""
    files: dict[str, Any] = {}
    problem = draw(st.sampled_from(PROBLEMS))
    ref = reference_plans()
    opts, _ = ref[problem]
    args = Args(["verify", problem], p_bad=draw(bad_rate()))
    if chance(draw, 75):
        files["chain.json"] = dumps(ref["chain"]).encode()
        args.argv.append("{d}/chain.json")
        chain_ok = True
    else:
        spec, doc, _ = draw(chain_arg(files))
        args.argv.append(spec)
        chain_ok = False
    plan = draw(plan_docs(problem))
    kind = draw(st.sampled_from(("file",) * 8 + ("dir", "missing")))
    if kind == "file":
        files["plan.json"] = plan.data
        args.argv.append("{d}/plan.json")
    elif kind == "dir":
        files["plan.json"] = DIR
        args.argv.append("{d}/plan.json")
        plan = Doc(b"", invalid=True, note="plan is a directory")
    else:
        args.argv.append("{d}/absent.json")
        plan = Doc(b"", invalid=True, note="plan missing")
    good = list(opts)
    if chance(draw, 20):
        extra = Args(p_bad=args.p_bad)
        extra.add(draw, "--memory", memory_values(ref["chain"]), BAD_SIZES)
        problem_options(draw, problem, extra)
        good = extra.argv
        args.clean = extra.clean
    args.argv += good
    if chance(draw, 25):
        args.add(draw, "--slots", ("500", "7"), BAD_INTS, extreme=("1", "100000000"))
    if draw(st.booleans()):
        args.argv.append("--json")
    args.clean = args.clean and chain_ok
    if kind == "missing":
        return Case(args.argv, files, [], "absent.json" if args.clean else None, None,
                    plan.note, must_fail=args.clean)
    return finish(args, files, [], plan, blame_name="plan.json", note=plan.note,
                  any_error=True)


@st.composite
def show_cases(draw: st.DrawFn) -> Case:
    """``show PLAN --chain CHAIN [-o OUT]`` for checkpoint-like and offload plans."""
    files: dict[str, Any] = {}
    outputs: list[str] = []
    problem = draw(st.sampled_from(("checkpoint", "offload", "remat-offload", "min-peak",
                                    "pipeline")))
    ref = reference_plans()
    plan = draw(plan_docs(problem))
    files["plan.json"] = plan.data
    args = Args(["show", "{d}/plan.json"], p_bad=draw(bad_rate()))
    if chance(draw, 75):
        files["chain.json"] = dumps(ref["chain"]).encode()
        args.argv += ["--chain", "{d}/chain.json"]
    else:
        spec, _, _ = draw(chain_arg(files))
        args.argv += ["--chain", spec]
        args.clean = False
    if chance(draw, 67):
        suffix = draw(st.sampled_from((".png", ".svg", ".png", ".txt")))
        args.argv += ["-o", output_path(draw, files, suffix, outputs, args)]
        if suffix == ".txt":  # no figure format: an error of its own, so not only the plan
            args.clean = False
    else:
        outputs.append("plan.png")
    args.add(draw, "--memory", ("12", "100"), BAD_SIZES, p_skip=3, extreme=EXTREME_SIZES)
    link_option(draw, args, ("2", "12GB/s"), p_skip=6, required=True)
    if chance(draw, 15):
        args.add(draw, "--title", TITLES, NASTY_TEXT, p_bad=3)
    return finish(args, files, outputs, plan, blame_name="plan.json", note=plan.note,
                  any_error=True)


@st.composite
def sweep_cases(draw: st.DrawFn) -> Case:
    """``sweep PROBLEM CHAIN --memory FROM:TO:STEPS`` with outputs."""
    files: dict[str, Any] = {}
    outputs: list[str] = []
    problem = draw(st.sampled_from(("checkpoint",) * 3 + ("offload", "remat-offload",
                                                          "min-peak", "pipeline")))
    args = Args(["sweep", problem], p_bad=draw(bad_rate()))
    spec, doc, chain_doc = draw(chain_arg(files))
    args.argv.append(spec)
    total = total_size(doc) if doc else 1000
    good = (f"0:{total}:4", f"{total // 2}:{total}:3", f"1:{total}:1", "auto:3")
    bad = ("1:10:0", "10:1:3", "1:10", "1:10:1000000000", "1:1e30:5", "a:b:c", ":::",
           "auto:0", "auto:x", "", "1:10:-1", "-5:10:2", "nan:1:2")
    args.add(draw, "--memory", good, bad, p_bad=5)
    problem_options(draw, problem, args)
    methods = CHEAP_METHODS[problem]
    if draw(st.booleans()):
        names = draw(st.lists(st.sampled_from(methods[:3] + ("bogus",)), min_size=1,
                              max_size=2))
        args.argv += ["--methods", ",".join(names)]
        args.clean = args.clean and "bogus" not in names
    args.add(draw, "--jobs", ("1",), ("0", "-1", "x"), p_bad=8)
    args.argv.append("-q")
    for flag, suffix in (("--csv", ".csv"), ("--json", ".json"), ("--plot", ".png")):
        if chance(draw, 25):
            args.argv += [flag, output_path(draw, files, suffix, outputs, args)]
    if "--plot" in args.argv and chance(draw, 25):
        args.add(draw, "--title", TITLES, NASTY_TEXT, p_bad=3)
    return finish(args, files, outputs, chain_doc, note=chain_doc.note)


@st.composite
def misc_cases(draw: st.DrawFn, *, torch: bool = True) -> Case:
    """``datasets``, ``profile`` and malformed command lines.

    With ``torch=False`` (the CI run), ``profile`` cases stop before torch is imported
    (``--list``, no spec, a bad device or batch), which keeps the short run short.
    """
    kind = draw(st.sampled_from(("datasets", "datasets", "profile", "junk")))
    if kind == "profile" and not torch:
        early = draw(st.sampled_from((["--list"], [], ["toy-mlp", "--device", "tpu"],
                                      ["toy-mlp", "--batch", "0"], ["toy-mlp", "--batch", "-1"],
                                      ["toy-mlp", "--device", ""], ["--batch", "x"])))
        return Case(["profile", *early], note="profile (before torch)")
    if kind == "datasets":
        action = draw(st.sampled_from(("list", "show", "path", "bogus", "")))
        argv = ["datasets"] + ([action] if action else [])
        if action == "show" and chance(draw, 50):
            return draw(datasets_show_cases(argv))
        if action in ("show", "path") or draw(st.booleans()):
            argv.append(draw(st.sampled_from(BUNDLED + BAD_CHAIN_NAMES)))
        if draw(st.booleans()):
            argv.append("--json")
        return Case(argv, note="datasets")
    if kind == "profile":
        files: dict[str, Any] = {}
        outputs: list[str] = []
        args = Args(["profile"], p_bad=draw(bad_rate()))
        spec = draw(st.sampled_from(("toy-mlp", "toy-cnn", "toy-mlp", "bogus", "",
                                     "optmem.pytorch.toy:nonexistent", "math:pi",
                                     "builtins:list", "nonexistent.module:f", "a:b:c", ":")))
        if spec:
            args.argv.append(spec)
        args.argv += ["--device", draw(st.sampled_from(("meta",) * 6 + ("cpu", "tpu", "cuda",
                                                                        "")))]
        args.add(draw, "--batch", ("2", "1"), ("0", "-1", "x"), p_skip=2)
        args.add(draw, "--repeats", ("1",), ("0", "-1"), p_skip=2)
        args.add(draw, "--warmup", ("0",), ("-1",), p_skip=2)
        args.add(draw, "--max-stages", ("2", "4"), ("0", "-1"), p_skip=2)
        args.add(draw, "--input-shape", ("8", "4,4"), ("0", "x", "-1,2", ",", "3,0"),
                 p_skip=2)
        args.argv.append("--no-progress")
        if draw(st.booleans()):
            args.argv += ["-o", output_path(draw, files, ".json", outputs, args)]
        return Case(args.argv, files, outputs, note="profile")
    argv = draw(st.sampled_from((
        [], ["bogus"], ["solve"], ["solve", "checkpoint"], ["--bogus"], ["verify"],
        ["show"], ["sweep"], ["compare", "checkpoint", "resnet-like-40"], ["export"],
        ["solve", "checkpoint", "resnet-like-40", "-m"], ["datasets", "list", "x", "y"],
        ["solve", "checkpoint", "resnet-like-40", "-m", "1GiB", "--bogus"],
        ["solve", "checkpoint", "resnet-like-40", "-m", "1GiB", "-m", "2GiB", "--json"],
        ["solve", "checkpoint", "resnet-like-40", "-m=1GiB"],
        ["solve", "checkpoint", "resnet-like-40", "--memory", "--json"],
        ["-h"], ["solve", "-h"], ["sweep", "--help"], ["\udcff"], ["solve", "\udcff"])))
    return Case(list(argv), note="command line")


@st.composite
def datasets_show_cases(draw: st.DrawFn, argv: list[str]) -> Case:
    """``datasets show FILE [--json]`` of a fuzzed chain file (stop 83: held terms shown).

    A damaged file must be named (with its stage and field); a valid one is shown, and
    :func:`_held_shown` checks the ``held`` object of ``--json`` against the file.
    """
    files: dict[str, Any] = {}
    spec, doc, chain_doc = draw(chain_arg(files))
    argv = [*argv, spec] + (["--json"] if draw(st.booleans()) else [])
    blame = "chain.json" if chain_doc.invalid and "chain.json" in files else None
    return Case(argv, files, [], blame, chain_doc.where if blame else None,
                chain_doc.note, must_fail=blame is not None)


def _held_shown(case: Case, out: Outcome) -> list[Failure]:
    """``datasets show FILE --json`` of a valid chain file: ``held`` lists exactly the
    file's non-zero held terms (absent when there is none)."""
    if out.code != 0 or case.argv[:2] != ["datasets", "show"] or "--json" not in case.argv \
            or case.argv[2] != "{d}/chain.json":
        return []
    data = json.loads(case.files["chain.json"].decode("utf-8-sig") if
                      case.files["chain.json"][:2] not in (b"\xff\xfe", b"\xfe\xff")
                      else case.files["chain.json"].decode("utf-16"))
    want: dict[str, Any] = {}
    for name in ("fwd_held", "bwd_held"):
        terms = [[i, int(s[name])] for i, s in enumerate(data["stages"], start=1)
                 if s.get(name)]
        if terms:
            want[name] = terms
    if isinstance(data.get("loss"), dict) and data["loss"].get("held"):
        want["loss.held"] = int(data["loss"]["held"])
    shown = json.loads(out.stdout).get("held", {})
    return [] if shown == want else [Failure("datasets show: held terms not as in the file",
                                             f"{shown} vs {want}")]


@st.composite
def cli_cases(draw: st.DrawFn, *, torch: bool = True) -> Case:
    """Any case, weighted towards the commands that read files (``torch``: see
    :func:`misc_cases`; the CI run, ``torch=False``, draws :func:`held_solve_cases` in a
    test of its own)."""
    kind = draw(st.sampled_from(("solve",) * 5 + ("compare", "export", "verify", "verify",
                                                  "verify", "show", "show", "sweep", "misc")
                                + (("held",) if torch else ())))
    if kind in ("solve", "compare", "export"):
        return draw(solve_cases(kind))
    if kind == "held":
        return draw(held_solve_cases())
    if kind == "misc":
        return draw(misc_cases(torch=torch))
    return draw({"verify": verify_cases, "show": show_cases, "sweep": sweep_cases}[kind]())


# ------------------------------------------------------------------ running
@dataclass
class Outcome:
    """What one run did."""

    code: int | None
    stdout: str
    stderr: str
    exception: str | None = None
    exception_type: str | None = None
    exception_where: str | None = None
    warnings: list[str] = field(default_factory=list)
    files_after: list[str] = field(default_factory=list)
    result: dict[str, Any] | None = None  # what ``solve`` printed (cases with ``replay``)
    replay: Outcome | None = None  # its replay by ``verify``
    held_floor: list[str] = field(default_factory=list)  # :func:`held_floor_breaks`


class CaseTimeout(BaseException):
    """Raised by the long run's alarm when a case takes too long."""


def run_cli(argv: Sequence[str], *, timeout_s: float | None = None) -> Outcome:
    """Run ``optmem.cli.main(argv)`` in this process with captured stdout and stderr.

    stdout is UTF-8 with strict errors (as a pipe in a UTF-8 locale), stderr backslash-escapes
    what it cannot encode (as Python's). ``SystemExit`` (``--help``) gives its code; any other
    exception is returned, not raised. Every warning is recorded.
    """
    from optmem.cli import main

    out_b, err_b = io.BytesIO(), io.BytesIO()
    out = io.TextIOWrapper(out_b, encoding="utf-8", errors="strict", write_through=True)
    err = io.TextIOWrapper(err_b, encoding="utf-8", errors="backslashreplace",
                           write_through=True)
    code: int | None = None
    exc_text = exc_type = exc_where = None
    old = sys.stdout, sys.stderr
    alarm = _set_alarm(timeout_s)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sys.stdout, sys.stderr = out, err
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - the oracle classifies it
            exc_text = traceback.format_exc()
            exc_type = type(exc).__name__
            exc_where = _innermost_optmem_frame(exc)
        finally:
            sys.stdout, sys.stderr = old
            if alarm:
                _clear_alarm()
    return Outcome(code, out_b.getvalue().decode("utf-8", "replace"),
                   err_b.getvalue().decode("utf-8", "replace"), exc_text, exc_type, exc_where,
                   [f"{w.category.__name__}: {w.message}" for w in caught])


def _set_alarm(timeout_s: float | None) -> bool:
    if not timeout_s:
        return False
    import signal

    def handler(signum: int, frame: Any) -> None:
        raise CaseTimeout(f"case took longer than {timeout_s} s")

    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    return True


def _clear_alarm() -> None:
    import signal

    signal.setitimer(signal.ITIMER_REAL, 0)


def _innermost_optmem_frame(exc: BaseException) -> str:
    where = "?"
    for frame in traceback.extract_tb(exc.__traceback__):
        if "optmem" in frame.filename and "fuzz_harness" not in frame.filename:
            where = f"{Path(frame.filename).name}:{frame.name}"
    return where


def materialise(case: Case, d: Path) -> None:
    """Write the case's files into directory ``d``."""
    for name, data in case.files.items():
        path = d / name
        if data is DIR:
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.write_bytes(data)


def listing(d: Path) -> list[str]:
    """Every path under ``d``, relative, sorted."""
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def run_case(case: Case, *, timeout_s: float | None = None,
             runner: Callable[[list[str]], Outcome] | None = None) -> Outcome:
    """Materialise ``case`` in a fresh directory, run it, and list what it left there."""
    with tempfile.TemporaryDirectory(prefix="optmem-fuzz-") as tmp:
        d = Path(tmp)
        materialise(case, d)
        argv = case.resolved(d)
        outcome = runner(argv) if runner else run_cli(argv, timeout_s=timeout_s)
        outcome.files_after = listing(d)
        if case.replay and outcome.code == 0 and not runner:
            replay_solved(case, outcome, d, timeout_s=timeout_s)
        outcome.stdout = outcome.stdout.replace(str(d), "{d}")
        outcome.stderr = outcome.stderr.replace(str(d), "{d}")
    return outcome


def solved_result(case: Case, out: Outcome, d: Path) -> dict[str, Any] | None:
    """The result object ``solve`` wrote: its ``--json`` stdout, else its ``-o`` file."""
    texts = [out.stdout] if "--json" in case.argv else []
    texts += [(d / name).read_text() for name in case.outputs if (d / name).is_file()]
    for text in texts:
        try:
            value = json.loads(text)
        except ValueError:
            continue
        if isinstance(value, dict) and "status" in value:
            return value
    return None


def replay_solved(case: Case, out: Outcome, d: Path, *, timeout_s: float | None) -> None:
    """Replay the plan ``solve`` found with ``verify`` (the independent simulator).

    Sets ``out.result`` to the printed result and, when it has a plan, ``out.replay`` to
    the outcome of :attr:`Case.replay` on it (the plan file is removed afterwards).
    """
    out.result = solved_result(case, out, d)
    if out.result is None or out.result.get("status") not in ("optimal", "feasible"):
        return
    plan = d / ".replay.json"
    plan.write_text(json.dumps(out.result))
    try:
        out.replay = run_cli([a.replace("{d}", str(d)) for a in case.replay or []],
                             timeout_s=timeout_s)
    finally:
        plan.unlink()
    if out.result.get("problem") in ("offload", "remat-offload"):
        from optmem.chain import Chain
        from optmem.errors import PlanError

        try:
            out.held_floor = held_floor_breaks(Chain.load(d / "chain.json"), out.result)
        except PlanError as exc:
            out.held_floor = [f"the plan does not replay on the file's chain: {exc}"]


def held_floor_breaks(chain: Any, result: dict[str, Any]) -> list[str]:
    """Prefetches between compute ops whose memory floor is above the reported peak.

    A prefetch that starts between two compute ops (CONTRACT section 10) needs at least
    what the last compute op left held (read here from the chain's ``fwd_held``,
    ``bwd_held``, ``loss_held``, not through the simulator's ``held_after``), the
    prefetched value and every other stored value surely on the GPU then (never moved so
    far, last prefetched, or last offloaded by a transfer not yet ended). The timeline
    (which prefetch starts between ops, when offloads end) is the simulator's; the floor
    is not.
    """
    from optmem.plan import Op, TransferKind, parse_mixed_plan
    from optmem.simulate.checkpoint import initial_state, transition, value_size
    from optmem.simulate.offload import simulate_offload

    if not chain.holds:
        return []
    chain = chain.quantize(result["unit"])
    plan = parse_mixed_plan(result["plan"])
    sim = simulate_offload(chain, plan, result["report"]["bandwidth_units"],
                           result["memory_limit"])
    link = {s.index: s for s in sim.link}
    steps = {s.index: s for s in sim.compute}
    stored, last, breaks = initial_state(), None, []
    moves: dict[Any, tuple[TransferKind, float]] = {}  # value -> its last transfer, end
    for k, op in enumerate(plan):
        if isinstance(op, Op):
            stored, last = transition(chain, stored, op)[0], (op, steps[k])
            continue
        t = link[k].start
        if op.kind is TransferKind.PREFETCH and last is not None and not (
                t < last[1].end - 1e-9 and last[1].end > last[1].start):
            held = _held_term(chain, last[0])
            floor = held + value_size(chain, op.key) + sum(
                value_size(chain, v) for v in stored if v != op.key and _on_gpu(moves, v, t))
            if floor > sim.peak_memory:
                breaks.append(f"op {k} {op} after {last[0]}: floor {floor} > peak "
                              f"{sim.peak_memory}")
        moves[op.key] = (op.kind, link[k].end)
    return breaks


def _held_term(chain: Any, op: Any) -> int:
    """What compute ``op`` leaves held, from the chain's fields (the oracle's own reading)."""
    from optmem.plan import OpKind

    if op.kind is OpKind.LOSS:
        return int(chain.loss_held)
    return int((chain.bwd_held if op.kind is OpKind.B else chain.fwd_held)[op.stage - 1])


def _on_gpu(moves: dict[Any, tuple[Any, float]], value: Any, t: float) -> bool:
    """Whether a stored ``value`` is surely on the GPU at time ``t``: never moved, last
    prefetched (reserved from its start), or last offloaded by a transfer not ended."""
    from optmem.plan import TransferKind

    if value not in moves:
        return True
    kind, end = moves[value]
    return kind is TransferKind.PREFETCH or end > t + 1e-9


def _replay_failures(case: Case, out: Outcome) -> list[Failure]:
    """A solve of a valid chain with good options: no ``error`` status, and a plan that
    ``verify`` replays with the claimed objective and peak, the peak within the limit."""
    result = out.result
    if result is None:
        return []
    if result.get("status") == "error":
        return [Failure("status error on valid input",
                        str(result.get("report", {}).get("error", ""))[:200])]
    fails = [Failure("held term not counted between ops", text) for text in out.held_floor]
    rep = out.replay
    if rep is None:
        return fails
    if rep.exception_type is not None or rep.code != 0:
        return fails + [Failure("solved plan does not replay",
                                (rep.stderr or rep.exception or "")[-300:])]
    verified = json.loads(rep.stdout)
    if verified.get("unit") != result.get("unit"):
        return fails  # discretised differently (a method's own unit): nothing to compare
    if not math.isclose(verified["objective"], result["objective"], rel_tol=1e-6,
                        abs_tol=1e-9):
        fails.append(Failure("claimed objective is not the replayed one",
                             f"{result['objective']} vs {verified['objective']}"))
    peak, limit = verified.get("peak_memory"), result.get("memory_limit")
    if peak != result.get("peak_memory") or (limit is not None and peak > limit):
        fails.append(Failure("replayed peak differs or exceeds the limit",
                             f"{result.get('peak_memory')} vs {peak}, limit {limit}"))
    return fails


@dataclass(frozen=True)
class Failure:
    """One broken promise: a class (for grouping) and the details."""

    klass: str
    detail: str


HIDDEN_WARNINGS = ("DeprecationWarning", "PendingDeprecationWarning", "ImportWarning",
                   "ResourceWarning")  # Python does not show these to users by default
_ENGINE_OR_INPUT = re.compile(r"^(OptmemInputError|PlanError|ChainError|UnavailableError)\b")


def check_case(case: Case, out: Outcome) -> list[Failure]:
    """The oracle: every promise of the CLI contract that ``out`` breaks."""
    fails: list[Failure] = []
    if out.exception_type is not None:
        last = out.exception.strip().splitlines()[-1] if out.exception else ""
        return [Failure(f"traceback {out.exception_type} at {out.exception_where}", last[:300])]
    if out.code not in (0, 2):
        fails.append(Failure(f"exit {out.code}", out.stdout[-300:] + out.stderr[-300:]))
    stderr_lines = out.stderr.splitlines()
    if "Traceback" in out.stderr:
        fails.append(Failure("traceback on stderr", out.stderr[-300:]))
    if out.code == 2:
        if len(stderr_lines) != 1 or not stderr_lines[0].startswith("optmem: error: "):
            fails.append(Failure("exit 2 without exactly one error line",
                                 repr(out.stderr[:300])))
        message = out.stderr
        if case.blame and "{d}/" + case.blame not in message and \
                "{d}/" + case.blame.rstrip("/") not in message:
            fails.append(Failure("error does not name the file", f"{case.blame}: {message!r}"))
        if case.blame and case.where:
            stage, name = case.where
            if (stage is not None and f"stage {stage}" not in message) or name not in message:
                fails.append(Failure("error does not name the stage and field",
                                     f"{case.where}: {message!r}"))
    elif case.must_fail and out.code == 0:
        fails.append(Failure("invalid file accepted", f"{case.blame}: {case.note}"))
    # nothing written half-way: outputs only after success, no temporary files ever
    inputs = set(case.files)
    for name in out.files_after:
        top = name.split(os.sep)[0]
        if top in inputs and case.files[top] is DIR and name != top:
            fails.append(Failure("file written into an input directory", name))
        elif top in inputs:
            continue
        elif out.code != 0:
            fails.append(Failure("output left after a failing run", name))
        elif name not in case.outputs:
            fails.append(Failure("unexpected file written", name))
    if out.code == 0 and "--json" in case.argv and case.argv[0] in ("solve", "compare",
                                                                     "verify", "datasets"):
        try:
            json.loads(out.stdout, parse_constant=_reject_constant)
        except ValueError as exc:
            fails.append(Failure("stdout is not one strict JSON value", str(exc)[:200]))
    for w in out.warnings:
        if w.split(":")[0] not in HIDDEN_WARNINGS:
            fails.append(Failure(f"warning {w.split(':')[0]}", w[:200]))
    fails += _hidden_exceptions(case, out)
    fails += _replay_failures(case, out)
    fails += _held_shown(case, out)
    return fails


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _hidden_exceptions(case: Case, out: Outcome) -> list[Failure]:
    """``compare`` and ``sweep`` turn method crashes into rows; a Python exception there is a
    crash all the same (input errors and engine reports are fine)."""
    texts: list[str] = []
    if out.code == 0 and case.argv[:1] == ["compare"] and "--json" in case.argv:
        try:
            data = json.loads(out.stdout)
            texts = [str(r.get("report", {}).get("error", "")) for r in data.get("results", [])
                     if r.get("status") == "error"]
        except (ValueError, AttributeError):
            texts = []
    elif out.code == 0 and case.argv[:1] == ["compare"]:
        texts = [line for line in out.stdout.splitlines() if " error " in f" {line} "]
    elif case.argv[:1] == ["sweep"]:
        texts = [line.split(": ", 2)[-1] for line in out.stderr.splitlines()
                 if line.startswith("error: ")]
    fails = []
    for text in texts:
        m = re.match(r"^([A-Za-z_]*(Error|Exception|Warning))\b", text.strip())
        if m and not _ENGINE_OR_INPUT.match(text.strip()):
            fails.append(Failure(f"hidden {m.group(1)} in {case.argv[0]}", text[:200]))
        elif case.argv[0] == "compare" and "--json" in case.argv and not m and text:
            continue
    return fails


def failure_report(case: Case, out: Outcome, fails: list[Failure]) -> str:
    """Text for an assertion message: the case, what it did, what broke."""
    return json.dumps({"case": case.describe(), "code": out.code, "stdout": out.stdout[-500:],
                       "stderr": out.stderr[-1000:], "exception": out.exception,
                       "files_after": out.files_after,
                       "failures": [f"{f.klass}: {f.detail}" for f in fails]}, indent=1)
