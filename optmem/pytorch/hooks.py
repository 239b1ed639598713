"""Hooks that an extracted graph would silently drop: refused or reported, never lost.

A graph from ``torch.export`` or ``torch.fx`` holds the tensor operations that ran while it
was traced, nothing else:

* **backward hooks** of a module (``register_full_backward_hook``,
  ``register_full_backward_pre_hook``, the global ones) never run: a hook that scales or
  clips ``grad_input`` would be lost and the gradients silently wrong. They are refused
  (:func:`check_backward_hooks`).
* **tensor hooks registered during the forward** (``h.register_hook(fn)``, e.g. gradient
  clipping of an activation) are registered on the trace's fake tensors only: refused
  (:func:`refuse_tensor_hooks`).
* **Python or NumPy randomness** drawn during the forward (``random.random()`` for a
  LayerDrop) is baked into the graph as the values of the trace: refused
  (:func:`refuse_python_random`).
* **forward hooks** and pre-hooks ran while tracing: their tensor effects (weight norm's
  recomputed weight, a scaled output) are in the graph. Those of inner modules that return
  ``None`` (observers: a hook that records activations) are called at every step with the
  real values (:mod:`optmem.pytorch.observers`, stop 85); the Python side effects of the
  others happened once, on fake tensors, and never again: they are reported with a
  warning (:func:`warn_forward_hooks`).

Stages that are the user's own modules (an ``nn.Sequential``, a list of stages) run their
hooks themselves: none of this applies to them.

The *global* module forward hooks (``register_module_forward_hook``) and the dispatch modes
active around a call are the caller's tools observing a step (``MemTracker``,
``ModTracker``, ``FlopCounterMode``), not part of the model: extraction, profiling and
measuring run outside them (:func:`callers_tools_suspended`), and the tools observe the
stage calls of every step. Those calls leave no other trace either: the buffers the model
updates and the host random states it draws from are put back
(:func:`buffers_restored`, :func:`host_random_restored`).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np
import torch
from torch import nn
from torch.nn.modules import module as module_mod
from torch.utils._python_dispatch import _disable_current_modes

from optmem.errors import OptmemInputError

__all__ = ["buffers_restored", "callers_tools_suspended", "check_backward_hooks",
           "check_module_hooks", "cuda_indices", "generators_restored", "has_module_hooks",
           "library_hook",
           "hooks_emptied", "host_random_restored", "module_generators", "parameters_unmodified",
           "quiet_gradient_hooks", "draws_whatever_config",
           "random_config", "refuse_inference_rescaling", "refuse_python_random",
           "refuse_tensor_hooks", "same_generator", "saved_tensors_hooks_allowed",
           "saved_tensors_hooks_disabled", "suspended_global_hooks",
           "SeededDraws",
           "warn_container_hooks", "warn_forward_hooks"]

_ALTERNATIVE = ("remove it, or pass an nn.Sequential of blocks or a list of stage modules "
                "(stages that are your modules run their hooks themselves)")


def _where(root: nn.Module, name: str, sub: nn.Module) -> str:
    path = f"{type(root).__name__}.{name}" if name else type(root).__name__
    return f"{path} ({type(sub).__name__})"


def check_backward_hooks(module: nn.Module) -> None:
    """Refuse backward hooks on ``module``, its submodules, or global ones.

    Raises
    ------
    OptmemInputError
        Naming the first module with a backward hook (or the global registry).
    """
    if module_mod._global_backward_hooks or module_mod._global_backward_pre_hooks:
        raise OptmemInputError(
            "a global module backward hook is registered (torch.nn.modules.module."
            "register_module_full_backward_hook): an extracted graph never runs it, so "
            f"gradients could be silently wrong; {_ALTERNATIVE}", field="module")
    for name, sub in module.named_modules():
        if sub._backward_hooks or sub._backward_pre_hooks:
            raise OptmemInputError(
                f"{_where(module, name, sub)} has a backward hook: an extracted graph never "
                f"runs it, so gradients could be silently wrong; {_ALTERNATIVE}",
                field="module")


def has_module_hooks(module: nn.Module) -> bool:
    """Whether ``module`` itself has forward, forward-pre, backward or backward-pre hooks."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def warn_container_hooks(containers: Iterable[tuple[str, nn.Module]]) -> list[str]:
    """Warn about hooks on the ``nn.Sequential`` containers whose entries run as stages.

    The plan calls the stages (the entries of an ``nn.Sequential``, flattened through the
    nested ones), never the containers, so their hooks are not called (documented); before
    (until stop 52) silently: an output hook scaling the wrapped ``nn.Sequential`` by 3
    was ignored, gradients 0.82 apart. ``containers``: ``(name, module)``, the root first
    (name ``""``). Returns where the hooks are (empty: none, no warning).
    """
    where = [f"{type(sub).__name__} {name}" if name else f"the {type(sub).__name__} itself"
             for name, sub in containers if has_module_hooks(sub)]
    if where:
        warnings.warn(
            f"module hooks on {', '.join(where[:3])}{' ...' if len(where) > 3 else ''}: "
            "optmem calls the entries of an nn.Sequential as stages, never the containers, "
            "so these hooks are not called; register a hook of the whole model on the "
            "wrapper optmem returned (cmodel.register_forward_hook, ...), one of a block on "
            "its entries, or keep the block whole (not_really_sequential = True)",
            stacklevel=4)
    return where


def refuse_inference_rescaling(module: nn.Module) -> None:
    """Refuse a model that rescales its weights in place when it runs in eval mode (HF RWKV).

    RWKV with ``config.rescale_every = k > 0`` divides the output weights of block ``i`` by
    ``2 ** (i // k)`` in place at its first forward in eval mode, and multiplies them back at
    its next forward in training mode (``_rescale_layers``, an overflow aid for float16
    inference). Under the wrapper a call without gradients runs the model (the weights are
    divided), but a training call runs the stages, which do not run that Python: they
    trained on the divided weights, in silence (4 layers, ``rescale_every=2``: logits 0.98
    off after one ``eval()`` call under ``no_grad``). With at most ``k`` blocks every factor
    is 1, but the flag it leaves (``layers_are_rescaled``) is read by the next training
    forward: a call of a new size extracted after eval calls had no plan at 60 % (3 layers,
    ``rescale_every=6``, the default; smallest 97 % of its store-all peak, 26 % without the
    eval calls). Any ``k > 0`` is refused.

    Raises
    ------
    OptmemInputError
        Naming the config field and the value to set.
    """
    config = getattr(module, "config", None)
    every = getattr(config, "rescale_every", None)
    if not _draws(every):
        return
    raise OptmemInputError(
        f"{type(module).__name__} rescales its weights in place when it runs in eval mode "
        f"(config.rescale_every={every}) and back at its next training "
        "forward; the stages of a wrapped training call do not run that code, so after an "
        "eval() call they would train on the rescaled weights. Set "
        "model.config.rescale_every = 0 before wrapping (it only guards float16 inference "
        "against overflow; training computes the same)", field="module")


def check_module_hooks(module: nn.Module) -> None:
    """Before extracting ``module``: refuse its backward hooks, warn about its forward ones.

    Raises
    ------
    OptmemInputError
        From :func:`check_backward_hooks`.
    """
    check_backward_hooks(module)
    warn_forward_hooks(module)


def warn_forward_hooks(module: nn.Module, called: Collection[int] = ()) -> list[str]:
    """Warn about forward hooks and pre-hooks; return where they are.

    Their tensor effects are traced into the graph; their Python side effects ran once,
    while tracing, on fake tensors. HuggingFace's output-capturing hooks (transformers 5
    installs them on a model's layers the first time a call asks for hidden states, as
    LLaVA asks its vision tower) are not named: what they capture is returned into the
    forward, so it is in the graph, and a user cannot remove them. Neither are the hooks
    whose ids are in ``called``: the observers the wrapper calls at every step (stop 85,
    :mod:`optmem.pytorch.observers`).
    """
    hooked = [(name, sub) for name, sub in module.named_modules()
              if any(not _hf_capture(h) and k not in called
                     for hooks in (sub._forward_hooks, sub._forward_pre_hooks)
                     for k, h in hooks.items())]
    where = [_where(module, name, sub) for name, sub in hooked]
    if where:
        warnings.warn(
            f"forward hooks on {', '.join(where[:3])}{' ...' if len(where) > 3 else ''}: "
            "what they compute is traced into optmem's graph, but they are not called again "
            "(side effects such as recording activations happen once, at extraction, on fake "
            "tensors; a hook of an inner module that returns None is called at every step, "
            "unless it is next to a hook of the same kind that returns a value or receives "
            f"values the graph does not hold); if they must run every step, {_ALTERNATIVE}"
            f"{_HF_CHECKPOINTING if _has_hf_input_grad_hook(hooked) else ''}", stacklevel=3)
    return where


def library_hook(hook: Any) -> bool:
    """Whether ``hook`` is a library's own, part of how the model computes.

    HuggingFace's output capturing and input-grads hooks, and torch's (``spectral_norm``,
    ``weight_norm``, pruning: pre-hooks that return ``None`` but set the weight the forward
    reads, so their effect is in the graph).
    """
    module = getattr(hook, "__module__", None) or type(hook).__module__
    return _hf_capture(hook) or module.startswith("torch.") or \
        "enable_input_require_grads" in getattr(hook, "__qualname__", "")


def _hf_capture(hook: Any) -> bool:
    """Whether ``hook`` is one of HuggingFace's output-capturing forward hooks."""
    return getattr(hook, "__module__", "") == "transformers.utils.output_capturing"


_HF_CHECKPOINTING = (". The hook is HuggingFace's, from gradient_checkpointing_enable(): "
                     "optmem's plan replaces that checkpointing, so "
                     "model.gradient_checkpointing_disable() and "
                     "model.disable_input_require_grads() before wrapping remove both")


def _has_hf_input_grad_hook(hooked: list[tuple[str, nn.Module]]) -> bool:
    """Whether a hook is HF's ``enable_input_require_grads`` (gradient checkpointing's)."""
    return any("enable_input_require_grads" in getattr(h, "__qualname__", "")
               for _, sub in hooked for h in sub._forward_hooks.values())


@contextmanager
def parameters_unmodified(model: nn.Module) -> Iterator[None]:
    """Within: the setup of a wrapper; on a normal exit, refuse a parameter it modified.

    Extracting, profiling and measuring run the forward several times. A forward that
    updates a parameter in place (an EMA teacher's or a momentum encoder's weights,
    ``p.mul_(m).add_(q, alpha=1 - m)`` under ``no_grad``) would have that update applied
    at each of those runs, and the model would train on from weights the plain model never
    had (stop 83: BYOL's target 4.5e-8 off after wrapping, 0.29 in the loss after a
    re-extraction). Read from the version counters (no copy of any parameter): one
    ``OptmemInputError`` names the first parameter modified.
    """
    named = list(model.named_parameters(remove_duplicate=True))
    versions = [p._version for _, p in named]
    yield
    for (name, p), version in zip(named, versions, strict=True):
        if p._version != version:
            raise OptmemInputError(
                f"{type(model).__name__}'s forward modifies its parameter {name!r} in place "
                "(an EMA or momentum update inside forward): optmem runs the forward several "
                "times to extract and profile it, which would apply that update each time. "
                "Update it outside the forward (after optimizer.step()), then wrap",
                field="module")


@contextmanager
def buffers_restored(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Put every buffer of ``modules`` back as it was on entry, writing only what changed.

    Measuring, extracting and profiling run the model's code, which updates buffers (batch
    norm statistics and counters). On exit a buffer the body replaced by another tensor is
    put back, and one whose values differ gets its old values copied in, through ``.data``:
    the restore itself moves no version counter. A graph the caller built before the body
    therefore still back-propagates: an embedding saves a slice of an index buffer (BERT's
    ``token_type_ids``), and a ``copy_`` on the buffer would fail that backward with
    "modified by an inplace operation". (The values are compared, not the versions: the
    native batch norm updates its running statistics without a new version.) A buffer the
    body resized in place (``resize_``: the per-channel min/max of a QAT observer start
    empty) gets its old shape and values back.
    """
    saved: dict[tuple[int, str], tuple[nn.Module, torch.Tensor, torch.Tensor]] = {}
    for sub in (s for m in modules for s in m.modules()):
        for name, buf in sub._buffers.items():
            if buf is not None and (id(sub), name) not in saved:
                saved[(id(sub), name)] = (sub, buf, buf.detach().clone())
    try:
        yield
    finally:
        with torch.no_grad():
            for (_, name), (sub, buf, old) in saved.items():
                if sub._buffers.get(name) is not buf:
                    sub._buffers[name] = buf
                if buf.is_meta:  # no values to compare nor to restore
                    continue
                if buf.shape != old.shape:  # resized in place (a per-channel observer's
                    buf.data = old           # min/max start empty): take the old tensor
                elif not torch.equal(buf, old):
                    buf.data.copy_(old)


@contextmanager
def host_random_restored() -> Iterator[None]:
    """Within: Python's and NumPy's global random states are put back on exit.

    For a call that leaves no trace: the model may draw from them
    (:func:`refuse_python_random`).
    """
    state, numpy_state = random.getstate(), np.random.get_state()  # noqa: NPY002
    try:
        yield
    finally:
        random.setstate(state)
        np.random.set_state(numpy_state)  # noqa: NPY002


def module_generators(modules: nn.Module | Iterable[nn.Module]) -> list[torch.Generator]:
    """The ``torch.Generator`` objects that ``modules`` (and their submodules) hold, once each.

    A model may draw from a generator of its own (``torch.randn(..., generator=self.gen)``:
    noise injection, diffusion timesteps). ``torch.export`` keeps that object as a constant
    of the graph (``lifted_custom_0``), so a stage holds the model's generator itself.
    Unlike the global RNG, no ``fork_rng`` saves it: whoever runs the model's code
    without it counting (profiling, a re-run) must put these states back.

    Parameters
    ----------
    modules
        A module, or modules (their submodules are searched too).

    Returns
    -------
    list of torch.Generator
        The generators found in the modules' attributes, in module order.
    """
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    found: dict[int, torch.Generator] = {}
    for root in roots:
        for sub in root.modules():
            for value in vars(sub).values():
                if isinstance(value, torch.Generator):
                    found.setdefault(id(value), value)
    return list(found.values())


def cuda_indices(tensors: Iterable[torch.Tensor]) -> list[int]:
    """The indices of the CUDA devices holding ``tensors``, sorted, once each.

    The devices whose CUDA generators a re-run of code reading ``tensors`` forks and
    restores (``torch.random.fork_rng(devices=...)`` takes device indices).

    Examples
    --------
    >>> cuda_indices([torch.zeros(1)])
    []
    """
    return sorted({t.device.index or 0 for t in tensors if t.is_cuda})


def same_generator(a: torch.Generator, b: torch.Generator) -> bool:
    """Whether ``a`` and ``b`` are one generator (two Python objects may share one state).

    ``torch.export`` lifts a generator the forward draws from as a constant of the graph:
    another Python object on the model's generator, which drawing from either advances.
    Decided by reseeding ``a`` and reading ``b``; both states are put back.

    Parameters
    ----------
    a, b
        The generators.

    Returns
    -------
    bool
        ``True`` when they share their state.
    """
    if a is b:
        return True
    if a.device != b.device:
        return False
    state_a, state_b = a.get_state(), b.get_state()
    if not torch.equal(state_a, state_b):
        return False
    try:
        a.manual_seed(a.initial_seed() + 1)
        return not torch.equal(b.get_state(), state_b)
    finally:
        a.set_state(state_a)
        b.set_state(state_b)


@contextmanager
def generators_restored(generators: Iterable[torch.Generator]) -> Iterator[None]:
    """Within: the states of ``generators`` (see :func:`module_generators`) are put back on exit.

    Parameters
    ----------
    generators
        The generators to restore (``torch.random.fork_rng`` does the global ones).
    """
    saved = [(g, g.get_state()) for g in generators]
    try:
        yield
    finally:
        for g, state in saved:
            g.set_state(state)


def _numpy_state() -> tuple[Any, ...]:
    """NumPy's legacy global generator (the one ``np.random.random()`` draws from)."""
    state: Any = np.random.get_state()  # noqa: NPY002
    return (state[0], state[1].tobytes(), *state[2:])


#: HF config fields that make a model draw at random while it trains, and what draws.
_RANDOM_KNOBS = {
    "layerdrop": "LayerDrop", "encoder_layerdrop": "LayerDrop",
    "decoder_layerdrop": "LayerDrop", "mask_time_prob": "SpecAugment's time masks",
    "mask_feature_prob": "SpecAugment's feature masks",
}


def random_config(module: nn.Module | None) -> str:
    """A sentence naming the HF config fields that draw at random in training, or ``""``.

    LayerDrop (``layerdrop``, a branch on ``torch.rand`` skipping whole layers) and
    SpecAugment's masks (``mask_time_prob``, ``mask_feature_prob``, drawn with NumPy) change
    the computed graph from step to step, so no extracted graph can hold them; HF reads these
    fields at every call, so setting them to 0 on ``model.config`` is enough, except where
    a submodule copied ``layerdrop`` when built (M2M100, NLLB): that copy is named too. Time masks
    drawn outside and passed as ``mask_time_indices`` are an input like any other.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> m = nn.Linear(1, 1)
    >>> m.config = SimpleNamespace(layerdrop=0.1, mask_time_prob=0.0)
    >>> print(random_config(m).strip())  # doctest: +NORMALIZE_WHITESPACE
    Its config draws at random in training: layerdrop=0.1 (LayerDrop);
    set model.config.layerdrop = 0.0 before wrapping. A model that draws for every layer
    whatever these values (HF VITS and MMS-TTS draw np.random.uniform(0, 1) per encoder
    layer, MusicGen random.uniform, each compared with layerdrop, 0 or not) is refused again
    after: only a change of its code (drawing with torch's RNG) helps there.
    """
    config = getattr(module, "config", None)
    if config is None or not getattr(module, "training", False):
        return ""
    found = [(key, value) for key in _RANDOM_KNOBS
             if _draws(value := getattr(config, key, None))]
    copies = _layerdrop_copies(module) if module is not None else []
    if not found and not copies:
        return ""
    named = ", ".join([f"{key}={value} ({_RANDOM_KNOBS[key]})" for key, value in found]
                      + [f"model.{name}.layerdrop={value} (LayerDrop, copied when built)"
                         for name, value in copies])
    fix = "; ".join([f"model.config.{key} = 0.0" for key, _ in found]
                    + [f"model.{name}.layerdrop = 0.0" for name, _ in copies])
    keep = (" To keep SpecAugment's time masks, draw them outside the model and pass them "
            "as mask_time_indices= (transformers' _compute_mask_indices): they are then "
            "an input, new at every call." if any(k == "mask_time_prob" for k, _ in found)
            else "")
    return (f" Its config draws at random in training: {named}; set {fix} before "
            f"wrapping.{keep}{_STILL_DRAWS}")


#: What follows when a model draws whatever its config (said beside the config's advice).
_STILL_DRAWS = (" A model that draws for every layer whatever these values (HF VITS and MMS-TTS "
                "draw np.random.uniform(0, 1) per encoder layer, MusicGen random.uniform, "
                "each compared with layerdrop, 0 or not) is refused again after: only a "
                "change of its code (drawing with torch's RNG) helps there.")


def draws_whatever_config(fix: str) -> str:
    """The sentence for a model that draws at random with every random option of its config off.

    HF MusicGen draws ``random.uniform(0, 1)`` for every layer, VITS and MMS-TTS
    ``np.random.uniform(0, 1)`` (:func:`refuse_python_random`), OmniASR ``torch.rand([])``
    (a branch no graph holds, :func:`optmem.pytorch.extract.extract_program`), each compared
    with ``layerdrop``, 0 or not: only a change of the model's code (``fix``) helps.

    Examples
    --------
    >>> draws_whatever_config("drawing with torch's RNG").endswith("RNG) helps")
    True
    """
    return (" No random option of its config is on, so it draws them whatever the config (HF "
            "MusicGen draws random.uniform(0, 1) for every layer, VITS and MMS-TTS "
            "np.random.uniform(0, 1), OmniASR torch.rand([]), and compare it with layerdrop, "
            f"0 or not): only a change of its code ({fix}) helps")


def _layerdrop_copies(module: nn.Module) -> list[tuple[str, float]]:
    """Submodules holding their own ``layerdrop`` above 0, with its value.

    Copied from the config when built (M2M100's and NLLB's encoder and decoder): the
    config no longer drives them.
    """
    return [(name, value) for name, sub in module.named_modules()
            if name and _draws(value := getattr(sub, "layerdrop", None))]


def _draws(value: Any) -> TypeGuard[float]:
    """Whether a probability setting is on: a number (not a bool) above 0."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


@dataclass
class SeededDraws:
    """The host generators a traced call seeded itself before drawing, as the call left them.

    HF BigBird's block-sparse attention calls ``np.random.seed(layer_index)`` in training,
    then draws its random blocks: the draws depend on the seed only, so the trace's values
    are the ones every call draws, and the graph may keep them. The call leaves NumPy's
    global generator in a fixed state, which a later ``np.random`` draw of the caller sees;
    the wrapper, whose graph does not run that Python, leaves it so with :meth:`replay`.

    Attributes
    ----------
    python
        ``random.getstate()`` after the call, or ``None`` (not seeded by the call).
    numpy
        ``np.random.get_state()`` after the call, or ``None``.
    """

    python: Any = None
    numpy: Any = None

    def __bool__(self) -> bool:
        return self.python is not None or self.numpy is not None

    def replay(self) -> None:
        """Leave the generators the call seeded as the model's call leaves them."""
        if self.python is not None:
            random.setstate(self.python)
        if self.numpy is not None:
            np.random.set_state(self.numpy)  # noqa: NPY002


@contextmanager
def _first_seeds() -> Iterator[dict[str, Any]]:
    """Within: each host generator's state when the code first seeds it, by name.

    ``random.seed`` and ``np.random.seed`` are replaced by recorders that call them; the
    names are ``"random"`` and ``"numpy.random"`` (as :func:`refuse_python_random` says).
    """
    first: dict[str, Any] = {}
    python_seed, numpy_seed = random.seed, np.random.seed  # noqa: NPY002

    def seed_python(*args: Any, **kwargs: Any) -> None:
        first.setdefault("random", random.getstate())
        python_seed(*args, **kwargs)

    def seed_numpy(*args: Any, **kwargs: Any) -> None:
        first.setdefault("numpy.random", _numpy_state())
        numpy_seed(*args, **kwargs)

    random.seed, np.random.seed = seed_python, seed_numpy  # type: ignore[assignment]
    try:
        yield first
    finally:
        random.seed, np.random.seed = python_seed, numpy_seed  # type: ignore[assignment]


@contextmanager
def refuse_python_random(module_name: str, module: nn.Module | None = None,
                         seeded: SeededDraws | None = None) -> Iterator[None]:
    """Within (while tracing): refuse draws from Python's ``random`` or NumPy's global RNG.

    A traced graph holds the values such draws gave *while tracing*: a LayerDrop written as
    ``if random.random() < p: skip the layer`` would skip the same layers at every step.
    torch's own RNG is not concerned (its random ops are graph nodes, replayed each call).
    With ``module``, the message names its HF config fields that draw
    (:func:`random_config`). A generator the call seeds itself before its first draw
    (``np.random.seed(seed)``, HF BigBird) draws the same values at every call: accepted,
    whatever its state before, and the state the call leaves it in is put in ``seeded``
    (:class:`SeededDraws`).

    Raises
    ------
    OptmemInputError
        On leaving, when either generator's state moved, but for one seeded first.
    """
    before = {"random": random.getstate(), "numpy.random": _numpy_state()}
    with _first_seeds() as first:
        yield
    after = {"random": random.getstate(), "numpy.random": _numpy_state()}
    own = [name for name in before if name in first and first[name] == before[name]]
    moved = [name for name in before if after[name] != before[name] and name not in own]
    if moved:
        config = random_config(module)
        advice = (" Otherwise turn them off (e.g. layerdrop=0) or draw them with torch's RNG; "
                  "or " if config or getattr(module, "config", None) is None else
                  draws_whatever_config("drawing with torch's RNG") + "; or ")
        raise OptmemInputError(
            f"{module_name} draws random numbers from {' and '.join(moved)} while it runs "
            "(a LayerDrop or a mask written with Python or NumPy randomness): an extracted "
            f"graph would replay the draws of the trace at every step.{config}{advice}"
            f"{_ALTERNATIVE}", field="module")
    if seeded is not None:
        seeded.python = random.getstate() if "random" in own else None
        seeded.numpy = np.random.get_state() if "numpy.random" in own else None  # noqa: NPY002


@contextmanager
def refuse_tensor_hooks(module_name: str) -> Iterator[None]:
    """Within (while tracing): ``Tensor.register_hook`` is recorded; raise on leaving.

    Raises
    ------
    OptmemInputError
        Naming the hook function and where it is defined.
    """
    original = torch.Tensor.register_hook
    met: list[str] = []

    def record(self: torch.Tensor, hook: Callable[..., Any]) -> Any:
        code = getattr(hook, "__code__", None)
        place = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
        met.append(f"{getattr(hook, '__qualname__', repr(hook))}{place}")
        return original(self, hook)

    torch.Tensor.register_hook = record  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.register_hook = original  # type: ignore[method-assign]
    if met:
        raise OptmemInputError(
            f"{module_name} registers a tensor hook in its forward ({met[0]}): an extracted "
            f"graph never registers it, so gradients could be silently wrong; {_ALTERNATIVE}",
            field="module")


@contextmanager
def quiet_gradient_hooks(tensors: Iterable[torch.Tensor], *,
                         post_accumulate: bool = True) -> Iterator[None]:
    """Within: the gradient hooks of ``tensors`` (parameters) do not run.

    ``p.register_hook(fn)`` and ``p.register_post_accumulate_grad_hook(fn)`` keep their
    hooks in a dictionary that autograd reads when it runs them; emptying it for a while
    silences them, restoring it (same order) brings them back. Used where optmem itself
    back-propagates into parameters for a purpose of its own:

    * the executor computes each stage's parameter gradients with ``torch.autograd.grad``
      (which runs a leaf's tensor hooks) and returns them to autograd, which runs them
      again when it accumulates: a hook ``g * 0.5`` halved the gradient twice;
    * profiling and measuring run training steps whose gradients are thrown away: a
      post-accumulate hook (an optimizer step in the backward) ran once per profiled step.
    """
    saved: list[tuple[dict[Any, Any], list[tuple[Any, Any]]]] = []
    for t in tensors:
        for hooks in (t._backward_hooks,
                      t._post_accumulate_grad_hooks if post_accumulate else None):
            if hooks:
                saved.append((hooks, list(hooks.items())))
                hooks.clear()
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.update(items)


# the global forward hook registries: where torch's tools (ModTracker and those built on
# it) put their hooks; the backward ones stay (refused by check_backward_hooks)
_GLOBAL_FORWARD_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                         "_global_forward_hooks_with_kwargs",
                         "_global_forward_hooks_always_called")
# what each callers_tools_suspended (innermost last) took out of those registries
_SUSPENDED: list[dict[str, list[tuple[int, Any]]]] = []


@contextmanager
def callers_tools_suspended() -> Iterator[None]:
    """Within: no dispatch mode of the caller and no global module forward hook runs.

    ``FlopCounterMode``, ``MemTracker`` and ``ModTracker`` observe a step through a
    dispatch mode and global module forward hooks. Extracting, profiling and measuring
    are optmem's setup work, not the user's step: under such a tool the trace would record
    the tool itself (``ModTracker`` registers tensor hooks in the forward, which
    :func:`refuse_tensor_hooks` refuses), the profile would time the tool's Python, and the
    tool would count the setup's fake and real runs as the step's. The registries are
    emptied in place and refilled on exit (hooks registered meanwhile are kept, after the
    suspended ones). The caller's autocast weight cache is left alone too
    (:func:`autocast_cache_untouched`), and so is ``parametrize.cached()``'s
    (:func:`parametrization_cache_off`); inside the caller's
    ``disable_saved_tensors_hooks`` region the setup may still measure the tapes it
    saves (:func:`saved_tensors_hooks_allowed`). What it takes away is listed by
    :func:`suspended_global_hooks`: the wrapper's export calls the user's global hooks
    on the model's own modules (:func:`~optmem.pytorch.observers.global_hooks_traced`,
    stop 87).
    """
    registries = [getattr(module_mod, name) for name in _GLOBAL_FORWARD_HOOKS]
    _SUSPENDED.append({name: list(registry.items())
                       for name, registry in zip(_GLOBAL_FORWARD_HOOKS, registries, strict=True)})
    try:
        with hooks_emptied(registries), _disable_current_modes(), autocast_cache_untouched(), \
                parametrization_cache_off(), saved_tensors_hooks_allowed():
            yield
    finally:
        _SUSPENDED.pop()


def suspended_global_hooks() -> dict[str, list[tuple[int, Any]]]:
    """The global forward hooks (and their flags) the enclosing setup suspended, by registry.

    Keyed by the name of the registry in ``torch.nn.modules.module``
    (``_global_forward_hooks``, ...), each its ``(handle id, value)`` items in order; empty
    outside :func:`callers_tools_suspended`. A nested suspension finds the registries empty:
    every level's items are merged.
    """
    merged: dict[str, list[tuple[int, Any]]] = {name: [] for name in _GLOBAL_FORWARD_HOOKS}
    for level in _SUSPENDED:
        for name, items in level.items():
            merged[name] += items
    return merged


@contextmanager
def hooks_emptied(registries: Iterable[dict[Any, Any]]) -> Iterator[None]:
    """Within: each hook dictionary of ``registries`` empty; on exit refilled in place.

    Its hooks come back first, in their order; hooks registered meanwhile are kept, after
    them (used for the global module hooks during optmem's setup, and for a wrapped
    model's own forward hooks during its extraction).

    Examples
    --------
    >>> hooks = {1: "a", 2: "b"}
    >>> with hooks_emptied([hooks]):
    ...     hooks[3] = "c"
    ...     sorted(hooks)
    [3]
    >>> list(hooks.items())
    [(1, 'a'), (2, 'b'), (3, 'c')]
    """
    saved = [(registry, list(registry.items())) for registry in registries if registry]
    for registry, _ in saved:
        registry.clear()
    try:
        yield
    finally:
        for registry, items in saved:
            added = list(registry.items())
            registry.clear()
            registry.update(items)
            registry.update(added)


def saved_tensors_hooks_disabled() -> bool:
    """Whether the caller disabled saved-tensor hooks (``disable_saved_tensors_hooks``).

    Examples
    --------
    >>> saved_tensors_hooks_disabled()
    False
    >>> with torch.autograd.graph.disable_saved_tensors_hooks("not here"):
    ...     saved_tensors_hooks_disabled()
    True
    """
    return torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is not None


@contextmanager
def saved_tensors_hooks_allowed() -> Iterator[None]:
    """Within: saved-tensor hooks may be registered, also in a caller's region that forbids them.

    ``torch.autograd.graph.disable_saved_tensors_hooks(message)`` makes every
    ``saved_tensors_hooks`` registration raise ``RuntimeError(message)``. Profiling counts
    a stage's tape with such hooks, so a first call of a new signature in that region (or
    wrapping there) failed with the caller's message (stop 86). The setup's hooks see only
    its own runs on graph-free copies; the region is disabled again, with the caller's
    message, on exit.

    Examples
    --------
    >>> with torch.autograd.graph.disable_saved_tensors_hooks("not here"):
    ...     with saved_tensors_hooks_allowed():
    ...         saved_tensors_hooks_disabled()
    ...     saved_tensors_hooks_disabled()
    False
    True
    """
    message = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    if message is None:
        yield
        return
    torch._C._autograd._saved_tensors_hooks_enable()
    try:
        yield
    finally:
        torch._C._autograd._saved_tensors_hooks_disable(message)


@contextmanager
def parametrization_cache_off() -> Iterator[None]:
    """Within: ``torch.nn.utils.parametrize.cached()`` caches nothing, as outside it.

    Inside the caller's ``cached()`` region a parametrized weight is computed once, at its
    first use, and that tensor, with the autograd graph it was made with, is read by every
    later use in the region. The first call of a new signature there (a parametrization
    registered after wrapping) extracted and measured the model with it: the measuring
    step's backward freed the cached weight's graph, and the user's own step then failed
    with "Trying to backward through the graph a second time" (stop 83), where the plain
    model trains; an export would also have kept a traced tensor in the cache. The
    caller's cached entries stay, for after.

    Examples
    --------
    >>> from torch.nn.utils import parametrize
    >>> with parametrize.cached(), parametrization_cache_off():
    ...     parametrize._cache_enabled
    0
    >>> parametrize._cache_enabled
    0
    """
    from torch.nn.utils import parametrize

    enabled = parametrize._cache_enabled
    parametrize._cache_enabled = 0
    try:
        yield
    finally:
        parametrize._cache_enabled = enabled


@contextmanager
def autocast_cache_untouched() -> Iterator[None]:
    """Within: no cast is added to the caller's autocast weight cache.

    Under ``torch.autocast`` (``cache_enabled=True``, the default) the low-precision copy
    of a weight made at its first use is kept until the outermost autocast region exits,
    and every later use in the region reads that copy, through the autograd node made with
    it. Wrapping or extracting inside the caller's region (the first call of a new
    signature under autocast) ran setup steps that made those copies: the step then read
    them, and autograd, which runs ready nodes latest-made first, summed the
    contributions of a weight used three times (BART's embedding, shared by the encoder,
    the decoder and the head) in another order than the plain model (1.5e-8 on that
    call). Casts made within are not cached, as outside any region; the caller's own
    entries stay.
    """
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)
