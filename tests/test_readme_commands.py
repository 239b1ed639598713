"""README.md's commands and code blocks, and docs/pytorch.md's first blocks, run as written.

* Every ``.venv/bin/optmem`` line of the ````bash`` block of README.md's "Solve an instance"
  runs through ``optmem.cli.main`` in document order in one temporary directory, where
  ``my_chain.json`` is the bundled ``resnet50-b32-224`` chain saved as a chain file (the
  README's stand-in for the user's chain), so ``verify`` and ``show`` read the plan that the
  ``solve ... --json -o plan.json`` line wrote.
  Each line must exit 0 and print what the README says it does (a summary, a table or a JSON
  object with status optimal or feasible; the files named by ``-o`` / ``--plot`` written).
  One line gets an added deterministic work limit: the pipeline ``compare`` with
  ``family=all`` (README: "proven optimum (40 s)", 35-95 s here on 2 shared cores) runs
  with ``--option family_limit=1 --threads 1`` (see ``LIMITED``): the complete family is
  not asked (the chunk scan finds the same plan, 23.8976 ms, without the proof, in about
  11 s) and the scan's questions, deterministic CP-SAT work on one thread, are the same on
  any machine and load. ``--work-budget`` and ``--deterministic-time`` do not shorten it
  (the head pass goes to one worker: 86 s at ``--work-budget 5``). Every other line runs
  as written.
* The "From Python" block is executed as written, except that its ``compare`` options
  bound the work (``work_budget``, one thread) instead of the wall clock
  (``time_limit_s=30``), so that the ILP's status does not depend on the load.
* The "Use it in PyTorch" block is executed with ``torch.nn.Sequential(...)`` replaced by a
  small CNN and the sample's ``224, 224`` by ``32, 32`` (CPU time); the gradients it leaves
  on the model must equal, bit for bit, those of the plain model on the same batch. It runs
  at the README's ``"2GiB"`` (the store-all fast path) and at the ``"60%"`` its comment
  names (a real checkpointing plan).
* docs/pytorch.md: the five-minute Llama block (a 2-layer Llama, short ``ids``, a two-batch
  ``loader``), the "What the limit means" block (``memory_limit=...`` given as ``"60%"``)
  and the offload block (``batch`` a small image batch, limits the CNN fits) are executed.

The examples are run by other tests: ``examples/train_checkpointed.py``
(``test_pytorch_api.py``), ``examples/hf_checkpointed.py`` (``test_hf_wrapper.py``), the
distributed ones (``test_distributed_examples.py``). No timing is checked.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch

from optmem.chain import Chain
from optmem.cli import main
from optmem.datasets import load_dataset

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PYTORCH_DOC = ROOT / "docs" / "pytorch.md"
PREFIX = ".venv/bin/optmem "
OK = ("optimal", "feasible")
N_COMMANDS = 15
# the one command given a deterministic work limit (module docstring)
LIMITED = {"compare pipeline resnet18-b64-224": ["--option", "family_limit=1", "--threads", "1"]}


def section(doc: Path, title: str) -> str:
    """The text of ``doc`` under the heading ``## title``, up to the next ``## `` heading."""
    text = doc.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def blocks(text: str, lang: str) -> list[str]:
    """The bodies of the fenced blocks of ``lang`` in ``text``."""
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.S | re.M)


def readme_commands() -> list[str]:
    """The optmem lines of "Solve an instance" (comments dropped), in document order."""
    (body,) = blocks(section(README, "Solve an instance"), "bash")
    lines = [line.split(" #")[0].strip() for line in body.replace("\\\n", " ").splitlines()]
    lines = [line for line in lines if line]
    assert all(line.startswith(PREFIX) for line in lines), lines
    return lines


def argv_of(line: str) -> list[str]:
    """The CLI arguments of ``line``, with the limit added where ``LIMITED`` says."""
    words = shlex.split(line[len(PREFIX):])
    for key, extra in LIMITED.items():
        if " ".join(words).startswith(key):
            words += extra
    return words


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``optmem.cli.main(argv)``: ``(exit code, stdout, stderr)``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[Any, ...]]]:
    """Every README command run in order in one directory: ``(line, argv, code, out, err)``."""
    torch.set_num_threads(1)
    work = tmp_path_factory.mktemp("readme")
    load_dataset("resnet50-b32-224").save(work / "my_chain.json")
    runs = []
    with contextlib.chdir(work):
        for line in readme_commands():
            argv = argv_of(line)
            code, out, err = run_cli(argv)
            runs.append((line, argv, code, out, err))
    return work, runs


def status_of(out: str) -> str:
    """The ``status`` line of a readable summary."""
    match = re.search(r"^status\s+(\S+)", out, re.M)
    assert match, out
    return match.group(1)


def table_statuses(out: str, methods: list[str]) -> dict[str, str]:
    """The status of each of ``methods`` in a ``compare`` table."""
    found = {}
    for row in out.splitlines():
        cells = row.split()
        if len(cells) > 1 and cells[0] in methods:
            found[cells[0]] = cells[1]
    assert set(found) == set(methods), out
    return found


def check_output(work: Path, argv: list[str], out: str) -> None:
    """What the README says each command does, on its output and files."""
    command = argv[0]
    for flag in ("-o", "--plot"):
        if flag in argv:
            written = work / argv[argv.index(flag) + 1]
            assert written.stat().st_size > 0, written
    if command == "datasets":
        named = {line.split()[0] for line in out.splitlines()[1:]}
        chains = {argv_of(line)[2] for line in readme_commands()
                  if argv_of(line)[0] in ("solve", "compare", "export", "sweep")}
        used = {name for name in chains if not name.endswith(".json")}
        assert len(used) >= 5 and used <= named, (named, used)   # the chains used below
    elif command == "solve" and "--json" in argv:
        data = json.loads(out)
        assert data["status"] in OK and data["peak_memory"] <= data["memory_limit"]
        assert data["plan"] and json.loads((work / argv[argv.index("-o") + 1]).read_text()) == data
    elif command == "solve":
        assert status_of(out) in OK, out
    elif command == "compare":
        listed = argv[argv.index("--methods") + 1].split(",") if "--methods" in argv else ["dp"]
        methods = ["ilp:full" if m == "ilp" else m for m in listed]
        statuses = table_statuses(out, methods)
        assert statuses[methods[0]] == "optimal", out   # the DP or contiguous optimum
        assert all(s in (*OK, "infeasible") for s in statuses.values()), out
    elif command == "verify":
        assert out.startswith("valid plan: objective"), out
    elif command == "export":
        assert "wrote" in out
    elif command == "sweep":
        assert "plot written to" in out and "dp" in out
    elif command == "show":
        assert "makespan" in out and "picture written to" in out
    elif command == "profile":
        assert Chain.load(work / argv[argv.index("-o") + 1]).length > 1


def test_readme_block_is_parsed() -> None:
    """The block is found and every line of it is a command the tests below run."""
    lines = readme_commands()
    assert len(lines) == N_COMMANDS, lines
    commands = {shlex.split(line)[1] for line in lines}
    assert commands == {"datasets", "solve", "compare", "verify", "export", "sweep", "show",
                        "profile"}
    assert sum(any(" ".join(argv_of(line)).startswith(k) for k in LIMITED)
               for line in lines) == len(LIMITED)


@pytest.mark.parametrize("index", range(N_COMMANDS))
def test_readme_command(cli_runs: tuple[Path, list[tuple[Any, ...]]], index: int) -> None:
    """README command ``index`` exits 0 and prints what the README says it does."""
    work, runs = cli_runs
    line, argv, code, out, err = runs[index]
    assert code == 0, f"{line}\n{out[-2000:]}\n{err[-2000:]}"
    check_output(work, argv, out)


def exec_block(code: str, namespace: dict[str, Any] | None = None) -> str:
    """Execute ``code`` in ``namespace``; returns what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<doc block>", "exec"), namespace if namespace is not None else {})
    return out.getvalue()


def replaced(code: str, old: str, new: str) -> str:
    """``code`` with ``old`` (which must be there) replaced by ``new``."""
    assert old in code, (old, code)
    return code.replace(old, new)


def test_readme_from_python() -> None:
    """The "From Python" block prints the DP's result and one line per compared method."""
    (code,) = blocks(section(README, "Solve an instance"), "python")
    code = replaced(code, "SolveOptions(time_limit_s=30)", "SolveOptions(work_budget=30, "
                    "threads=1)")
    first, *rows = exec_block(code).splitlines()
    status, objective, peak, *_ = first.split()
    assert status == "optimal" and int(peak) <= 2 * 2**30, first
    methods = {row.split()[0]: row.split() for row in rows}
    assert {"dp", "chen", "ilp"} <= set(methods), rows
    assert methods["ilp"][2] == "optimal" and float(methods["ilp"][3]) == float(objective)


def small_cnn() -> torch.nn.Sequential:
    """The stand-in for the README's ``torch.nn.Sequential(...)``."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, padding=1, stride=2), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10))


def plain_gradients(model: torch.nn.Module, sample: torch.Tensor,
                    labels: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of a fresh copy of ``model`` after one plain step on ``sample``."""
    plain = copy.deepcopy(model)
    plain.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(plain(sample), labels).backward()
    return [p.grad for p in plain.parameters()]


@pytest.mark.parametrize("limit", ['"2GiB"', '"60%"'])
def test_readme_pytorch_block(limit: str) -> None:
    """The "Use it in PyTorch" block trains the small CNN with the plain model's gradients."""
    torch.set_num_threads(1)
    (code,) = blocks(section(README, "Use it in PyTorch"), "python")
    code = replaced(code, "torch.nn.Sequential(...)", "small_cnn()")
    code = replaced(code, "torch.randn(32, 3, 224, 224)", "torch.randn(32, 3, 32, 32)")
    code = replaced(code, 'memory_limit="2GiB"', f"memory_limit={limit}")
    namespace: dict[str, Any] = {"small_cnn": small_cnn}
    printed = exec_block(code, namespace)
    assert printed.strip() == namespace["cmodel"].summary().strip() and printed.strip()
    model, sample = namespace["model"], namespace["sample"]
    got = [p.grad for p in model.parameters()]
    want = plain_gradients(model, sample, torch.zeros(32, dtype=torch.long))
    assert all(g is not None and torch.equal(g, w) for g, w in zip(got, want, strict=True))
    if limit == '"60%"':
        assert "F_none" in " ".join(namespace["cmodel"].result.plan)   # a real plan


def pytorch_doc_block(title: str, index: int = 0) -> str:
    """Python block ``index`` of the docs/pytorch.md section ``title``."""
    return blocks(section(PYTORCH_DOC, title), "python")[index]


def test_pytorch_doc_five_minute_start() -> None:
    """The five-minute Llama block runs on a 2-layer Llama and two short batches."""
    torch.set_num_threads(1)
    import transformers
    code = pytorch_doc_block("Five-minute start")
    code = replaced(code, "LlamaConfig(num_hidden_layers=12, hidden_size=256, ...)",
                    "LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, "
                    "num_attention_heads=4, num_key_value_heads=4, vocab_size=128)")
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    loader = [(ids, torch.ones_like(ids)), (torch.randint(0, 128, (2, 16)), torch.ones_like(ids))]
    namespace: dict[str, Any] = {"ids": ids, "loader": loader}
    printed = exec_block(code, namespace)
    assert namespace["cmodel"].summary().strip() == printed.strip()
    assert isinstance(namespace["out"], transformers.modeling_outputs.CausalLMOutputWithPast)
    assert torch.isfinite(namespace["out"].loss)


def test_pytorch_doc_limit_block() -> None:
    """The "What the limit means" block profiles, solves and re-solves the small CNN."""
    torch.set_num_threads(1)
    code = replaced(pytorch_doc_block("What the limit means, and how to pick one"),
                    "memory_limit=...,", 'memory_limit="60%",')
    model, sample = small_cnn(), torch.randn(8, 3, 32, 32)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out, torch.zeros(8, dtype=torch.long))

    import optmem.pytorch as op
    namespace: dict[str, Any] = {"model": model, "sample": sample, "loss_fn": loss_fn, "op": op}
    exec_block(code, namespace)
    cmodel, chain = namespace["cmodel"], namespace["chain"]
    assert op.smallest_limit(chain) < chain.store_all_peak()
    assert cmodel.expected_peak_bytes <= int(0.6 * chain.store_all_peak())
    assert "Loss" in cmodel.result.plan


def test_pytorch_doc_offload_block() -> None:
    """The offload block wraps the small CNN both ways; each trains as the plain model."""
    torch.set_num_threads(1)
    code = pytorch_doc_block("Offloading and remat + offload in one call")
    import optmem.pytorch as op
    model, batch = small_cnn(), torch.randn(8, 3, 32, 32)
    labels = torch.zeros(8, dtype=torch.long)
    namespace: dict[str, Any] = {"model": model, "batch": batch, "op": op}
    exec_block(code, namespace)
    want = plain_gradients(model, batch, labels)
    for name in ("omodel", "rmodel"):
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(namespace[name](batch), labels).backward()
        got = [p.grad for p in model.parameters()]
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), name
