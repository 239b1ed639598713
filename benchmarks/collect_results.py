"""Assemble benchmarks/RESULTS.md from the per-area files in benchmarks/results/.

Each area's benchmark script writes (or its author records) ``results/<area>.md``; this
script concatenates them in a fixed order under one table of contents, demoting headings one
level, so RESULTS.md never disagrees with the per-area files. Run it after a benchmark.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

HERE = Path(__file__).parent
ORDER = ["checkpoint_dp", "exact", "time_limits", "highs_pass", "checkpoint_exact",
         "cpsat_linearization", "zoo", "pytorch",
         "hf_autotune_memory",
         "hf_overhead",
         "hf_paired",
         "hf_paired_readby", "hf_paired_joint", "hf_early_stop", "hf_quiet4", "hf_autotune",
         "hf_fastpath", "compile_dropout", "retain_graph",
         "hf_quiet3", "hf_quiet3_repeat", "hf_quiet",
         "hf_bert_target1", "hf_bert_tie", "hf_gpt2_llama_floor", "hf",
         "hf_segment_quiet",
         "hf_segment", "memory", "hf_zoo", "offload",
         "offload_exact", "remat_offload", "remat_offload_exact", "remat_offload_proofs",
         "pipeline_exact", "pipeline_fixed", "pipeline_linearization", "pipeline",
         "madpipe_speed", "pipeline_min_memory", "pipeline_strict", "pipeline_runtime",
         "min_peak", "fuzz", "hunts"]
INTRO = """# Benchmark results

Measured on this project's machine: 2 shared vCPUs, 24 GiB, no GPU, Python 3.11. Other jobs
often shared the cores while these ran, so absolute times vary by 2-3x; ratios measured back to
back are the meaningful figures. Each section comes from `benchmarks/results/<area>.md`,
written next to its script `benchmarks/bench_<area>.py` (`--quick` for a short run); plots are
in `benchmarks/results/`. This file is assembled by `benchmarks/collect_results.py`.
"""


def demote(text: str) -> str:
    """Add one ``#`` to every Markdown heading (outside code fences)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        out.append("#" + line if not fenced and re.match(r"#+ ", line) else line)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    """Write RESULTS.md (or ``--out``)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md",
                        help="write here (default benchmarks/RESULTS.md; its links are "
                             "relative to benchmarks/)")
    args = parser.parse_args(argv)
    files = {p.stem: p for p in (HERE / "results").glob("*.md")}
    names = [n for n in ORDER if n in files] + sorted(set(files) - set(ORDER))
    parts = [INTRO, "## Contents\n"]
    parts += [f"- [{n}](results/{n}.md)" for n in names]
    for name in names:
        parts.append("\n" + demote(files[name].read_text().strip()) + "\n")
    args.out.write_text("\n".join(parts) + "\n")
    print(f"wrote {args.out} from {len(names)} files")


if __name__ == "__main__":
    main()
