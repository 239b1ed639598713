"""Model zoo: real architectures written as flat ``nn.Sequential`` chains of blocks.

torchvision cannot be installed beside the CPU build of torch here, so optmem defines the
networks of the papers' experiments itself (parameter counts match the published ones, see
``tests/test_zoo.py``):

===============  ========================  ===========  ==================================
name             module                    parameters   input
===============  ========================  ===========  ==================================
resnet18/34/50   :mod:`.resnet`            11.7/21.8/   images (default 224)
/101/152/200                               25.6/44.5/
                                           60.2/64.7 M
resnet1001       :mod:`.resnet` (pre-act)  10.6 M       images (CIFAR design, default 224;
                                                        10.3 M with 10 classes)
resnet1001-w64   :mod:`.resnet` (pre-act)  164.4 M      the same, 4x wider (rotor's variant)
densenet121/169  :mod:`.densenet`          8.0/14.1 M   images (default 224)
vgg16/19         :mod:`.vgg`               138/144 M    images (default 224)
inception3       :mod:`.inception`         23.8 M       images (default 299)
unet             :mod:`.unet`              31.0 M       images (default 512, divisible by 16)
gpt2-small/      :mod:`.gpt2`              124/355/     token ids (default length 1024)
medium/large                               774 M
vit-b16          :mod:`.vit`               86.6 M       images (default 224)
===============  ========================  ===========  ==================================

Importing this package does not import torch; :meth:`ZooModel.build` does. Build on the
meta device (``zoo_chain`` does) to profile any size for free.

Examples
--------
>>> ZOO["resnet101"].published_params
44549160
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from optmem.errors import OptmemInputError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from optmem.chain import Chain
    from optmem.pytorch.devices import DeviceModel


@dataclass(frozen=True)
class ZooModel:
    """One named architecture of the zoo.

    Parameters
    ----------
    name
        Registry name (``resnet101``).
    module, factory, kwargs
        ``optmem.pytorch.zoo.<module>.<factory>(**kwargs)`` builds it.
    input
        ``"image"`` (batch, 3, size, size) or ``"tokens"`` (batch, size) of int64 ids.
    size
        Default resolution or sequence length.
    loss
        ``"classification"``, ``"segmentation"`` or ``"language"`` (cross-entropy each).
    published_params
        Parameter count of the reference implementation.
    description
        One line for listings.
    """

    name: str
    module: str
    factory: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    input: str = "image"
    size: int = 224
    loss: str = "classification"
    published_params: int = 0
    description: str = ""

    def build(self, size: int | None = None, **kwargs: Any) -> nn.Module:
        """The model (on the current default device: wrap in ``torch.device("meta")``)."""
        mod = importlib.import_module(f"optmem.pytorch.zoo.{self.module}")
        args = dict(self.kwargs)
        if self.module == "vit":
            args["image"] = size or self.size
        args.update(kwargs)
        return getattr(mod, self.factory)(**args)

    def sample(self, batch: int, size: int | None = None,
               device: str | torch.device | None = "meta") -> torch.Tensor:
        """A chain input ``a^0`` of ``batch`` samples (float32 images or int64 ids).

        ``device=None`` uses the current default device (``with torch.device(...)``).
        """
        import torch

        size = size or self.size
        if self.input == "tokens":
            return torch.zeros(batch, size, dtype=torch.long, device=device)
        return torch.randn(batch, 3, size, size, device=device)

    def loss_fn(self) -> Callable[[Any], torch.Tensor]:
        """Cross-entropy against all-zero targets, shaped for this model's output."""
        import torch
        import torch.nn.functional as F

        def loss(y: torch.Tensor) -> torch.Tensor:
            if self.loss == "language":
                flat = y.reshape(-1, y.shape[-1])
                target = torch.zeros(flat.shape[0], dtype=torch.long, device=y.device)
                return F.cross_entropy(flat, target)
            if self.loss == "segmentation":
                target = torch.zeros(y.shape[0], *y.shape[2:], dtype=torch.long,
                                     device=y.device)
                return F.cross_entropy(y, target)
            target = torch.zeros(y.shape[0], dtype=torch.long, device=y.device)
            return F.cross_entropy(y, target)

        return loss


def _z(name: str, module: str, factory: str, params: int, desc: str,
       kwargs: dict[str, Any] | None = None, **fields: Any) -> ZooModel:
    return ZooModel(name, module, factory, kwargs or {}, published_params=params,
                    description=desc, **fields)


ZOO: dict[str, ZooModel] = {z.name: z for z in (
    _z("resnet18", "resnet", "resnet", 11_689_512, "ResNet-18 (He et al. 2016)", {"depth": 18}),
    _z("resnet34", "resnet", "resnet", 21_797_672, "ResNet-34 (He et al. 2016)", {"depth": 34}),
    _z("resnet50", "resnet", "resnet", 25_557_032, "ResNet-50 (He et al. 2016)", {"depth": 50}),
    _z("resnet101", "resnet", "resnet", 44_549_160, "ResNet-101 (He et al. 2016)", {"depth": 101}),
    _z("resnet152", "resnet", "resnet", 60_192_808, "ResNet-152 (He et al. 2016)", {"depth": 152}),
    _z("resnet200", "resnet", "resnet", 64_673_832, "ResNet-200 (He et al. 2016)", {"depth": 200}),
    _z("resnet1001", "resnet", "preact_resnet", 10_582_136,
       "pre-activation ResNet-1001 (He et al. ECCV 2016), 339 stages", {"depth": 1001}),
    _z("resnet1001-w64", "resnet", "preact_resnet", 164_431_400,
       "pre-activation ResNet-1001, 4x wider (width 64): the rotor experiments' variant",
       {"depth": 1001, "width": 64}),
    _z("densenet121", "densenet", "densenet", 7_978_856, "DenseNet-121 (Huang et al. 2017)",
       {"depth": 121}),
    _z("densenet169", "densenet", "densenet", 14_149_480, "DenseNet-169 (Huang et al. 2017)",
       {"depth": 169}),
    _z("vgg16", "vgg", "vgg", 138_357_544, "VGG-16 (Simonyan and Zisserman 2015)", {"depth": 16}),
    _z("vgg19", "vgg", "vgg", 143_667_240, "VGG-19 (Simonyan and Zisserman 2015)", {"depth": 19}),
    _z("inception3", "inception", "inception_v3", 23_834_568,
       "Inception-v3 main path (Szegedy et al. 2016)", size=299),
    _z("unet", "unet", "unet", 31_031_810, "U-Net (Ronneberger et al. 2015), 2 classes",
       size=512, loss="segmentation"),
    _z("gpt2-small", "gpt2", "gpt2", 124_439_808, "GPT-2 small (124M)", {"size": "small"},
       size=1024,
       input="tokens", loss="language"),
    _z("gpt2-medium", "gpt2", "gpt2", 354_823_168, "GPT-2 medium (355M)", {"size": "medium"},
       size=1024,
       input="tokens", loss="language"),
    _z("gpt2-large", "gpt2", "gpt2", 774_030_080, "GPT-2 large (774M)", {"size": "large"},
       size=1024,
       input="tokens", loss="language"),
    _z("vit-b16", "vit", "vit", 86_567_656, "ViT-B/16 (Dosovitskiy et al. 2021)", {"name": "b16"}),
)}


def get_model(name: str) -> ZooModel:
    """The zoo entry called ``name``; unknown names get one clear error."""
    key = name.lower()
    if key not in ZOO:
        raise OptmemInputError(
            f"no zoo model named {name!r} (expected one of {', '.join(ZOO)})", field="model")
    return ZOO[key]


def zoo_chain(
    name: str, batch: int, size: int | None = None, *,
    device: str | DeviceModel | None = "v100", chain_name: str | None = None,
    extra: dict[str, Any] | None = None, repeats: int = 3,
) -> Chain:
    """Profile zoo model ``name``: exact sizes on the meta device, estimated or measured times.

    Parameters
    ----------
    name
        Zoo name (``resnet101``).
    batch, size
        Batch size and resolution (or sequence length; default :attr:`ZooModel.size`).
    device
        A device model (or its name: ``v100``, ``a100``, ``h100``, see
        :mod:`optmem.pytorch.devices`) estimating the times by a roofline; ``"cpu"`` or
        ``"cuda"`` to *measure* them on this machine with the torch bridge
        (:func:`optmem.pytorch.profile.profile_chain`, median of ``repeats`` runs; the
        model is then really built and run, so keep the sizes small on CPU); ``None`` for
        no times (all 0).
    chain_name
        Name of the chain (default ``<name>-b<batch>-<size>``).
    extra
        Extra top-level fields (``description``).
    repeats
        Timed runs per stage when measuring.
    """
    import torch

    from optmem.pytorch.shapeprofile import profile_meta

    model = get_model(name)
    size = size or model.size
    with torch.device("meta"):
        net = model.build(size)
    net.train()
    fields = {"model": {"zoo": model.name, "batch": batch,
                        ("sequence_length" if model.input == "tokens" else "resolution"): size,
                        "dtype": "float32"}}
    fields.update(extra or {})
    measure = isinstance(device, str) and device.split(":")[0] in ("cpu", "cuda")
    chain = profile_meta(net, model.sample(batch, size), loss_fn=model.loss_fn(),
                         device=None if measure else device,
                         name=chain_name or f"{model.name}-b{batch}-{size}", extra=fields)
    if not measure:
        return chain
    assert isinstance(device, str)
    return _with_measured_times(chain, model, batch, size, device, repeats)


def _with_measured_times(chain: Chain, model: ZooModel, batch: int, size: int, device: str,
                         repeats: int) -> Chain:
    """Replace the times of ``chain`` by times measured on ``device`` (torch bridge)."""
    import torch

    from optmem.chain import Chain
    from optmem.pytorch.profile import profile_chain

    with torch.device(device):
        net = model.build(size)
        sample = model.sample(batch, size, device=None)
    net.train()
    measured = profile_chain(net, sample, device=device, repeats=repeats, warmup=1,
                             progress=False)
    if measured.length != chain.length:  # both use extract_stages: never expected
        raise RuntimeError(f"measured {measured.length} stages, profiled {chain.length}")
    data = chain.to_dict()
    for stage, fwd, bwd in zip(data["stages"], measured.fwd_time, measured.bwd_time,
                               strict=True):
        stage["fwd_time"], stage["bwd_time"] = fwd, bwd
    data["loss"]["bwd_time"] = 0.0
    data["provenance"]["times"] = {
        "method": "measured", "device": device, "repeats": repeats,
        "profiler": "optmem.pytorch.profile.profile_chain (median of repeats, 1 warm-up)",
        "loss": "not timed (0)"}
    return Chain.from_dict(data)
