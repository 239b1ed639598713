"""Regenerate the bundled chain files of the model zoo (needs torch; deterministic).

Run ``python -m optmem.pytorch.build_datasets`` (all files) or
``python -m optmem.pytorch.build_datasets resnet101-b8-1000`` (some). It lives in the torch
bridge because it profiles with torch; :mod:`optmem.datasets` itself imports only the core.
Every file is profiled on the meta device by
:func:`optmem.pytorch.zoo.zoo_chain`: exact sizes from shapes, FLOPs from
``torch.utils.flop_counter``, times from the V100 roofline model of
:mod:`optmem.pytorch.devices` (the papers' GPU). Times are rounded to nanoseconds so that
files are byte-identical across runs. Each file carries ``description``, ``parameters``,
``model`` (zoo name, batch, resolution) and ``provenance``.

The settings are those of the papers' experiments (``shared/design/rotor.md`` section 7,
``offload.md`` section 6): ResNet/DenseNet/Inception at 224 (or 299), 500 and 1000 pixels
with power-of-two batches, ResNet-101 at 1000x1000 with batches 1-8 (rotor Fig. 3),
ResNet-1001 at 224x224 with batches 1-8 (Fig. 4; the 4x wider variant, whose store-all
estimate, 224 GiB at batch 8, matches the paper's 225 GiB; He et al.'s widths at batch 8),
batch 16 at 500x500 (the pofo setting), plus VGG, U-Net, ViT-B/16 and GPT-2 at sequence
length 1024.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from optmem.datasets import DATA_DIR

# (zoo model, batch, resolution or sequence length, note)
SETTINGS: list[tuple[str, int, int, str]] = [
    ("resnet18", 64, 224, "rotor/offload experiments, 224 px"),
    ("resnet50", 32, 224, "rotor/offload experiments, 224 px; offload [T] Fig. 3.5 top"),
    ("resnet101", 32, 224, "rotor/offload experiments, 224 px"),
    ("resnet152", 32, 224, "rotor/offload experiments, 224 px"),
    ("resnet50", 16, 500, "pofo setting (offload.md 6.2): batch 16, 500 px"),
    ("resnet101", 16, 500, "pofo setting (offload.md 6.2): batch 16, 500 px"),
    ("resnet152", 16, 500, "pofo setting (offload.md 6.2): batch 16, 500 px"),
    ("resnet101", 1, 1000, "rotor RR Fig. 3 / thesis Fig. 2.5"),
    ("resnet101", 2, 1000, "rotor RR Fig. 3 / thesis Fig. 2.5"),
    ("resnet101", 4, 1000, "rotor RR Fig. 3 / thesis Fig. 2.5"),
    ("resnet101", 8, 1000, "rotor RR Fig. 3 / thesis Fig. 2.5"),
    ("resnet1001", 8, 224, "He et al. widths; 339 stages"),
    ("resnet1001-w64", 1, 224, "rotor RR Fig. 4 / thesis Fig. 2.6"),
    ("resnet1001-w64", 2, 224, "rotor RR Fig. 4 / thesis Fig. 2.6"),
    ("resnet1001-w64", 4, 224, "rotor RR Fig. 4 / thesis Fig. 2.6"),
    ("resnet1001-w64", 8, 224, "rotor RR Fig. 4 / thesis Fig. 2.6"),
    ("densenet121", 32, 224, "rotor/offload experiments, 224 px"),
    ("densenet121", 16, 500, "rotor/offload experiments, 500 px"),
    ("densenet121", 8, 1000, "rotor/offload experiments, 1000 px"),
    ("densenet169", 16, 500, "pofo setting (offload.md 6.2): batch 16, 500 px"),
    ("inception3", 32, 299, "rotor/offload experiments, Inception v3"),
    ("inception3", 16, 500, "pofo setting (offload.md 6.2): batch 16, 500 px"),
    ("vgg16", 64, 224, "VGG-16, ImageNet size"),
    ("vgg19", 64, 224, "VGG-19, ImageNet size"),
    ("unet", 4, 512, "U-Net segmentation, 512x512"),
    ("vit-b16", 64, 224, "ViT-B/16, ImageNet size"),
    ("gpt2-small", 8, 1024, "GPT-2 small, sequence length 1024"),
    ("gpt2-medium", 4, 1024, "GPT-2 medium, sequence length 1024"),
    ("gpt2-large", 2, 1024, "GPT-2 large, sequence length 1024"),
]


def dataset_name(model: str, batch: int, size: int) -> str:
    """File stem of one setting, e.g. ``resnet101-b8-1000``."""
    return f"{model}-b{batch}-{size}"


def _round_times(data: dict[str, Any]) -> dict[str, Any]:
    for stage in data["stages"]:
        for key in ("fwd_time", "bwd_time"):
            stage[key] = round(stage[key], 6)
    data["loss"]["bwd_time"] = round(data["loss"]["bwd_time"], 6)
    return data


def build_one(model: str, batch: int, size: int, note: str, device: str = "v100") -> dict:
    """Profile one setting and return its chain file as a dictionary (with ``summary``)."""
    from optmem.chain import Chain
    from optmem.pytorch.zoo import get_model, zoo_chain
    from optmem.solvers.dataset_summary import compute_summary

    entry = get_model(model)
    kind = "tokens" if entry.input == "tokens" else "px"
    shape = f"sequence length {size}" if kind == "tokens" else f"{size}x{size}"
    desc = (f"{entry.description}, batch {batch}, {shape}, float32; meta-device sizes, "
            f"{device.upper()} roofline times ({note})")
    chain = zoo_chain(model, batch, size, device=device,
                      chain_name=dataset_name(model, batch, size),
                      extra={"description": desc})
    data = _round_times(chain.to_dict())
    data["summary"] = compute_summary(Chain.from_dict(data))
    return data


def main(argv: list[str] | None = None) -> int:
    """Regenerate the selected (default: all) bundled zoo chain files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="dataset names to rebuild (default: all)")
    parser.add_argument("--out", type=Path, default=DATA_DIR)
    args = parser.parse_args(argv)
    wanted = set(args.names)
    for model, batch, size, note in SETTINGS:
        name = dataset_name(model, batch, size)
        if wanted and name not in wanted:
            continue
        start = time.perf_counter()
        data = build_one(model, batch, size, note)
        path = args.out / f"{name}.json"
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"{name}: {len(data['stages'])} stages, {path.stat().st_size // 1024} KiB, "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
