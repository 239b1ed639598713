"""Model zoo: published parameter counts, the meta-device profiler, the device models."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="the model zoo needs torch")
from torch import nn  # noqa: E402

from optmem.chain import Chain  # noqa: E402
from optmem.pytorch.devices import DEVICES, get_device  # noqa: E402
from optmem.pytorch.shapeprofile import profile_meta, profile_stage  # noqa: E402
from optmem.pytorch.zoo import ZOO, get_model, zoo_chain  # noqa: E402

# Published figures (torchvision model cards, the papers, HuggingFace GPT-2): (name, M params)
PUBLISHED = [
    ("resnet18", 11.7), ("resnet50", 25.6), ("resnet101", 44.5), ("resnet152", 60.2),
    ("densenet121", 8.0), ("densenet169", 14.1), ("vgg16", 138.4), ("vgg19", 143.7),
    ("inception3", 23.8), ("unet", 31.0), ("gpt2-small", 124.4), ("gpt2-medium", 354.8),
    ("gpt2-large", 774.0), ("vit-b16", 86.6),
]


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def build(name: str, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return get_model(name).build(**kwargs)


@pytest.mark.parametrize(("name", "millions"), PUBLISHED)
def test_parameter_counts_match_published(name: str, millions: float) -> None:
    n = count(build(name))
    assert n == ZOO[name].published_params
    assert abs(n / 1e6 - millions) < 0.05 * millions + 0.1


def test_inception_with_aux_head_is_27_2m() -> None:
    from optmem.pytorch.zoo.inception import InceptionAux

    with torch.device("meta"):
        aux = InceptionAux(768, 1000)
    assert round((count(build("inception3")) + count(aux)) / 1e6, 1) == 27.2


def test_resnet1001_shape_and_cifar_parameters() -> None:
    net = build("resnet1001")
    assert len(net) == 339  # rotor report: chain length 339 at block granularity
    # He et al. 2016 (identity mappings), Table: ResNet-1001 on CIFAR has 10.2 M parameters
    cifar = build("resnet1001", num_classes=10)
    assert abs(count(cifar) / 1e6 - 10.2) < 0.2
    wide = build("resnet1001-w64")
    assert len(wide) == 339 and count(wide) == ZOO["resnet1001-w64"].published_params


def test_gpt2_head_is_tied_and_outputs_vocab() -> None:
    net = build("gpt2-small")
    assert net.lm_head.weight is net.embed.wte.weight
    y = net(torch.zeros(2, 16, dtype=torch.long, device="meta"))
    assert tuple(y.shape) == (2, 16, 50257)


@pytest.mark.parametrize("name", ["resnet18", "densenet121", "inception3", "unet", "vit-b16",
                                  "vgg16"])
def test_models_run_forward_on_meta(name: str) -> None:
    entry = ZOO[name]
    net = build(name)
    y = net(entry.sample(2))
    if name == "unet":
        assert tuple(y.shape) == (2, 2, 512, 512)
    else:
        assert tuple(y.shape) == (2, 1000)


# ------------------------------------------------------------------ profiler
class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).relu()


def test_profile_stage_exact_sizes_for_a_small_stage() -> None:
    x = torch.empty(4, 20, device="meta")
    nbytes = 4 * 20 * 4
    rec, y = profile_stage(Scale(), x, None)
    assert rec["output_size"] == nbytes
    # relu keeps its output; the product is freed once relu ran, so it is overhead only
    assert rec["saved_size"] == nbytes
    assert rec["fwd_overhead"] == nbytes
    # threshold_backward's gradient and delta^{i-1} coexist: one gradient of temporaries
    assert rec["bwd_overhead"] == nbytes
    assert tuple(y.shape) == (4, 20) and not y.requires_grad


def test_profile_linear_keeps_no_copy_of_its_input() -> None:
    with torch.device("meta"):
        lin = nn.Linear(10, 30)
    rec, _ = profile_stage(lin, torch.empty(8, 10, device="meta"), get_device("v100"))
    assert rec["output_size"] == rec["saved_size"] == 8 * 30 * 4  # input & weight not counted
    assert rec["fwd_flops"] == 2 * 8 * 10 * 30
    assert rec["bwd_flops"] == 2 * rec["fwd_flops"]  # grad input + grad weight
    assert rec["fwd_time"] > 0 and rec["bwd_time"] > rec["fwd_time"]


def test_resnet50_flops_match_published_and_backward_is_twice() -> None:
    chain = zoo_chain("resnet50", 1, 224, device=None)
    fwd = sum(s["fwd_flops"] for s in chain.stage_extra)
    bwd = sum(s["bwd_flops"] for s in chain.stage_extra)
    assert abs(fwd / 2e9 - 4.1) < 0.1  # 4.1 GMACs per 224x224 image (He et al. 2016)
    assert 1.9 < bwd / fwd < 2.05
    assert all(t == 0 for t in chain.fwd_time)  # no device model: no times
    assert chain.extra["provenance"]["times"]["method"].startswith("none")


def test_profile_meta_matches_flop_counter_and_records_provenance() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                            nn.Flatten(1), nn.Linear(8 * 16 * 16, 10))
    x = torch.empty(2, 3, 16, 16, device="meta")
    with FlopCounterMode(display=False) as fc:
        net(x)
    chain = profile_meta(net, x, device="a100", name="tiny",
                         loss_fn=lambda y: y.sum())
    assert isinstance(chain, Chain) and chain.length == 4
    assert sum(s["fwd_flops"] for s in chain.stage_extra) == fc.get_total_flops()
    assert chain.weight_size[0] == (3 * 8 * 9 + 8) * 4
    assert chain.extra["parameters"] == count(net)
    prov = chain.extra["provenance"]
    assert prov["times"]["device"]["name"] == "A100"
    assert prov["flops"] == "torch.utils.flop_counter.FlopCounterMode"
    assert chain.input_size == 2 * 3 * 16 * 16 * 4
    again = Chain.from_dict(chain.to_dict())
    assert again.extra["provenance"] == prov  # unknown fields survive a round trip


def test_unet_stage_outputs_carry_the_skips() -> None:
    chain = zoo_chain("unet", 1, 64, device=None)
    # down0 outputs the first skip (64 x 64 x 64 floats); down1 carries it plus its own
    first = 64 * 64 * 64 * 4
    assert chain.output_size[0] == first
    assert chain.output_size[1] == first + 128 * 32 * 32 * 4
    assert all(s >= a for s, a in zip(chain.saved_size, chain.output_size, strict=True))


# ------------------------------------------------------------------ devices
def test_device_roofline() -> None:
    v100 = get_device("V100")
    assert v100 is DEVICES["v100"]
    big = v100.op_time(flops=1e12, nbytes=1e6)
    assert math.isclose(big, 1e12 / (14e12 * 0.75) + 5e-6)
    mem = v100.op_time(flops=0, nbytes=1e9)
    assert math.isclose(mem, 1e9 / (900e9 * 0.8) + 5e-6)
    a100 = get_device("a100", tf32=True)
    assert a100.flops_per_second("float32") == 156e12
    assert get_device("a100").flops_per_second("float32") == 19.5e12
    assert get_device("h100").flops_per_second("bfloat16") > a100.flops_per_second("bfloat16")


def test_unknown_device_and_model_are_clear_errors() -> None:
    from optmem.errors import OptmemInputError

    with pytest.raises(OptmemInputError, match="unknown device model"):
        get_device("tpu")
    with pytest.raises(OptmemInputError, match="no zoo model"):
        get_model("resnet9000")


def test_device_time_model_plugs_into_the_bridge() -> None:
    from optmem.pytorch.shapeprofile import device_time_model

    with torch.device("meta"):
        lin = nn.Linear(64, 64)
    fwd, bwd = device_time_model("h100")(lin, torch.empty(32, 64, device="meta"), None)
    assert 0 < fwd < bwd


def test_zoo_names_are_registered_for_optmem_profile() -> None:
    import optmem.pytorch.zoo.registry  # noqa: F401
    from optmem.pytorch.models import list_models, resolve_spec

    names = {m.name for m in list_models()}
    assert set(ZOO) <= names
    module, sample = resolve_spec("resnet18", batch=3, device="meta")
    assert tuple(sample.shape) == (3, 3, 224, 224) and sample.device.type == "meta"
    assert count(module) == ZOO["resnet18"].published_params


# ------------------------------------------------------------------ with the torch bridge
@pytest.mark.parametrize(("name", "size"), [("resnet18", 32), ("unet", 32)])
def test_meta_profile_drives_the_bridge_with_exact_gradients(name: str, size: int) -> None:
    """A plan solved on the meta-device profile runs on the real model, same gradients."""
    import copy

    from optmem.pytorch import checkpoint
    from optmem.solvers.dataset_summary import compute_summary

    torch.manual_seed(0)
    entry = ZOO[name]
    net = entry.build(size).train()
    x = torch.randn(2, 3, size, size)
    chain = zoo_chain(name, 2, size, device="v100")
    summary = compute_summary(chain)
    limit = (summary["min_feasible"] + summary["store_all"]) // 2
    ref = copy.deepcopy(net)
    entry.loss_fn()(ref(x)).backward()
    cnet = checkpoint(net, x, memory_limit=limit, chain=chain)
    assert cnet.result.peak_memory * cnet.result.unit <= limit
    assert len(cnet.result.plan) > 2 * chain.length + 1  # something is recomputed
    entry.loss_fn()(cnet(x)).backward()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_zoo_chain_with_locally_measured_times() -> None:
    chain = zoo_chain("resnet18", 2, 32, device="cpu", repeats=1)  # batch norm needs 2
    meta = zoo_chain("resnet18", 2, 32, device=None)
    assert chain.saved_size == meta.saved_size and chain.output_size == meta.output_size
    assert sum(chain.fwd_time) > 0 and sum(chain.bwd_time) > 0
    times = chain.extra["provenance"]["times"]
    assert times["method"] == "measured" and times["device"] == "cpu"
